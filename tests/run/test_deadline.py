"""A deadline the plan cannot meet (testbed/run/deadline.py): warned, adapted to the prediction x the margin, and
recorded; a deadline it can meet is left alone."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from support import CLI, profile_data

from testbed.run import planning
from testbed.run.deadline import DEADLINE_MARGIN, deadline_check
from testbed.run.profile import load_profile


def _round0(data: dict):
    p = load_profile(data)
    scenario = p.scenario_obj(vocab_size=320)
    ctl = planning.make_controller(p, scenario, planning.hardware_scales(p))
    return ctl.plan_round(0, p.device_names(), 0.0)


class _Pair:
    target_dir = draft_onnx = tokenizer = "unused"


def _data(draft_time_s: float, deadline_s: float) -> dict:
    data = profile_data(_Pair(), deadline_s=deadline_s, channel={"mode": "real"})
    for d in data["scenario"]["devices"]:
        d["draft_time_s"] = draft_time_s
    return data


def test_a_plan_longer_than_the_deadline_adapts_it_to_the_prediction_times_the_margin():
    rp = _round0(_data(0.3, 0.25))  # 0.3 s a token: any draft is past 0.25 s
    entry = deadline_check(0.25, rp, air_has_basis=True)
    need = max(d.uplink_s for d in rp.per_device.values())
    assert need > 0.25
    assert entry["profile_s"] == 0.25 and entry["predicted_s"] == pytest.approx(need)
    assert entry["deadline_s"] == pytest.approx(DEADLINE_MARGIN * need) and entry["basis"] == "uplink"
    # Without a basis for the air time (a passthrough link not measured), the drafting alone counts.
    assert deadline_check(0.25, rp, air_has_basis=False)["predicted_s"] == pytest.approx(
        max(d.draft_s for d in rp.per_device.values()))


def test_a_deadline_the_plan_meets_is_left_alone():
    rp = _round0(_data(0.001, 0.25))
    assert max(d.uplink_s for d in rp.per_device.values()) < 0.25
    assert deadline_check(0.25, rp, air_has_basis=True) is None


@pytest.mark.timeout(240)
def test_a_live_run_whose_devices_draft_past_the_deadline_warns_adapts_and_serves(micro_pair, tmp_path):
    """Devices 500x slower than this host (their `compute_scale`): each drafts for longer than the 0.25 s
    deadline, so that unadapted no such draft would be served. The plan's prior (4 ms a token x 500: 2 s, above
    the ~0.5 s these take, so that a busy shared host stays within the adapted deadline) predicts it: the run
    warns once, naming `deadline_s` and the prediction, records what it did in meta.json, and its rounds serve
    the drafts."""
    hw = tmp_path / "slow.yaml"
    hw.write_text(yaml.safe_dump({"name": "slow", "compute_scale": 500.0, "threads": 1}))
    data = profile_data(micro_pair, rounds=2, deadline_s=0.25, max_misses=10, channel={"mode": "passthrough"},
                        hardware={"d0": str(hw), "d1": str(hw)}, estimator={"calibrate": False})
    for d in data["scenario"]["devices"]:
        d["draft_time_s"] = 0.004
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(data))
    done = subprocess.run([*CLI, "run", str(prof), "--runs-dir", str(tmp_path / "runs"), "--quiet", "--no-plots"],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    warned = [line for line in done.stderr.splitlines() if "deadline_s: 0.25 s is shorter than" in line]
    assert len(warned) == 1, done.stderr[-3000:]
    entry = json.loads((run_dir / "meta.json").read_text())["deadline"]
    assert entry["profile_s"] == 0.25 and entry["basis"] == "drafting"
    assert entry["predicted_s"] > 0.25 and entry["deadline_s"] == pytest.approx(DEADLINE_MARGIN * entry["predicted_s"])
    records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    served = [n for r in records for n, d in r["devices"].items() if not d["missed"]]
    assert served, [r["missed"] for r in records]
    assert any(d["measured"]["draft_s"] > 0.25 for r in records for d in r["devices"].values() if not d["missed"])
