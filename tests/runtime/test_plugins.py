"""Plug-ins: users' policies and channel sources (testbed.runtime.plugins, testbed.core.policy,
testbed.channel.source) and the example package examples/ge_threshold, in `plan`, `simulate` and a live
`compare` on the micro pair; the built-in policies through the interface; every error case.

The example is imported from examples/ge_threshold (put on the path here, installed in CI); entry points are
tested with a distribution made in a temporary folder, so discovery is exercised without pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import ROOT

from edge_node.controller import Controller, outcome_of, round_record
from testbed.channel.source import ChannelSource
from testbed.channel.state import ChannelState
from testbed.cli import main
from testbed.core.optimizer import POLICIES, BuiltinPolicy, plan
from testbed.core.policy import Decision, DeviceResult, Policy, PolicyError, RoundOutcome
from testbed.core.radio import path_loss_db
from testbed.core.scenario import Scenario
from testbed.run.profile import ProfileError, load_profile
from testbed.runtime.plugins import (
    CHANNEL_GROUP,
    POLICY_GROUP,
    NamedPolicy,
    PluginError,
    PluginFailure,
    channel_state_from_config,
    installed,
    load_channel_source,
    load_policy,
)

EXAMPLE = ROOT / "examples" / "ge_threshold"
THRESHOLD = "ge_threshold.policies:ChannelThreshold"
GE = "ge_threshold.channels:GilbertElliott"

SC = {"max_draft_len": 8, "vocab_size": 2048, "downlink_bandwidth_hz": 2e6, "downlink_power_w": 2.0,
      "devices": [{"name": f"d{i}", "distance_m": 60 + 90 * i, "draft_time_s": 0.01 + 0.01 * i,
                   "acceptance": 0.55 + 0.08 * i} for i in range(4)]}
# Decisions of the built-in policies on SC (fixed_length 3, seed 5), recorded with the optimizer as it was
# before policies became objects (git 258f7ec): modes as U/D per device, and draft lengths.
BEFORE = {
    "proposed": ("UDUD", [3, 2, 1, 1]),
    "proposed-basic": ("UDUD", [3, 2, 1, 1]),
    "all-ul": ("UUUU", [3, 2, 1, 1]),
    "all-dl": ("DDDD", [4, 2, 1, 1]),
    "all-dl-equal-power": ("DDDD", [4, 2, 1, 1]),
    "random-modes": ("DDDU", [4, 2, 1, 1]),
    "common-length": ("UUUD", [1, 1, 1, 1]),
    "fixed-length": ("UUUD", [3, 3, 3, 3]),
    "exhaustive": ("UDUD", [3, 2, 1, 1]),
}


@pytest.fixture(autouse=True)
def example_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def _module(tmp_path: Path, monkeypatch, name: str, code: str) -> None:
    """A module `name` in a fresh folder on sys.path (a user's plug-in that is not installed)."""
    folder = tmp_path / f"mods-{name}"
    folder.mkdir()
    (folder / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop(name, None)


# --- policies --------------------------------------------------------------------------------------------

def test_builtin_policies_decide_as_before_through_the_interface():
    sc = Scenario.from_dict(SC)
    # The policies of before keep their order and decisions; newer ones (the Multi-SPIN baselines) have tests of
    # their own in tests/core/test_shared_uplink.py.
    assert [p for p in POLICIES if p in BEFORE] == list(BEFORE)
    for name, (modes, lens) in BEFORE.items():
        by_name = plan(sc, name, fixed_length=3, seed=5)
        obj = load_policy(name)
        assert isinstance(obj, BuiltinPolicy) and isinstance(obj, Policy)
        by_object = plan(sc, obj, fixed_length=3, seed=5)
        assert "".join(m[0] for m in by_name.modes) == modes and by_name.draft_lens.tolist() == lens, name
        assert by_object.to_dict() == by_name.to_dict() and by_name.policy == name


def test_example_policy_by_path_plans_from_gains_and_the_previous_round():
    sc = Scenario.from_dict(SC)
    pol = load_policy(THRESHOLD)
    assert isinstance(pol, NamedPolicy) and isinstance(pol, Policy) and pol.name == THRESHOLD
    p = plan(sc, pol)
    gains = sc.gains_db()
    assert p.policy == THRESHOLD and p.info == {"threshold_db": -100.0}
    assert p.modes == ["UL" if g >= -100.0 else "DL" for g in gains] == ["UL", "UL", "DL", "DL"]
    assert p.draft_lens.tolist() == [4, 4, 4, 4]  # no round yet: the default length
    prev = RoundOutcome(round=0, devices={"d0": DeviceResult("UL", 4, 2, 3), "d1": DeviceResult("UL", 4, None, None),
                                          "d2": DeviceResult("DL", 4, 4, 5)})
    assert plan(sc, pol, round_index=2, previous=prev).draft_lens.tolist() == [3, 4, 5, 4]


@pytest.mark.parametrize("spec, message", [
    ("nosuch_pkg_xyz.mod:P", "no module named 'nosuch_pkg_xyz'"),
    ("ge_threshold.policies:Nope", "has no attribute 'Nope'"),
    ("ge_threshold.policies:", "a Python path is module:attribute"),
    ("propsed", "unknown policy 'propsed'; did you mean proposed?"),
    ("broken_mod:P", "importing broken_mod failed: RuntimeError: boom at import"),
    ("pols:NoDecide", "does not satisfy the Policy interface"),
    ("pols:WrongArity", "does not take (scenario, context)"),
    ("pols:NeedsArgs", "constructed without arguments"),
    ("pols:NOT_A_POLICY", "neither a policy"),
])
def test_a_policy_that_cannot_be_used_is_a_clear_error(tmp_path, monkeypatch, spec, message):
    _module(tmp_path, monkeypatch, "broken_mod", "raise RuntimeError('boom at import')\n")
    _module(tmp_path, monkeypatch, "pols", """
        class NoDecide:
            pass
        class WrongArity:
            def decide(self, scenario):
                pass
        class NeedsArgs:
            def __init__(self, threshold):
                pass
            def decide(self, scenario, context):
                pass
        NOT_A_POLICY = 42
    """)
    with pytest.raises(PluginError) as err:
        load_policy(spec)
    assert message in str(err.value)


def _decision(**kw):
    base = dict(modes=["UL", "DL", "DL", "DL"], draft_lens=[2, 2, 2, 2])
    return Decision(**{**base, **kw})


@pytest.mark.parametrize("decision, message", [
    (_decision(modes=["UL", "DL"]), "modes has 2 entries for 4 devices"),
    (_decision(modes=["UL", "XL", "DL", "DL"]), "modes[1] (d1) = 'XL' is not allowed"),
    (_decision(draft_lens=[0, 2, 2, 2]), "draft_lens[0] (d0) = 0 is not allowed: must be an integer in 1..8"),
    (_decision(draft_lens=[2, 9, 2, 2]), "draft_lens[1] (d1) = 9"),
    (_decision(draft_lens=[2, 2.5, 2, 2]), "draft_lens[1] (d1) = 2.5"),
    (_decision(ul_powers_w=[0.5, 0.1, 0.1, 0.1]), "ul_powers_w[0] (d0) = 0.5 W is not allowed: must be in [0, 0.2]"),
    (_decision(ul_powers_w=[0.1, float("nan"), 0.1, 0.1]), "ul_powers_w[1] (d1) = nan"),
    (_decision(dl_powers_w=[0, 1.0, 1.0, 1.0]), "sum to 3 W, more than downlink_power_w = 2.0 W"),
    ({"modes": ["UL"] * 4}, "decide() returned dict, not a Decision"),
])
def test_a_bad_decision_is_a_policy_error_naming_the_field(decision, message):
    class Fixed:
        name = "fixed-answer"

        def decide(self, scenario, context):
            return decision

    with pytest.raises(PolicyError) as err:
        plan(Scenario.from_dict(SC), Fixed())
    assert str(err.value).startswith("policy fixed-answer: ") and message in str(err.value)


def test_a_policy_may_set_powers_and_the_model_uses_them():
    class Powered:
        def decide(self, scenario, context):
            return Decision(modes=["UL", "DL", "DL", "UL"], draft_lens=[3, 2, 2, 1], ul_powers_w=[0.1, 0.2, 0.2, 0.05],
                            dl_powers_w=[0.0, 1.5, 0.5, 0.0])

    p = plan(Scenario.from_dict(SC), Powered())
    assert p.evaluation.ul_power_w[[0, 3]].tolist() == [0.1, 0.05]
    assert p.evaluation.dl_power_w[[1, 2]].tolist() == [1.5, 0.5]


class _Overlong:
    """Asks for more than L_max: a decision the edge must refuse, round after round."""

    name = "overlong"

    def decide(self, scenario, context):
        n = scenario.num_devices
        return Decision(modes=["UL"] * n, draft_lens=[scenario.max_draft_len + 1] * n)


class _Recorder:
    name = "recorder"

    def __init__(self):
        self.contexts = []

    def decide(self, scenario, context):
        self.contexts.append(context)
        if context.round == 3:
            raise RuntimeError("a bug in round 3")
        return Decision(modes=["DL"] * scenario.num_devices, draft_lens=[2] * scenario.num_devices)


def test_a_bad_decision_stops_the_controller_naming_the_policy_and_the_round():
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, policy=_Overlong())  # on_plugin_error: stop, the default
    with pytest.raises(PluginFailure, match=r"policy 'overlong' failed in round 5: draft_lens\[0\] \(d0\) = 9 is not "
                                            r"allowed") as info:
        ctl.plan_round(5, [d.name for d in sc.devices])
    assert info.value.exit_status == 3 and info.value.as_dict()["round"] == 5
    assert info.value.as_dict() == {"kind": "policy", "name": "overlong", "round": 5,
                                    "error": info.value.error}


def test_the_controller_falls_back_on_a_bad_decision_when_told_and_records_why():
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, policy=_Overlong(), on_plugin_error="fallback")
    rp = ctl.plan_round(0, [d.name for d in sc.devices])
    assert rp.plan["policy"] == "all-dl" and {d["mode"] for d in rp.plan["devices"]} == {"DL"}
    fb = rp.plan["fallback"]
    assert fb["policy"] == "all-dl" and fb["instead_of"] == "overlong" and fb["error"] == "PolicyError"
    assert fb["kind"] == "plugin_error"
    assert "draft_lens[0] (d0) = 9 is not allowed" in fb["reason"]
    rec = round_record(rp, policy=ctl.policy, outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0)
    assert rec["fallback"] == fb and rec["policy"] == "overlong"


