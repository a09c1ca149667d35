"""Run profiles, round records and the report: loading, errors naming fields, durability, summaries."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support import synth_records, wait_until

from edge_node.controller import Controller
from testbed.analysis import report
from testbed.run.profile import ProfileError, load_profile
from testbed.run.scenario_file import load_scenario
from testbed.runtime.errors import TestbedError
from testbed.runtime.records import RunRecorder, load_progress, load_run

SCEN = {"bits_per_prob": 16, "max_draft_len": 6,
        "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.01, "acceptance": 0.7},
                    {"name": "b", "distance_m": 300, "draft_time_s": 0.02, "acceptance": 0.6}]}


def test_shipped_profiles_load():
    p = load_profile()  # profiles/emulation.yaml
    assert p.deployment == "emulation" and len(p.device_names()) == 4
    assert p.scenario_obj(4096).vocab_size == p.on_air_vocab_size == 151936
    assert p.prompt_list()
    lan = load_profile("lan")
    assert lan.deployment == "lan" and lan.endpoints.edge_bind.startswith("tcp://")


@pytest.mark.parametrize("data, fragment", [
    ({"scenario": SCEN, "policy": "best"}, "policy: 'best' is not allowed"),
    ({"scenario": SCEN, "deadline_s": -1}, "deadline_s: -1"),
    ({"scenario": SCEN, "channel": {"mode": "fast"}}, "channel.mode: 'fast'"),
    ({"scenario": SCEN, "hardware": {"zz": "phone"}}, "hardware: device(s) ['zz']"),
    ({"scenario": SCEN, "model": {"pair": "local"}}, "model.target"),
    ({"scenario": SCEN, "typo_field": 1}, "typo_field"),
    ({"scenario": {**SCEN, "bits_per_prob": 0}}, "bits_per_prob"),
    ({"scenario": SCEN, "prompts": []}, "prompts"),
])
def test_profile_errors_name_the_field(data, fragment):
    with pytest.raises(ProfileError) as exc:
        load_profile(data)
    assert fragment in str(exc.value)


def test_overrides_use_dotted_keys():
    p = load_profile({"scenario": SCEN}, {"channel.mode": "virtual", "rounds": 3})
    assert p.channel.mode == "virtual" and p.rounds == 3


def test_records_are_durable_and_a_torn_line_is_skipped(tmp_path):
    rec = RunRecorder(tmp_path)
    rec.write_meta({"name": "x"}, channel_mode="real")
    rec.append_round({"round": 0, "x": float("nan"), "arr": np.arange(3)})
    rec.append_round({"round": 1})
    # Without closing: what is on disk already holds both rounds (flushed and fsynced).
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(l)["round"] for l in lines] == [0, 1]
    assert json.loads(lines[0])["x"] is None and json.loads(lines[0])["arr"] == [0, 1, 2]
    with open(tmp_path / "rounds.jsonl", "a") as fh:
        fh.write('{"round": 2, "trunc')
    meta, rounds = load_run(tmp_path)
    assert meta["channel_mode"] == "real" and meta["profile"] == {"name": "x"} and "packages" in meta
    assert [r["round"] for r in rounds] == [0, 1]
    rec.close()


def _entry(ids, rounds):
    return {"session": "a#0", "prompt": "p", "output_tokens": len(ids), "output_ids": list(ids), "rounds": rounds}


def test_the_progress_log_holds_what_changed_and_folds_back_to_every_state(tmp_path):
    rec = RunRecorder(tmp_path)
    states = [{"a": _entry([1, 2], 1)},
              {"a": _entry([1, 2, 3, 4], 2), "b": _entry([9], 1)},
              {"a": _entry([1, 2, 3, 4], 2), "b": _entry([9, 8], 2)},  # a unchanged: left out of the line
              {"a": _entry([1, 2, 5], 3), "b": _entry([9, 8], 2)},     # tokens taken back, then one more
              {"a": _entry([1], 3), "b": _entry([], 2)}]
    for r, devices in enumerate(states):
        rec.write_progress({"round": r, "devices": devices})
        assert load_progress(tmp_path) == {"round": r, "devices": devices}
    lines = [json.loads(x) for x in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert lines[1]["devices"]["a"] == {"output_tokens": 4, "output_ids_from": 2, "output_ids": [3, 4], "rounds": 2}
    assert lines[2]["devices"] == {"b": {"output_tokens": 2, "output_ids_from": 1, "output_ids": [8], "rounds": 2}}
    assert lines[3]["devices"]["a"]["output_ids_from"] == 2 and lines[3]["devices"]["a"]["output_ids"] == [5]
    rec.close()
    # A resumed run's recorder starts with whole entries; a device that did not come back keeps its last one.
    with open(tmp_path / "progress.jsonl", "a") as fh:
        fh.write('{"round": 9, "devices": {"a": {"output_ids_fr')  # killed mid-write
    rec = RunRecorder(tmp_path)
    rec.write_progress({"round": 5, "devices": {"a": _entry([1, 7], 4)}})
    rec.close()
    assert load_progress(tmp_path) == {"round": 5, "devices": {"a": _entry([1, 7], 4), "b": _entry([], 2)}}
    last = json.loads((tmp_path / "progress.jsonl").read_text().splitlines()[-1])
    assert last["devices"]["a"]["output_ids"] == [1, 7] and "output_ids_from" not in last["devices"]["a"]


def test_a_progress_line_that_does_not_fit_ends_the_fold_and_an_old_snapshot_still_loads(tmp_path):
    (tmp_path / "progress.jsonl").write_text(
        '{"round": 0, "devices": {"a": {"output_ids": [1, 2]}}}\n'
        '{"round": 1, "devices": {"a": {"output_ids_from": 5, "output_ids": [3]}}}\n')
    assert load_progress(tmp_path) == {"round": 0, "devices": {"a": {"output_ids": [1, 2]}}}
    old = tmp_path / "old"
    old.mkdir()
    assert load_progress(old) is None
    (old / "progress.json").write_text('{"round": 3, "devices": {"a": {"output_ids": [4]}}}')
    assert load_progress(old) == {"round": 3, "devices": {"a": {"output_ids": [4]}}}


def test_the_logs_are_fsynced_together_at_most_once_per_interval_and_on_close(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    rec = RunRecorder(tmp_path, sync_interval_s=3600)
    for r in range(5):
        rec.append_round({"round": r})
        rec.write_progress({"round": r, "devices": {"a": _entry(range(r), r)}})
    assert len(synced) == 1  # the first line; the others are written (a killed process keeps them) ...
    assert len((tmp_path / "rounds.jsonl").read_text().splitlines()) == 5
    assert load_progress(tmp_path)["devices"]["a"]["output_ids"] == [0, 1, 2, 3]
    rec.write_summary({"rounds": 5})  # ... and fsynced (both logs) before a file that speaks of them (+ itself)
    assert len(synced) == 4
    rec.append_round({"round": 5})
    rec.close()
    assert len(synced) == 5  # closing syncs the rounds log (the progress log is clean)
    every = RunRecorder(tmp_path / "every", sync_interval_s=0)
    for r in range(3):
        every.append_round({"round": r})
    every.close()
    assert len(synced) == 8


def test_by_default_every_line_is_fsynced_as_it_is_written_off_the_writers_path(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync
    rounds_fd = []

    def fsync(fd):
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    rec = RunRecorder(tmp_path)
    rounds_fd.append(rec._rounds_log.fh.fileno())
    for r in range(5):
        before = synced.count(rounds_fd[0])
        rec.append_round({"round": r})
        wait_until(lambda before=before: synced.count(rounds_fd[0]) > before, 5, f"round {r} fsynced", step_s=0.001)
    assert rec._syncer.name == "multispin-records-fsync" and rec._syncer.is_alive()

    # A failed fsync in that thread is raised by the next write, as a clear error; the lines stay whole.
    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    rec.append_round({"round": 5})
    wait_until(lambda: rec._syncer.error is not None, 5, "the fsync thread's error", step_s=0.001)
    with pytest.raises(TestbedError, match="No space left"):
        rec.append_round({"round": 6})
    monkeypatch.setattr(os, "fsync", real_fsync)
    rec.close()
    assert not rec._syncer.is_alive()
    assert [json.loads(x)["round"] for x in (tmp_path / "rounds.jsonl").read_text().splitlines()] == list(range(7))


def test_controller_estimates():
    scen = load_scenario({**SCEN, "vocab_size": 1000})
    c = Controller(scen, alpha_prior_trials=10, compute_scale={"b": 2.0}, fit_verify_after=3)
    assert c.est["a"].alpha == pytest.approx(0.7) and c.est["b"].draft_time_s == pytest.approx(0.04)
    c.observe_acceptance("a", 4, 4)      # 4 successes, no failure
    c.observe_acceptance("a", 0, 4)      # 1 failure
    assert c.est["a"].alpha == pytest.approx((7 + 4) / (10 + 5))
    c.observe_draft_time("a", 1.0, 4)    # first draft (prefill, warm-up): ignored
    c.observe_draft_time("a", 0.08, 4)
    assert c.est["a"].draft_time_s == pytest.approx(0.02)
    for pos, t in ((4, 0.014), (8, 0.018), (12, 0.022), (12, 0.022), (12, 0.5)):  # one stall: the median ignores it
        c.observe_verify(pos, t)
    assert c.t0 == pytest.approx(0.01) and c.t1 == pytest.approx(0.001)
    rp = c.plan_round(0, ["a", "b"])
    assert {d["name"] for d in rp.plan["devices"]} == {"a", "b"}
    assert rp.scenario.verify_t0_s == pytest.approx(0.01)
    pinned = Controller(scen, pin_mode="DL", pin_draft_len=3).plan_round(0, ["a"])
    assert pinned.per_device["a"].mode == "DL" and pinned.per_device["a"].draft_len == 3


def test_verify_fit_with_one_batch_size_follows_a_target_faster_than_the_prior():
    """Every round of the same batch (one L for all devices): the slope is the prior's, unless the target is
    faster than that slope allows (the intercept would go negative: a 256-device micro pair measured 35 ms
    where the prior said 256 ms); then a line through the origin."""
    scen = load_scenario({**SCEN, "vocab_size": 1000, "verify_t0_s": 0.02, "verify_t1_s": 0.0005})
    c = Controller(scen, fit_verify_after=3)
    for t in (0.030, 0.032, 0.040):
        c.observe_verify(512, t)
    assert c.t0 == 0.0 and c.t1 == pytest.approx(0.032 / 512)
    slow = Controller(scen, fit_verify_after=3)
    for t in (0.30, 0.31, 0.32):
        slow.observe_verify(512, t)
    assert slow.t1 == 0.0005 and slow.t0 == pytest.approx(0.31 - 0.0005 * 512)


def test_round_overhead_leaves_the_verification_models_error_out():
    """T_0 is what the phases do not explain; a verification slower or faster than predicted is the
    verification model's to fit, so three rounds predicted with a prior 0.2 s too slow give T_0 = 0.05 s."""
    c = Controller(load_scenario({**SCEN, "vocab_size": 1000}))
    for _ in range(3):
        c.observe_round(0.15, 0.30, 0.0, verify_error_s=-0.20)  # measured 0.15 s; 0.2 s of it mispredicted
    assert c.round_overhead_s == pytest.approx(0.05)
    c.observe_round(0.40, 0.30, 0.05)  # without the verification's error: 0.4 - 0.25
    assert c.round_overhead_s == pytest.approx(0.05)  # median of 0.05, 0.05, 0.05, 0.15


