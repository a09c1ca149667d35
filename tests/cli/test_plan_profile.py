"""`multispin plan` of a run profile plans what the run would (issue 29, item 3): the profile's `policy`, also
from `--set policy=...`, with an explicit `--policy` winning as in `multispin run`; and each device's prior
drafting time x its hardware profile's `compute_scale`, the live controller's prior t_k."""

from __future__ import annotations

import json

import pytest

from device_node.hardware import load_hardware
from edge_node.controller import Controller
from testbed.cli import main
from testbed.run.profile import load_profile

SCALES = {"dev0": 1.0, "dev1": 1.5, "dev2": 3.0, "dev3": 5.0}  # profiles/emulation.yaml's hardware


def _plan(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_takes_the_profiles_policy_and_set_policy_and_the_flag_wins(capsys):
    assert _plan(capsys, "emulation")["policy"] == "proposed"
    d = _plan(capsys, "emulation", "--set", "policy=all-dl")
    assert d["policy"] == "all-dl" and {x["mode"] for x in d["devices"]} == {"DL"}
    d = _plan(capsys, "emulation", "--set", "policy=all-dl", "--policy", "all-ul")
    assert d["policy"] == "all-ul" and {x["mode"] for x in d["devices"]} == {"UL"}
    # A scenario file has no policy: proposed, and no hardware.
    d = _plan(capsys, "default")
    assert d["policy"] == "proposed" and "compute_scale" not in d


def test_plan_drafting_time_is_the_live_prior_with_compute_scale(capsys):
    d = _plan(capsys, "emulation", "--set", "policy=fixed-length", "--fixed-length", "3")
    assert d["compute_scale"] == SCALES
    profile = load_profile("emulation")
    sc = profile.scenario_obj()
    live = Controller(sc, compute_scale={n: load_hardware(h).compute_scale for n, h in profile.hardware.items()})
    for x in d["devices"]:
        assert x["draft_len"] == 3
        assert x["draft_s"] == pytest.approx(3 * live.est[x["name"]].draft_time_s)
        assert x["draft_s"] == pytest.approx(3 * 0.001 * SCALES[x["name"]])
    # Another hardware profile, set on the command line, is the one planned with.
    d = _plan(capsys, "emulation", "--set", "policy=fixed-length", "--set", "hardware.dev3=edge-class")
    dev3 = next(x for x in d["devices"] if x["name"] == "dev3")
    assert dev3["draft_s"] == pytest.approx(dev3["draft_len"] * 0.001)


def test_plan_table_says_the_drafting_time_is_scaled(capsys):
    assert main(["plan", "emulation"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy proposed:")
    assert "compute_scale, as a live run starts from (dev1 1.5, dev2 3, dev3 5)" in out
    assert main(["plan", "emulation", "--set", "policy=all-ul"]) == 0
    assert capsys.readouterr().out.startswith("policy all-ul:")


def test_channel_rounds_take_the_profiles_policy_and_compute_scale(capsys):
    d = _plan(capsys, "emulation", "--channel-rounds", "3", "--set", "policy=fixed-length", "--set",
              "fixed_length=2")
    assert d["policy"] == "fixed-length" and d["compute_scale"] == SCALES
    for r in d["rounds"]:
        for x in r["devices"]:
            assert x["draft_s"] == pytest.approx(2 * 0.001 * SCALES[x["name"]])
    assert d["stderr_goodput_tps"] is not None
    assert _plan(capsys, "emulation", "--channel-rounds", "2", "--set", "policy=all-dl",
                 "--policy", "all-ul")["policy"] == "all-ul"


def _simulate_row(tmp_path, *argv) -> tuple[dict, dict]:
    import csv

    out = tmp_path / "sim"
    assert main(["simulate", *argv, "--sweep", "bits_per_prob=16", "--drops", "1", "--jobs", "1", "--no-progress",
                 "--out", str(out)]) == 0
    with open(out / "results.csv") as fh:
        (row,) = list(csv.DictReader(fh))
    return row, json.loads((out / "meta.json").read_text())


@pytest.mark.parametrize("policy", ["proposed", "fixed-length"])
def test_simulate_predicts_the_round_plan_predicts_with_compute_scale(capsys, tmp_path, policy):
    # the profile's hardware slows dev1..dev3 (compute_scale 1.5, 3, 5): simulate plans what plan plans
    sets = ["--set", f"policy={policy}", "--set", "scenario.uplink_bandwidth_hz=1e5"]
    d = _plan(capsys, "emulation", *sets, "--policy", policy)
    row, meta = _simulate_row(tmp_path, "emulation", *sets, "--policies", policy)
    assert float(row["round_time_s"]) == pytest.approx(d["round_time_s"], rel=1e-9)
    assert float(row["goodput_tps"]) == pytest.approx(d["goodput_tps"], rel=1e-9)
    assert meta["compute_scale"] == {n: x for n, x in SCALES.items() if x != 1.0}
    unscaled = {x["name"]: x["draft_time_s"] for x in meta["scenario"]["devices"]}
    assert unscaled["dev3"] == pytest.approx(0.001 * 5)  # the scenario simulated is the scaled one
    # a scenario file has no hardware: nothing scaled
    _, meta = _simulate_row(tmp_path / "file", "default", "--policies", policy)
    assert meta["compute_scale"] == {}


def test_plan_warns_when_a_top_k_options_acceptance_loss_is_not_given(capsys):
    sets = ["--set", "scenario.topk_choices=[16,64]"]
    assert main(["plan", "emulation", *sets, "--set", "scenario.topk_acceptance_ratio={16: 0.56}"]) == 0
    assert "warning: top-k k=64: no topk_acceptance_ratio" in capsys.readouterr().err
    assert main(["plan", "emulation", *sets, "--set", "scenario.topk_acceptance_ratio={16: 0.56, 64: 0.73}"]) == 0
    assert "topk_acceptance_ratio" not in capsys.readouterr().err