def test_the_controller_gives_the_policy_its_round_seed_and_the_last_closed_round():
    sc = Scenario.from_dict(SC)
    pol = _Recorder()
    ctl = Controller(sc, policy=pol, seed=10, fixed_length=6, on_plugin_error="fallback")
    names = [d.name for d in sc.devices]
    ctl.plan_round(0, names)
    record = {"round": 0, "measured": {"round_s": 0.2, "goodput_tps": 25.0}, "predicted": {"goodput_tps": 30.0},
              "devices": {"d0": {"mode": "DL", "draft_len": 2, "missed": False, "n_accepted": 1,
                                 "measured": {"tokens": 2}},
                          "d1": {"mode": "DL", "draft_len": 2, "missed": True, "measured": None}}}
    ctl.observe_outcome(record)
    ctl.plan_round(2, names)
    first, second = pol.contexts
    assert (first.round, first.seed, first.fixed_length, first.previous) == (0, 10, 6, None)
    assert (second.round, second.seed) == (2, 12) and second.previous == outcome_of(record)
    assert second.previous.devices["d0"] == DeviceResult("DL", 2, 1, 2)
    assert second.previous.devices["d1"] == DeviceResult("DL", 2, None, None)
    assert second.previous.measured_goodput_tps == 25.0
    # With on_plugin_error: fallback an exception inside the plug-in costs that round only: the fallback plans
    # it, the reason names it.
    rp = ctl.plan_round(3, names)
    assert rp.plan["fallback"]["reason"] == "policy recorder: decide() raised RuntimeError: a bug in round 3"
    assert "fallback" not in ctl.plan_round(4, names).plan


