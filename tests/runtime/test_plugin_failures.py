"""No silent fallback (issue 29, item 2): a plug-in that raises stops a run (exit status 3, status failed,
`plugin_failure`), or with `on_plugin_error: fallback` the round goes on without it and the run is
`degraded` (records marked, counts per kind in summary.json, `runs` / `report` / campaign rows show it);
plug-in parameters (`Params`, `policy_params`, `channel.state.params`) are checked at profile load.

Plug-ins are written to temporary folders; the live test runs `multispin run` on the micro pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from support import ROOT

from edge_node.controller import Controller, round_record
from testbed.analysis.report import format_summary, summarize, summarize_fallbacks
from testbed.analysis.runs_index import find_runs, format_runs_table, run_info, side_by_side
from testbed.channel.state import ChannelSourceError
from testbed.cli import main
from testbed.core.scenario import Scenario
from testbed.run.profile import ProfileError, load_profile
from testbed.runtime.plugins import (
    PLUGIN_FAILURE_EXIT,
    PluginError,
    PluginFailure,
    channel_state_from_config,
    load_policy,
)

EXAMPLE = ROOT / "examples" / "ge_threshold"
SC = {"max_draft_len": 6, "vocab_size": 2048, "downlink_bandwidth_hz": 2e6, "downlink_power_w": 2.0,
      "devices": [{"name": f"d{i}", "distance_m": 80 + 120 * i, "draft_time_s": 0.01, "acceptance": 0.6}
                  for i in range(2)]}

PLUGINS = """
    from pydantic import BaseModel, Field
    from testbed.channel.source import LinkState
    from testbed.core.policy import Decision

    class Flaky:
        \"\"\"DL mode, L = draft_len; raises in round fail_round.\"\"\"
        Params = {"draft_len": 2, "fail_round": 1}

        def __init__(self, draft_len, fail_round):
            self.draft_len, self.fail_round = draft_len, fail_round

        def decide(self, scenario, context):
            if context.round == self.fail_round:
                raise RuntimeError(f"flaky broke in round {context.round}")
            n = scenario.num_devices
            return Decision(modes=["DL"] * n, draft_lens=[self.draft_len] * n, info={"draft_len": self.draft_len})

    class Typed:
        class Params(BaseModel):
            model_config = {"extra": "forbid"}
            draft_len: int = Field(default=3, ge=1)

        def __init__(self, draft_len):
            self.draft_len = draft_len

        def decide(self, scenario, context):
            n = scenario.num_devices
            return Decision(modes=["UL"] * n, draft_lens=[self.draft_len] * n)

    class Plain:
        def decide(self, scenario, context):
            n = scenario.num_devices
            return Decision(modes=["DL"] * n, draft_lens=[1] * n)

    class FlakySource:
        \"\"\"A flat gain (params.gain_db); link_states raises from round fail_round on.\"\"\"
        Params = {"gain_db": -90.0, "fail_round": 2}

        def __init__(self, cfg, devices):
            self.names = [d["name"] for d in devices]
            self.gain_db, self.fail_round = cfg["params"]["gain_db"], cfg["params"]["fail_round"]

        def link_states(self, round_index, t_s):
            if round_index >= self.fail_round:
                raise KeyError("no such tap")
            return {n: LinkState(gain_db=self.gain_db) for n in self.names}

    class Empty:
        \"\"\"No gain at all: the mean path loss at distance_m stands in (gain_fallback).\"\"\"
        def __init__(self, cfg, devices):
            self.names = [d["name"] for d in devices]

        def link_states(self, round_index, t_s):
            return {n: LinkState() for n in self.names}