def _fake_records(n=6):
    return synth_records(n, slow_verify=2.0)


def test_summary_errors_per_phase_and_plots(tmp_path):
    recs = _fake_records()
    s = report.summarize(recs)
    assert s["rounds"] == 6 and s["tokens"] == 24
    e = s["phase_errors"]
    assert e["draft_s"]["median_error"] == pytest.approx(0.1)
    assert e["verify_s"]["median_error"] == pytest.approx(1.0)
    assert e["round_s"]["median_abs_error"] == pytest.approx(0.5)
    text = report.format_summary(s)
    assert "goodput: measured" in text and "verify" in text
    paths = report.write_plots(recs, tmp_path)
    assert [p.name for p in paths] == ["goodput.png", "phases.png", "timeline.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_report_command(tmp_path, capsys):
    from testbed.cli import main

    rec = RunRecorder(tmp_path)
    rec.write_meta({"name": "x"})
    for r in _fake_records(4):
        rec.append_round(r)
    rec.close()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "goodput: measured" in out and (tmp_path / "plots" / "timeline.png").exists()
    assert main(["report", str(tmp_path / "nope")]) == 2


def test_json_text_is_strict_json_with_null_for_non_finite_numbers():
    from testbed.runtime.records import json_text

    text = json_text({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": np.float64("nan"),
                      "d": np.arange(2)}, indent=1)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}")) == {
        "a": None, "b": [None, None, 1.5], "c": None, "d": [0, 1]}