# --- channel sources -------------------------------------------------------------------------------------

DEVICES = [{"name": "near", "distance_m": 80.0}, {"name": "far", "distance_m": 300.0}]


def _ge_cfg(**opts):
    return {"source": GE, "seed": 3, "gilbert_elliott": {"p_good_to_bad": 0.2, "p_bad_to_good": 0.4, **opts}}


def test_gilbert_elliott_is_a_channel_source_with_the_stationary_law():
    st = channel_state_from_config(_ge_cfg(), DEVICES)
    assert isinstance(st._impl, ChannelSource) and st.source == GE
    path = {d["name"]: -path_loss_db(d["distance_m"], "3gpp_macro") for d in DEVICES}
    rounds = 4000
    g = np.array([[st.gains_db(r, 0.1 * r)[n] for n in path] for r in range(rounds)])
    bad = np.isclose(g, np.array(list(path.values())) - 20.0)
    assert np.all(bad | np.isclose(g, np.array(list(path.values()))))
    # P(bad) = p_gb / (p_gb + p_bg) = 1/3. The chain's lag-1 correlation 1 - 0.2 - 0.4 = 0.4 widens the sd of
    # the fraction to sqrt(1/3 * 2/3 / 4000 * 1.4 / 0.6) = 0.0114: 5 sd, a false alarm of 6e-7 per device.
    assert np.all(np.abs(bad.mean(axis=0) - 1 / 3) < 5 * 0.0114)
    # The mean stay in the bad state is 1 / p_bg = 2.5 rounds.
    runs = [len(r) for col in bad.T for r in "".join("b" if x else "g" for x in col).split("g") if r]
    assert abs(np.mean(runs) - 2.5) < 0.25
    # Seeded per device and round: the same values whatever order the rounds are asked in.
    again = channel_state_from_config(_ge_cfg(), list(reversed(DEVICES)))
    back = [again.gains_db(r, 0.0) for r in reversed(range(50))][::-1]
    assert all(back[r] == pytest.approx(dict(zip(path, g[r]))) for r in range(50))
    assert st.rate_override_bps(0, 0.0) == {"near": {"ul": None, "dl": None}, "far": {"ul": None, "dl": None}}