"""


@pytest.fixture
def plugs(tmp_path, monkeypatch):
    folder = tmp_path / "plugmods"
    folder.mkdir()
    (folder / "flakyplug.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("flakyplug", None)
    return folder


def _names(sc: Scenario) -> list[str]:
    return [d.name for d in sc.devices]


# --- parameters -------------------------------------------------------------------------------------------

def test_a_policy_gets_its_declared_parameters_and_unknown_ones_are_refused(plugs):
    pol = load_policy("flakyplug:Flaky", {"draft_len": 3})
    assert pol.params == {"draft_len": 3, "fail_round": 1} and pol.policy.draft_len == 3
    assert load_policy("flakyplug:Flaky").params == {"draft_len": 2, "fail_round": 1}  # the defaults
    with pytest.raises(PluginError, match=r"policy 'flakyplug:Flaky': unknown parameter 'draft_lne'; did you mean "
                                          r"draft_len\? \(its parameters: draft_len, fail_round\)"):
        load_policy("flakyplug:Flaky", {"draft_lne": 3})
    assert load_policy("flakyplug:Typed", {"draft_len": 5}).params == {"draft_len": 5}
    with pytest.raises(PluginError, match=r"policy 'flakyplug:Typed': parameter draft_len: .*greater than or equal "
                                          r"to 1 \(given: 0\)"):
        load_policy("flakyplug:Typed", {"draft_len": 0})
    with pytest.raises(PluginError, match=r"policy 'flakyplug:Plain' takes no parameters .*given: x"):
        load_policy("flakyplug:Plain", {"x": 1})
    with pytest.raises(PluginError, match="policy 'proposed' is built in and takes no parameters"):
        load_policy("proposed", {"x": 1})


def _profile(tmp_path: Path, **over) -> dict:
    data = {"name": "p", "policy": "flakyplug:Flaky", "channel": {"mode": "virtual"}, "scenario": dict(SC)}
    data.update(over)
    return data


def test_the_profile_checks_plug_in_parameters_at_load(plugs, tmp_path):
    prof = load_profile(_profile(tmp_path, policy_params={"flakyplug:Flaky": {"fail_round": 7}}))
    assert prof.policy_params == {"flakyplug:Flaky": {"fail_round": 7}} and prof.on_plugin_error == "stop"
    assert prof.fallback_policy == "all-dl"
    with pytest.raises(ProfileError, match=r"policy_params.*'flakyplug:Flaky': unknown parameter 'fail'"):
        load_profile(_profile(tmp_path, policy_params={"flakyplug:Flaky": {"fail": 7}}))
    with pytest.raises(ProfileError, match="on_plugin_error"):
        load_profile(_profile(tmp_path, on_plugin_error="ignore"))
    with pytest.raises(ProfileError, match="fallback_policy.*must be a built-in policy; did you mean all-dl"):
        load_profile(_profile(tmp_path, fallback_policy="alldl"))
    state = {"source": "flakyplug:FlakySource", "params": {"gain_db": -80.0}}
    prof = load_profile(_profile(tmp_path, channel={"mode": "virtual", "state": state}))
    cs = channel_state_from_config(prof.channel.state, SC["devices"])
    assert cs.gains_db(0, 0.0) == {"d0": -80.0, "d1": -80.0}  # params reached the source, defaults filled in
    with pytest.raises(ProfileError, match=r"channel source 'flakyplug:FlakySource': unknown parameter 'gain'"):
        load_profile(_profile(tmp_path, channel={"mode": "virtual", "state": {**state, "params": {"gain": 1}}}))


def test_the_example_plug_ins_declare_their_parameters(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    pol = load_policy("ge_threshold.policies:ChannelThreshold", {"threshold_db": -95.0})
    assert pol.policy.threshold_db == -95.0 and pol.params == {"threshold_db": -95.0, "draft_len": 4}
    cfg = {"source": "ge_threshold.channels:GilbertElliott", "seed": 1, "params": {"bad_loss_db": 0.0}}
    flat = channel_state_from_config(cfg, [{"name": "a", "distance_m": 100.0}])
    assert len({flat.gains_db(r, 0.0)["a"] for r in range(20)}) == 1  # no extra loss in the bad state
    with pytest.raises(PluginError, match="unknown parameter 'p_good_bad'"):
        channel_state_from_config({**cfg, "params": {"p_good_bad": 0.1}}, [{"name": "a", "distance_m": 100.0}])


# --- a policy that raises -----------------------------------------------------------------------------------

def test_a_raising_policy_stops_the_controller_naming_it_the_round_and_the_error(plugs, caplog):
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, policy="flakyplug:Flaky")
    assert "fallback" not in ctl.plan_round(0, _names(sc)).plan
    with pytest.raises(PluginFailure) as info:
        ctl.plan_round(1, _names(sc))
    exc = info.value
    assert str(exc).startswith("policy 'flakyplug:Flaky' failed in round 1: RuntimeError: flaky broke in round 1")
    assert exc.exit_status == PLUGIN_FAILURE_EXIT == 3 and exc.round == 1 and exc.kind == "policy"
    assert "Traceback" in exc.traceback and "flaky broke" in exc.traceback
    assert "stopping the run" in caplog.text and "Traceback" in caplog.text


def test_with_fallback_a_raising_policy_marks_its_rounds_and_the_summary_counts_them(plugs):
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, policy="flakyplug:Flaky", on_plugin_error="fallback", fallback_policy="all-ul",
                     policy_params={"fail_round": 1})
    records = []
    for r in range(3):
        rp = ctl.plan_round(r, _names(sc))
        records.append(round_record(rp, policy=ctl.policy, outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0))
    assert "fallback" not in records[0] and "fallback" not in records[2]
    fb = records[1]["fallback"]
    assert fb == {"policy": "all-ul", "instead_of": "flakyplug:Flaky", "kind": "plugin_error", "error": "PolicyError",
                  "reason": "policy flakyplug:Flaky: decide() raised RuntimeError: flaky broke in round 1"}
    assert {d["mode"] for d in records[1]["devices"].values()} == {"UL"}
    assert records[0]["estimates_from"]["verify_model"] == "prior"
    assert records[0]["estimates_from"]["alpha_prior"] == ["d0", "d1"]
    assert summarize_fallbacks(records) == {"rounds": 1, "by_kind": {"plugin_error": 1}, "policies": ["all-ul"]}
    assert summarize(records)["fallbacks"]["rounds"] == 1


# --- a channel source that raises --------------------------------------------------------------------------

def _state(**params):
    return channel_state_from_config({"source": "flakyplug:FlakySource", "params": params}, SC["devices"])


def test_a_raising_channel_source_is_named_and_stops_the_controller(plugs):
    cs = _state(fail_round=1)
    with pytest.raises(ChannelSourceError, match=r"channel source 'flakyplug:FlakySource', round 1: link_states "
                                                 r"raised KeyError: 'no such tap'"):
        cs.gains_db(1, 0.0)
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, channel_state=_state(fail_round=1))
    ctl.plan_round(0, _names(sc))
    with pytest.raises(PluginFailure, match=r"channel source 'flakyplug:FlakySource' failed in round 1: "
                                            r"ChannelSourceError: .*KeyError: 'no such tap'") as info:
        ctl.plan_round(1, _names(sc))
    assert info.value.kind == "channel source"


def test_with_fallback_a_raising_channel_source_plans_on_the_static_gains(plugs):
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, channel_state=_state(fail_round=1, gain_db=-70.0), on_plugin_error="fallback")
    first = ctl.plan_round(0, _names(sc))
    rp = ctl.plan_round(1, _names(sc))
    assert first.channel_fallback is None and {e["gain_db"] for e in first.estimates.values()} == {-70.0}
    static = dict(zip(_names(sc), sc.gains_db().tolist()))
    assert {n: e["gain_db"] for n, e in rp.estimates.items()} == pytest.approx(static)
    rec = round_record(rp, policy=ctl.policy, outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0)
    cf = rec["channel_fallback"]
    assert cf["kind"] == "channel_source_error" and cf["source"] == "flakyplug:FlakySource" and cf["gains"] == "static"
    assert "KeyError" in cf["reason"]
    assert summarize_fallbacks([rec]) == {"rounds": 1, "by_kind": {"channel_source_error": 1}, "policies": []}


def test_a_source_without_gains_is_recorded_as_the_path_loss_fallback(plugs):
    sc = Scenario.from_dict(SC)
    cs = channel_state_from_config({"source": "flakyplug:Empty"}, SC["devices"])
    rp = Controller(sc, channel_state=cs).plan_round(0, _names(sc))
    rec = round_record(rp, policy="proposed", outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0)
    assert all("mean path loss" in d["gain_fallback"] for d in rec["devices"].values())


def test_plan_channel_rounds_names_a_raising_source_and_a_raising_policy(plugs, tmp_path, capsys):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(_profile(tmp_path, policy="proposed", channel={
        "mode": "virtual", "state": {"source": "flakyplug:FlakySource", "params": {"fail_round": 2}}})))
    assert main(["plan", str(prof), "--channel-rounds", "4"]) == 2
    err = capsys.readouterr().err
    assert "channel source 'flakyplug:FlakySource'" in err and "round 2" in err and "KeyError" in err
    assert main(["plan", str(prof), "--policy", "flakyplug:Flaky", "--channel-rounds", "2"]) == 2
    err = capsys.readouterr().err
    assert "policy 'flakyplug:Flaky' failed in round 1: RuntimeError: flaky broke in round 1" in err


# --- how a degraded or failed run shows -------------------------------------------------------------------

def _degraded_run(plugs, folder: Path) -> Path:
    """A run directory as a run with on_plugin_error: fallback leaves it: 4 rounds, 2 of them fallen back."""
    sc = Scenario.from_dict(SC)
    ctl = Controller(sc, policy="flakyplug:Flaky", on_plugin_error="fallback")
    records = []
    for r in range(4):
        ctl.policy_impl.policy.fail_round = r if r in (1, 3) else -1
        rp = ctl.plan_round(r, _names(sc))
        records.append(round_record(rp, policy=ctl.policy, outcomes={}, verify_s=None, round_s=0.1,
                                    t_start_s=0.1 * r))
    run = folder / "20250101-000000-flaky"
    run.mkdir(parents=True)
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from testbed.run.session import degraded

    summary = summarize(records)
    status, reason = degraded("complete", "4 rounds", summary)
    assert status == "degraded" and reason == "4 rounds; 2 of 4 rounds fell back (plugin_error 2)"
    (run / "summary.json").write_text(json.dumps({**summary, "status": status, "reason": reason}))
    (run / "meta.json").write_text(json.dumps({"status": status, "reason": reason, "created_utc":
                                               "2025-01-01T00:00:00+00:00",
                                               "profile": {"name": "p", "policy": "flakyplug:Flaky", "rounds": 4}}))
    return run


def test_runs_and_report_show_a_degraded_run_and_its_fallbacks(plugs, tmp_path, capsys):
    run = _degraded_run(plugs, tmp_path / "runs")
    info = run_info(run)
    assert info.status == "degraded" and info.fallback_rounds == 2 and info.fallbacks == {"plugin_error": 2}
    table = format_runs_table(find_runs(tmp_path / "runs"))
    assert "degraded (2)" in table and "2 of 4 rounds fell back (plugin_error 2)" in table
    assert "fallback rounds" in side_by_side([info]) and "2 (plugin_error 2)" in side_by_side([info])
    assert main(["runs", str(tmp_path / "runs")]) == 0
    assert "degraded (2)" in capsys.readouterr().out
    assert main(["report", str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "status degraded" in out and "DEGRADED: 2 rounds fell back to all-dl (plugin_error 2)" in out
    assert "DEGRADED" not in format_summary(summarize([json.loads(x) for x in
                                                       (run / "rounds.jsonl").read_text().splitlines()][:1]))


def test_report_csv_carries_the_runs_status_and_each_rounds_fallback(plugs, tmp_path, capsys):
    import csv

    run = _degraded_run(plugs, tmp_path / "runs")
    assert main(["report", str(run), "--csv", str(tmp_path / "t.csv")]) == 0
    with open(tmp_path / "t.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["status"], r["fallback_rounds"]) for r in rows} == {("degraded", "2")}
    fell = {int(r["round"]): r["fallback"] for r in rows}
    assert fell == {0: "", 1: "plugin_error", 2: "", 3: "plugin_error"}
    assert list(rows[0])[:7] == ["policy", "seed", "tags", "status", "fallback_rounds", "round", "fallback"]


def test_a_campaign_row_carries_the_status_and_the_fallback_counts(plugs, tmp_path):
    from testbed.run.campaign import FINISHED, RESULT_FIELDS, Campaign, CampaignRun, result_row, run_status

    run = _degraded_run(plugs, tmp_path / "camp" / "p1")
    assert run_status(run) in FINISHED and {"status", "fallback_rounds", "fallbacks"} <= set(RESULT_FIELDS)
    prof = load_profile(_profile(tmp_path))

    class _Sweep:
        key = "seed"

    camp = Campaign.__new__(Campaign)
    camp.sweep, camp.out = _Sweep(), tmp_path / "camp"
    row = result_row(camp, CampaignRun(1, "p1", "flakyplug:Flaky", 0, run, prof))
    assert row["status"] == "degraded" and row["fallback_rounds"] == 2 and row["fallbacks"] == "plugin_error=2"


def test_multispin_run_exits_3_on_a_plugin_failure(monkeypatch, tmp_path, capsys):
    import testbed.run.live as live

    def boom(profile, run_dir, **kw):
        raise PluginFailure("policy", "mine:P", 4, "RuntimeError: no", "Traceback ...")

    monkeypatch.setattr(live, "run_live", boom)
    monkeypatch.setattr("testbed.run.launcher.require_edge_extra", lambda: None)
    code = main(["run", "--runs-dir", str(tmp_path / "runs"), "--no-plots", "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and "policy 'mine:P' failed in round 4: RuntimeError: no" in err
    assert "plugin_error.log" in err


# --- live: the run's exit status and directory ----------------------------------------------------------------

def test_a_live_run_with_a_raising_policy_exits_3_and_says_failed(micro_pair, plugs, tmp_path):
    from support import profile_data

    data = profile_data(micro_pair, rounds=4, policy="flakyplug:Flaky",
                        policy_params={"flakyplug:Flaky": {"fail_round": 2}})
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugs), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(prof), "--runs-dir", str(tmp_path / "runs"),
                           "--quiet", "--no-plots"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "policy 'flakyplug:Flaky' failed in round 2: RuntimeError: flaky broke in round 2" in proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    meta, summary = (json.loads((run / f).read_text()) for f in ("meta.json", "summary.json"))
    assert meta["status"] == summary["status"] == "failed" and "failed in round 2" in meta["reason"]
    assert meta["plugin_failure"] == summary["plugin_failure"] == {
        "kind": "policy", "name": "flakyplug:Flaky", "round": 2, "error": "RuntimeError: flaky broke in round 2"}
    assert "Traceback" in (run / "logs" / "plugin_error.log").read_text()


def test_simulate_channel_gains_name_a_raising_source_in_one_line(plugs):
    from testbed.runtime.plugins import ChannelGains

    gains = ChannelGains({"source": "flakyplug:FlakySource", "params": {"fail_round": 1}})(Scenario.from_dict(SC), 0)
    assert gains(0, 0.0) == {"d0": -90.0, "d1": -90.0}
    with pytest.raises(PluginError, match=r"channel source 'flakyplug:FlakySource', round 1: link_states raised "
                                          r"KeyError"):
        gains(1, 0.0)
