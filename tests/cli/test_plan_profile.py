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