@pytest.mark.parametrize("cls, message", [
    ("Missing", "no state for devices ['far']"),
    ("Numbers", "the state of 'near' is float, not a LinkState"),
    ("NotFinite", "near.gain_db = nan; allowed: a finite number or None"),
    ("Stranger", "devices ['x'] are not in the scenario"),
    ("Empty", "'near' has neither a gain, an SNR nor a UL rate, and no distance_m"),
])
def test_a_source_that_answers_badly_is_a_clear_error(tmp_path, monkeypatch, cls, message):
    _module(tmp_path, monkeypatch, "srcs", """
        from testbed.channel.source import LinkState
        class Base:
            def __init__(self, cfg, devices):
                self.names = [d["name"] for d in devices]
        class Missing(Base):
            def link_states(self, r, t):
                return {"near": LinkState(gain_db=-90.0)}
        class Numbers(Base):
            def link_states(self, r, t):
                return {n: -90.0 for n in self.names}
        class NotFinite(Base):
            def link_states(self, r, t):
                return {n: LinkState(gain_db=float("nan")) for n in self.names}
        class Stranger(Base):
            def link_states(self, r, t):
                return {"x": LinkState(gain_db=-90.0), **{n: LinkState(gain_db=-90.0) for n in self.names}}
        class Empty(Base):
            def link_states(self, r, t):
                return {n: LinkState() for n in self.names}
    """)
    st = channel_state_from_config({"source": f"srcs:{cls}"}, [{"name": "near"}, {"name": "far"}])
    with pytest.raises(ValueError) as err:
        st.gains_db(0, 0.0)
    assert f"channel source 'srcs:{cls}', round 0" in str(err.value) and message in str(err.value)


def test_a_source_that_cannot_be_built_or_loaded_is_a_clear_error(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "srcs2", """
        class NoStates:
            def __init__(self, cfg, devices):
                pass
        class NoArgs:
            def __init__(self):
                pass
            def link_states(self, r, t):
                return {}
    """)
    with pytest.raises(PluginError, match="no method link_states"):
        load_channel_source("srcs2:NoStates")
    with pytest.raises(PluginError, match=r"cannot be built with \(cfg, devices\)"):
        load_channel_source("srcs2:NoArgs")
    with pytest.raises(PluginError, match="unknown channel source 'gilbert'"):
        load_channel_source("gilbert")
    # The source's own check of its options comes through as it is.
    with pytest.raises(ValueError, match=r"gilbert_elliott.p_good_to_bad: 0 is not allowed: must be in \(0, 1\]"):
        channel_state_from_config(_ge_cfg(p_good_to_bad=0), DEVICES)
    with pytest.raises(ValueError, match="needs a distance_m"):
        channel_state_from_config(_ge_cfg(), [{"name": "x"}])
    # Without a resolver (a caller that loads no plug-ins), a plug-in's name is an unknown source.
    with pytest.raises(ValueError, match="allowed: model, trace, live"):
        ChannelState.from_config({"source": GE}, DEVICES)
    assert ChannelState.from_config({"source": "model", "fading": "none"}, DEVICES).gains_db(0, 0.0)["near"] == \
        pytest.approx(-path_loss_db(80.0, "3gpp_macro"))


