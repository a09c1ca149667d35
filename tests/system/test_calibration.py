"""Calibration before planning (issue 30, item 2): each device times its drafter and says so at registration,
the edge times the target's verification at a few batch shapes, and round 0 is planned on both; the records
say which inputs were calibrated and meta.json / summary.json what calibration measured.

The live test runs real processes (micro pair); the others are pure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_node.calibration import calibrate_verification, fit_line, shapes_for
from edge_node.controller import Controller, round_record
from testbed.core.scenario import Scenario
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

SC = {"vocab_size": 1000, "max_draft_len": 6,
      "devices": [{"name": "d0", "distance_m": 100, "draft_time_s": 0.02, "acceptance": 0.7},
                  {"name": "d1", "distance_m": 200, "draft_time_s": 0.02, "acceptance": 0.6}]}


# -- the wire -------------------------------------------------------------------------------------------

def _register_header(**kw) -> dict:
    return P.decode(M.register("d0", 1000, {"name": "phone"}, **kw))[0]


def test_register_carries_an_optional_drafting_time_and_old_devices_still_register():
    assert M.parse_register(_register_header(draft_time_s=0.004)).draft_time_s == pytest.approx(0.004)
    old = _register_header()
    assert "draft_time_s" not in old and M.parse_register(old).draft_time_s is None
    for bad in (0.0, -1.0, 1e3, "fast", True):
        with pytest.raises(ProtocolError, match="register.draft_time_s"):
            M.parse_register({**old, "draft_time_s": bad})


# -- the controller -------------------------------------------------------------------------------------

def _record(ctl: Controller, r: int = 0) -> dict:
    rp = ctl.plan_round(r, ["d0", "d1"])
    return round_record(rp, policy=ctl.policy, outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0)


def test_calibration_replaces_the_priors_of_round_0_and_the_record_says_so():
    ctl = Controller(Scenario.from_dict(SC), calibrate=True)
    assert ctl.calibrate_draft_time("d0", 0.005)
    assert ctl.calibrate_verify({"verify_t0_s": 0.003, "verify_t1_s": 0.0004, "shapes": [], "took_s": 0.1})
    rec = _record(ctl)
    assert rec["verify_model"] == {"t0_s": 0.003, "t1_s": 0.0004, "prefill_positions": 0}
    assert rec["devices"]["d0"]["estimate"]["draft_time_s"] == 0.005
    assert rec["devices"]["d1"]["estimate"]["draft_time_s"] == 0.02  # it sent none: its prior
    ef = rec["estimates_from"]
    assert ef["verify_model"] == "calibrated"
    assert ef["draft_time_calibrated"] == ["d0"] and ef["draft_time_prior"] == ["d1"]
    d0 = rec["devices"]["d0"]
    assert d0["predicted"]["draft_s"] == pytest.approx(0.005 * d0["draft_len"])
    # The rounds take over: the first (the prefill) is skipped, then the median of the measured ones.
    ctl.observe_draft_time("d0", 0.5, 5)
    assert ctl.est["d0"].draft_time_s == 0.005
    ctl.observe_draft_time("d0", 0.03, 5)
    assert ctl.est["d0"].draft_time_s == pytest.approx(0.006)
    assert ctl.estimates_from(["d0"])["draft_time_calibrated"] == []
    assert not ctl.calibrate_draft_time("d0", 0.001)  # a re-registration does not undo what rounds measured
    assert ctl.est["d0"].draft_time_s == pytest.approx(0.006)


def test_without_calibrate_the_priors_stay():
    ctl = Controller(Scenario.from_dict(SC))  # calibrate=False: what tests of the priors rely on
    assert not ctl.calibrate_draft_time("d0", 0.005)
    assert not ctl.calibrate_verify({"verify_t0_s": 0.003, "verify_t1_s": 0.0004})
    ef = _record(ctl)["estimates_from"]
    assert ef["verify_model"] == "prior" and ef["draft_time_prior"] == ["d0", "d1"]
    assert ctl.est["d0"].draft_time_s == 0.02 and ctl.t0 == Scenario.from_dict(SC).verify_t0_s


# -- the verification's calibration ---------------------------------------------------------------------

class FakeVerifier:
    """A verifier whose forward takes t0 + t1 * positions (it sleeps), keeping the sessions' bookkeeping."""

    vocab_size = 50

    def __init__(self, t0: float, t1: float):
        self.t0, self.t1, self.open_sessions, self.calls = t0, t1, set(), []

    def open(self, sid, prompt_ids):
        self.open_sessions.add(sid)

    def close(self, sid):
        self.open_sessions.discard(sid)

    def verify(self, items):
        import time

        positions = sum(len(d) + 1 for _, _, d in items)
        self.calls.append(positions)
        time.sleep(self.t0 + self.t1 * positions)
        return [np.zeros((len(d) + 1, self.vocab_size), np.float32) for _, _, d in items]

    def commit(self, sid, n):
        assert n == 0


def test_shapes_span_one_device_at_l1_to_all_at_lmax():
    assert shapes_for(4, 8) == [(1, 1), (2, 4), (4, 8)]
    assert shapes_for(1, 1) == [(1, 1)]
    assert shapes_for(1, 6) == [(1, 1), (1, 3), (1, 6)]
    assert fit_line([2, 10], [0.012, 0.02]) == pytest.approx((0.01, 0.001, "fit"))
    assert fit_line([4], [0.02])[1:] == (0.005, "origin")