# --- discovery by entry point ------------------------------------------------------------------------------

def _distribution(tmp_path: Path, monkeypatch, entries: dict[str, dict[str, str]]) -> None:
    """An installed distribution as importlib.metadata sees one: a dist-info folder with entry_points.txt."""
    site = tmp_path / "site"
    info = site / "fake_plugins-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in entries.items()))
    monkeypatch.syspath_prepend(str(site))


def test_entry_points_name_plug_ins_and_plugins_lists_them(tmp_path, monkeypatch, capsys):
    _distribution(tmp_path, monkeypatch, {
        POLICY_GROUP: {"fake-threshold": THRESHOLD, "fake-broken": "nosuch_pkg_xyz:P", "all-dl": THRESHOLD},
        CHANNEL_GROUP: {"fake-ge": GE},
    })
    assert load_policy("fake-threshold").name == "fake-threshold"
    assert plan(Scenario.from_dict(SC), load_policy("fake-threshold")).policy == "fake-threshold"
    assert isinstance(load_policy("all-dl"), BuiltinPolicy)  # a built-in name is never a plug-in's
    with pytest.raises(PluginError, match="entry point nosuch_pkg_xyz:P of multispin.policies"):
        load_policy("fake-broken")
    st = channel_state_from_config({**_ge_cfg(), "source": "fake-ge"}, DEVICES)
    assert st.gains_db(5, 0.0) == channel_state_from_config(_ge_cfg(), DEVICES).gains_db(5, 0.0)
    rows = {r["name"]: r for r in installed()["policies"] if r["origin"] != "built in"}
    assert rows["fake-threshold"]["ok"] and rows["fake-threshold"]["distribution"] == "fake-plugins 1.0"
    assert not rows["fake-broken"]["ok"] and "No module named 'nosuch_pkg_xyz'" in rows["fake-broken"]["error"]
    assert "shadowed by the built-in" in rows["all-dl"]["error"]
    assert main(["plugins"]) == 1  # a plug-in that does not load
    out = capsys.readouterr().out
    assert "fake-threshold" in out and "NOT USABLE" in out and "fake-ge" in out
    assert main(["plugins", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in found["channels"]} >= {"model", "trace", "live", "fake-ge"}


# --- the commands: plan, simulate, profiles ---------------------------------------------------------------

def _run_profile(tmp_path: Path, **over) -> Path:
    data = {"name": "ge", "policy": THRESHOLD, "channel": {"mode": "virtual", "state": _ge_cfg()},
            "scenario": {"max_draft_len": 6, "vocab_size": 4096, "uplink_bandwidth_hz": 2e6,
                         "downlink_bandwidth_hz": 3e6, "downlink_power_w": 1.0,
                         "devices": [{"name": "near", "distance_m": 80, "draft_time_s": 0.002, "acceptance": 0.6},
                                     {"name": "far", "distance_m": 300, "draft_time_s": 0.002, "acceptance": 0.7}]}}
    data.update(over)
    path = tmp_path / "ge.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_with_a_plug_in_policy_and_channel_rounds(tmp_path, capsys):
    prof = _run_profile(tmp_path)
    assert main(["plan", str(prof), "--policy", THRESHOLD, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["policy"] == THRESHOLD and [x["mode"] for x in d["devices"]] == ["UL", "DL"]
    assert main(["plan", str(prof), "--policy", THRESHOLD, "--channel-rounds", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ge = channel_state_from_config(_ge_cfg(), DEVICES)
    assert out["channel_source"] == GE and len(out["rounds"]) == 30 and out["fallback_rounds"] == 0
    for x in out["rounds"]:
        assert x["gains_db"] == pytest.approx(ge.gains_db(x["round"], 0.0))
        assert [d["mode"] for d in x["devices"]] == ["UL" if x["gains_db"][d["name"]] >= -100 else "DL"
                                                     for d in x["devices"]]
    assert len({x["gains_db"]["near"] for x in out["rounds"]}) == 2  # both states of the chain came up
    times = [x["t_s"] for x in out["rounds"]]
    assert times[0] == 0 and all(b > a for a, b in zip(times, times[1:]))
    assert main(["plan", str(prof), "--policy", "proposed", "--channel-rounds", "3"]) == 0
    assert "mean predicted goodput" in capsys.readouterr().out
    assert main(["plan", "default", "--channel-rounds", "3"]) == 2
    assert "--channel-rounds needs a run profile with channel.state" in capsys.readouterr().err
    assert main(["plan", str(_run_profile(tmp_path, channel={"mode": "virtual"})), "--channel-rounds", "3"]) == 2
    assert "has no channel.state" in capsys.readouterr().err


def test_plan_and_profile_refuse_a_bad_plug_in_clearly(tmp_path, monkeypatch, capsys):
    _module(tmp_path, monkeypatch, "badpol", """
        from testbed.core.policy import Decision
        class Overlong:
            def decide(self, scenario, context):
                return Decision(modes=["UL"] * scenario.num_devices, draft_lens=[99] * scenario.num_devices)
    """)
    assert main(["plan", "example-two-devices", "--policy", "badpol:Overlong"]) == 2
    assert "policy badpol:Overlong: draft_lens[0]" in capsys.readouterr().err
    with pytest.raises(ProfileError, match="policy: .*no module named 'nosuch_pkg_xyz'"):
        load_profile(str(_run_profile(tmp_path, policy="nosuch_pkg_xyz:P")))
    with pytest.raises(ProfileError, match="unknown channel source 'gilbert-eliot'"):
        load_profile(str(_run_profile(tmp_path, channel={"state": {"source": "gilbert-eliot"}})))
    with pytest.raises(ProfileError, match="must be the name of a source"):
        load_profile(str(_run_profile(tmp_path, channel={"state": {"source": {"a": 1}}})))


def test_simulate_with_a_plug_in_policy(tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--sweep", "devices=2,4", "--drops", "2", "--policies", f"proposed,{THRESHOLD}",
                 "--out", str(out), "--no-progress"]) == 0
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 * 2 and sum(THRESHOLD in r for r in rows) == 4
    assert json.loads((out / "meta.json").read_text())["policies"] == ["proposed", THRESHOLD]


@pytest.mark.live  # two Monte Carlo sweeps: seconds
def test_simulate_monte_carlo_on_a_plug_in_channel(tmp_path):
    def sweep(name: str, bad_loss_db: float, *flags: str) -> list[dict]:
        prof = _run_profile(tmp_path, channel={"mode": "virtual", "state": {**_ge_cfg(bad_loss_db=bad_loss_db)}})
        data = yaml.safe_load(prof.read_text())
        data["scenario"]["drop"] = {"num_devices": 3}
        prof.write_text(yaml.safe_dump(data))
        out = tmp_path / name
        assert main(["simulate", str(prof), "--sweep", "devices=3", "--drops", "2", "--policies",
                     f"proposed,{THRESHOLD}", "--monte-carlo", "--rounds", "40", "--out", str(out), "--no-progress",
                     *flags]) == 0
        import csv

        return list(csv.DictReader((out / "results.csv").open()))

    static = sweep("static", 0.0)
    flat = sweep("flat", 0.0, "--channel")  # a channel equal to the static path loss: the same rounds
    ge = sweep("ge", 30.0, "--channel")
    for a, b in zip(static, flat):
        if a["policy"] == "proposed":  # stateless: the same plan every round, the same draws
            assert float(a["mc_goodput_tps"]) == pytest.approx(float(b["mc_goodput_tps"]), rel=1e-9)
        assert "mc_predicted_goodput_tps" in b and "mc_predicted_goodput_tps" not in a
    # With 30 dB of extra loss in the bad state the threshold rule sends the near device to DL mode in bad
    # rounds (it is UL at its path loss alone) and goodput drops.
    for a, b in zip(flat, ge):
        assert float(b["mc_goodput_tps"]) < float(a["mc_goodput_tps"])
    assert main(["simulate", "--sweep", "devices=2", "--channel", "--out", str(tmp_path / "x"), "--no-progress"]) == 2


# --- a live comparison on the micro pair ------------------------------------------------------------------

def test_live_compare_with_the_example_plug_ins_and_a_bad_policy(micro_pair, tmp_path):
    from support import profile_data

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "badpol.py").write_text("from testbed.core.policy import Decision\n\nclass Overlong:\n"
                                    "    def decide(self, scenario, context):\n"
                                    "        n = scenario.num_devices\n"
                                    "        return Decision(modes=['UL'] * n, draft_lens=[99] * n)\n")
    data = profile_data(micro_pair, rounds=6, policy=THRESHOLD)
    data["on_plugin_error"] = "fallback"  # the bad policy's rounds go on, on all-dl: that run is degraded
    data["channel"] = {"mode": "virtual", "state": {**_ge_cfg(), "gilbert_elliott": {
        "p_good_to_bad": 0.5, "p_bad_to_good": 0.5, "bad_loss_db": 30.0}}}
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(mods), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "compare", str(prof), "--policies",
                           f"{THRESHOLD},badpol:Overlong", "--runs-dir", str(tmp_path / "runs"), "--quiet",
                           "--no-plots"], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (parent,) = (tmp_path / "runs").iterdir()
    good = [json.loads(x) for x in (parent / THRESHOLD.replace(":", "-") / "rounds.jsonl").read_text().splitlines()]
    bad = [json.loads(x) for x in (parent / "badpol-Overlong" / "rounds.jsonl").read_text().splitlines()]
    assert len(good) == len(bad) == 6
    ge = channel_state_from_config(data["channel"]["state"], data["scenario"]["devices"])
    lmax = data["scenario"]["max_draft_len"]
    accepted: dict[int, dict] = {}
    for rec in good:
        assert rec["policy"] == THRESHOLD and "fallback" not in rec
        r, expect = rec["round"], ge.gains_db(rec["round"], 0.0)
        for name, d in rec["devices"].items():
            assert d["estimate"]["gain_db"] == pytest.approx(expect[name])  # the plug-in source's gain
            assert d["mode"] == ("UL" if expect[name] >= -100.0 else "DL")  # the plug-in policy's rule
            # L = accepted + 1 in the latest round closed when this one was planned (r - 1 or r - 2), else 4
            options = {min(accepted[q][name] + 1, lmax) for q in (r - 1, r - 2) if name in accepted.get(q, {})}
            assert d["draft_len"] in (options or {4}) | ({4} if r < 2 else set()), (r, name, d["draft_len"])
        accepted[r] = {n: d["n_accepted"] for n, d in rec["devices"].items() if not d["missed"]}
    for rec in bad:  # refused every round: planned by the safe policy, the reason in the record
        assert rec["policy"] == "badpol:Overlong" and {d["mode"] for d in rec["devices"].values()} == {"DL"}
        assert rec["fallback"]["policy"] == "all-dl" and "draft_lens[0]" in rec["fallback"]["reason"]
        assert rec["fallback"]["kind"] == "plugin_error"
    summary = json.loads((parent / "compare.json").read_text())
    assert [p["policy"] for p in summary["per_policy"]] == [THRESHOLD, "badpol:Overlong"]
    assert [p["degraded"] for p in summary["per_policy"]] == [0, 1]
    assert json.loads((parent / THRESHOLD.replace(":", "-") / "meta.json").read_text())["status"] == "complete"
    bad_summary = json.loads((parent / "badpol-Overlong" / "summary.json").read_text())
    assert json.loads((parent / "badpol-Overlong" / "meta.json").read_text())["status"] == "degraded"
    assert bad_summary["status"] == "degraded" and bad_summary["fallbacks"]["by_kind"] == {"plugin_error": 6}


def test_the_runtimes_satisfy_the_drafter_and_verifier_interfaces(micro_pair):
    from device_node.drafter import OnnxDrafter
    from device_node.drafting import Drafter
    from edge_node.verifier import BatchedVerifier, Verifier, load_target

    verifier = BatchedVerifier(load_target(micro_pair.target_dir, device="cpu"), device="cpu", threads=1)
    drafter = OnnxDrafter(str(micro_pair.draft_onnx), threads=1)
    assert isinstance(verifier, Verifier) and isinstance(drafter, Drafter)
    assert verifier.vocab_size == drafter.vocab_size

    class Half:  # a Verifier needs all of its members
        vocab_size = 8

        def verify(self, items):
            return []

    assert not isinstance(Half(), Verifier)