def test_calibrate_verification_fits_the_forward_time_and_closes_its_sessions():
    fake = FakeVerifier(0.01, 0.001)
    got = calibrate_verification(fake, 4, 6, [[1, 2, 3]], repeats=2, pause_s=0.0)
    assert fake.open_sessions == set()
    assert [s["positions"] for s in got["shapes"]] == [2, 8, 28]
    assert got["fit"] == "fit"
    assert got["verify_t0_s"] == pytest.approx(0.01, abs=0.004)
    assert got["verify_t1_s"] == pytest.approx(0.001, rel=0.25)
    assert got["took_s"] >= sum(s["verify_s"] * s["repeats"] for s in got["shapes"])


class DisturbedVerifier(FakeVerifier):
    """Every other forward takes twice as long: the host's other load on one timing of each pair."""

    def verify(self, items):
        import time

        out = super().verify(items)
        if len(self.calls) % 2:
            time.sleep(self.t0 + self.t1 * self.calls[-1])
        return out


def test_a_slow_target_is_timed_twice_a_shape_and_the_undisturbed_forward_counts(monkeypatch):
    from edge_node import calibration

    monkeypatch.setattr(calibration, "SLOW_FORWARD_S", 0.0)  # every forward counts as slow here
    got = calibrate_verification(DisturbedVerifier(0.01, 0.001), 4, 6, [[1, 2, 3]], pause_s=0.0)
    assert [s["repeats"] for s in got["shapes"]] == [calibration.SLOW_REPEATS] * 3
    # The disturbed timing of each pair is 2x: a median or mean of the two would put t0, t1 50% high.
    assert got["verify_t0_s"] == pytest.approx(0.01, abs=0.004)
    assert got["verify_t1_s"] == pytest.approx(0.001, rel=0.25)


# -- a live run ---------------------------------------------------------------------------------------

SCALE = 8.0  # the slowed device's hardware compute_scale


def _profile(pair, hw_path, calibrate: bool = True):
    from testbed.run.profile import load_profile

    return load_profile({
        "name": "calibrated", "rounds": 4, "seed": 5, "deadline_s": 10.0,
        "prompts": ["def parse(text):", "import os"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer), "threads": 1},
        "channel": {"mode": "virtual"}, "wait_for_devices_s": 60, "pin": {"mode": "DL", "draft_len": 6},
        "hardware": {"slow": str(hw_path)}, "estimator": {"calibrate": calibrate},
        "scenario": {"bits_per_prob": 16, "max_draft_len": 6,
                     # priors far off on purpose: 0.2 s/token, 1 s per verification
                     "verify_t0_s": 1.0, "verify_t1_s": 0.0,
                     "devices": [{"name": "fast", "distance_m": 50, "draft_time_s": 0.2, "acceptance": 0.6},
                                 {"name": "slow", "distance_m": 50, "draft_time_s": 0.2, "acceptance": 0.6}]}})


def _round0_draft_error(run_dir) -> tuple[float, dict, dict]:
    """(round 0's predicted draft_s of the slowed device against its measured one, round 0's record, its
    entry). Measured: the median over the run's rounds (the same draft length each round): round 0's own
    drafting is the device's first after its session started, and on a shared 2-core host took 1.5-6 times the
    next rounds' in some runs; rounds 1-2 came within 10% of the prediction."""
    from testbed.runtime.records import load_run

    records = load_run(run_dir)[1]
    d = records[0]["devices"]["slow"]
    measured = float(np.median([r["devices"]["slow"]["measured"]["draft_s"] for r in records]))
    return d["predicted"]["draft_s"] / measured - 1.0, records[0], d


def test_round_0_is_planned_on_the_devices_and_the_targets_own_timings(micro_pair, tmp_path):
    from testbed.run.live import run_live

    hw = tmp_path / "slow.yaml"
    hw.write_text(f"name: slow\ncompute_scale: {SCALE}\nthreads: 1\n")
    errors = []
    for attempt in range(2):  # a shared 2-core host can stretch one run's drafting; a real miss fails both
        run_dir = tmp_path / f"run{attempt}"
        run_live(_profile(micro_pair, hw), run_dir, progress=False)
        err, rec, slow = _round0_draft_error(run_dir)
        errors.append((err, slow["predicted"]["draft_s"], slow["measured"]["draft_s"]))
        meta = json.loads((run_dir / "meta.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        cal = meta["calibration"]
        assert summary["calibration"] == cal
        assert set(cal["draft_time_s"]) == {"fast", "slow"} and all(v > 0 for v in cal["draft_time_s"].values())
        assert cal["verify_t0_s"] >= 0 and cal["verify_t1_s"] >= 0 and len(cal["shapes"]) == 3
        assert 0 < cal["took_s"] < 30
        assert rec["estimates_from"]["verify_model"] == "calibrated"
        assert rec["estimates_from"]["draft_time_calibrated"] == ["fast", "slow"]
        assert rec["devices"]["slow"]["estimate"]["draft_time_s"] == pytest.approx(cal["draft_time_s"]["slow"])
        # the 1-s prior is gone: the micro target verifies in milliseconds
        assert rec["predicted"]["verify_s"] < 0.2
        if abs(err) <= 0.30:
            break
    assert abs(errors[-1][0]) <= 0.30, errors


def test_calibrate_false_plans_round_0_on_the_priors(micro_pair, tmp_path):
    from testbed.run.live import run_live

    hw = tmp_path / "slow.yaml"
    hw.write_text(f"name: slow\ncompute_scale: {SCALE}\nthreads: 1\n")
    run_live(_profile(micro_pair, hw, calibrate=False).model_copy(update={"rounds": 1}), tmp_path / "run",
             progress=False)
    _, rec, slow = _round0_draft_error(tmp_path / "run")
    assert rec["estimates_from"]["verify_model"] == "prior"
    assert rec["estimates_from"]["draft_time_prior"] == ["fast", "slow"]
    assert slow["estimate"]["draft_time_s"] == pytest.approx(0.2 * SCALE)
    assert "calibration" not in json.loads((tmp_path / "run" / "meta.json").read_text())
