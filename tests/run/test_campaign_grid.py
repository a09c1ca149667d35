"""Campaigns that grow (issue 31): grids over several keys, `campaign extend DIR` (new points, more repeats),
`report CAMPAIGN_DIR`, and runs side by side (`--jobs N`).

Planning, growing and the --jobs limits are tested without processes; two short live campaigns on the default
pair (2 rounds, virtual channel, one device) check the rest: a two-key grid that is extended with a new point
(two runs at once) and reported from its folder, and a campaign of one repeat grown to two.
"""

from __future__ import annotations

import csv
import json
import os

import pytest

from testbed.cli import main
from testbed.run.campaign import (
    CampaignError,
    Grid,
    open_campaign,
    parse_sweeps,
    plan_campaign,
    point_label,
    point_profile,
    sweep_from_spec,
)
from testbed.run.campaign_grow import extend_campaign, grown_sweep, load_campaign
from testbed.run.campaign_jobs import JobsError, check_jobs
from testbed.run.profile import load_profile

# -- grids, without processes -------------------------------------------------------------------------------

def test_two_sweeps_make_a_grid_with_the_first_key_outermost(tmp_path):
    grid = parse_sweeps(["devices=2,4", "channel.state.fading=none,rayleigh"])
    assert isinstance(grid, Grid) and grid.key == "devices,channel.state.fading"
    assert grid.values == ((2, "none"), (2, "rayleigh"), (4, "none"), (4, "rayleigh"))
    assert point_label(grid, (2, "none")) == "devices=2,channel.state.fading=none"
    prof = point_profile(load_profile(None), grid, (4, "none"))
    assert prof.device_names() == ["dev0", "dev1", "dev2", "dev3"] and prof.channel.state["fading"] == "none"
    camp = plan_campaign(tmp_path / "c", load_profile(None), grid, ["proposed", "all-ul"], 1)
    assert [(r.label, r.policy) for r in camp.runs[:3]] == [
        ("devices=2,channel.state.fading=none", "proposed"), ("devices=2,channel.state.fading=none", "all-ul"),
        ("devices=2,channel.state.fading=rayleigh", "proposed")]
    assert sweep_from_spec(camp.spec()["sweep"]) == grid  # campaign.json gives the grid back
    one = parse_sweeps(["devices=2"])
    assert sweep_from_spec(plan_campaign(tmp_path / "d", load_profile(None), one, ["proposed"], 1).spec()["sweep"]) \
        == one


@pytest.mark.parametrize("sweeps, message", [
    (["devices=2", "devices=4"], "--sweep devices: is swept twice"),
    (["dl_bandwidth=1e6", "scenario.downlink_bandwidth_hz=2e6"], "sets the same field as --sweep dl_bandwidth"),
])
def test_a_key_twice_is_refused(sweeps, message):
    with pytest.raises(CampaignError, match=message):
        parse_sweeps(sweeps)


def test_every_grid_point_is_checked_before_the_first_run(tmp_path, capsys):
    out = tmp_path / "c"
    code = main(["campaign", "--sweep", "devices=1,2", "--sweep", "channel.state.fading=none,rician",
                 "--rounds", "2", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "--sweep channel.state.fading=rician: 'rician' is not allowed" in capsys.readouterr().err


def test_growing_appends_values_and_refuses_a_new_key():
    grid = parse_sweeps(["devices=1,2", "channel.state.fading=none"])
    grown = grown_sweep(grid, parse_sweeps(["devices=2,3"]))
    assert grown.values == ((1, "none"), (2, "none"), (3, "none"))  # 2 is there already: kept once, in place
    with pytest.raises(CampaignError, match="a new key would change every point"):
        grown_sweep(grid, parse_sweeps(["dl_power=1"]))


def test_extend_refuses_fewer_repeats_and_a_folder_without_a_campaign(tmp_path):
    camp = plan_campaign(tmp_path / "c", load_profile(None), parse_sweeps(["devices=1"]), ["proposed"], 2)
    open_campaign(camp)
    with pytest.raises(CampaignError, match="--repeats 1: the campaign has 2 repeats already"):
        extend_campaign(tmp_path / "c", None, 1)
    with pytest.raises(CampaignError, match="not a campaign folder"):
        extend_campaign(tmp_path, None, 3)
    loaded = load_campaign(tmp_path / "c")  # the stored settings, planned again
    assert [r.run_dir for r in loaded.runs] == [r.run_dir for r in camp.runs]


def test_jobs_are_refused_above_the_cores_the_memory_and_with_fixed_endpoints(tmp_path):
    camp = plan_campaign(tmp_path / "c", load_profile(None), parse_sweeps(["devices=4"]), ["proposed"], 2)
    with pytest.raises(JobsError, match="--jobs 3: this host has 2 core"):
        check_jobs(3, camp.runs, cores=2, memory_mb=1e6)
    with pytest.raises(JobsError, match=r"--jobs 2: 2 runs at once need about \d+ MB and 1000 MB is available; "
                                        r"at most --jobs 1"):
        check_jobs(2, camp.runs, cores=2, memory_mb=1000)
    check_jobs(2, camp.runs, cores=2, memory_mb=1e6)  # room for both
    fixed = load_profile(None, {"endpoints": {"edge_bind": "tcp://127.0.0.1:5999"}})
    camp = plan_campaign(tmp_path / "d", fixed, parse_sweeps(["devices=1,2"]), ["proposed"], 1)
    with pytest.raises(JobsError, match=r"fixed endpoints \(endpoints.edge_bind\)"):
        check_jobs(2, camp.runs, cores=2, memory_mb=1e6)


def test_cli_refusals_name_the_flag_and_leave_no_folder(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["campaign", "--sweep", "devices=1", "--jobs", "10000", "--out", str(out)]) == 2
    assert "--jobs 10000: this host has" in capsys.readouterr().err and not out.exists()
    open_campaign(plan_campaign(out, load_profile(None), parse_sweeps(["devices=1"]), ["proposed"], 1))
    spec = (out / "campaign.json").read_text()
    for argv, message in ((["--rounds", "3"], "extend: --rounds cannot change a campaign"),
                          (["--tag", "x"], "extend: --tag/--note cannot change a campaign"),
                          (["--sweep", "dl_power=2"], "a new key would change every point")):
        assert main(["campaign", "extend", str(out), *argv]) == 2
        assert message in capsys.readouterr().err
    assert (out / "campaign.json").read_text() == spec  # refused: nothing changed
    assert main(["campaign", "extend"]) == 2 and "name the campaign folder" in capsys.readouterr().err


# -- live, on the default pair ------------------------------------------------------------------------------

SHORT = ["--rounds", "2", "--channel", "virtual", "--policies", "all-ul", "--no-plots", "--quiet"]


def _rows(out) -> list[dict]:
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.live
def test_a_grid_campaign_is_extended_with_a_point_and_reported_from_its_folder(tmp_path, capsys):
    out = tmp_path / "grid"
    assert main(["campaign", "--sweep", "devices=1", "--sweep", "channel.state.fading=none,rayleigh",
                 "--out", str(out), "--tag", "grid", *SHORT]) == 0
    before = _rows(out)
    assert [(r["devices"], r["channel.state.fading"], r["value"], r["status"]) for r in before] == [
        ("1", "none", "1,none", "complete"), ("1", "rayleigh", "1,rayleigh", "complete")]
    kept = {r["run"]: (out / r["run"] / "rounds.jsonl").read_bytes() for r in before}

    # A new value of the first key: two new points; the stored settings and tags reused.
    assert main(["campaign", "extend", str(out), "--sweep", "devices=2", "--no-plots", "--quiet"]) == 0
    after = _rows(out)
    assert [(r["devices"], r["channel.state.fading"]) for r in after] == [
        ("1", "none"), ("1", "rayleigh"), ("2", "none"), ("2", "rayleigh")]
    old = {r["run"]: r for r in after}
    for r in before:  # the finished runs were not run again: their rows and records are as they were
        assert old[r["run"]] == r and (out / r["run"] / "rounds.jsonl").read_bytes() == kept[r["run"]]
    spec = json.loads((out / "campaign.json").read_text())
    assert spec["sweep"][0] == {"key": "devices", "values": [1, 2]} and spec["extended"][0]["added"] == "2 point(s)"
    new = json.loads((out / "devices=2,channel.state.fading=rayleigh" / "all-ul" / "meta.json").read_text())
    assert new["tags"] == ["grid"] and new["profile"]["rounds"] == 2
    assert new["sweep"]["point"] == {"devices": 2, "channel.state.fading": "rayleigh"}
    assert new["profile"]["channel"]["mode"] == "virtual" and len(new["profile"]["scenario"]["devices"]) == 2

    capsys.readouterr()
    assert main(["report", str(out), "--format", "svg"]) == 0
    text = capsys.readouterr().out
    assert "4 points x 1 policies x 1 repeat(s); 4 of 4 runs finished" in text
    assert "devices=2,channel.state.fading=rayleigh: measured/predicted tok/s: all-ul" in text
    assert (out / "plots" / "goodput.svg").stat().st_size > 1000 and (out / "plots" / "goodput.caption.txt").is_file()
    assert "one panel per channel.state.fading" in (out / "plots" / "goodput.caption.txt").read_text()


@pytest.mark.live
def test_one_repeat_grown_to_two_keeps_the_first_under_rep0(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["campaign", "--sweep", "devices=1", "--out", str(out), *SHORT]) == 0
    first = (out / "devices=1" / "all-ul" / "rounds.jsonl").read_bytes()
    assert main(["campaign", "extend", str(out), "--repeats", "2", "--no-plots", "--quiet"]) == 0
    assert not (out / "devices=1" / "all-ul").exists()
    assert (out / "devices=1" / "all-ul-rep0" / "rounds.jsonl").read_bytes() == first
    rows = _rows(out)
    assert [(r["repeat"], r["seed"], r["run"]) for r in rows] == [
        ("0", "0", "devices=1/all-ul-rep0"), ("1", "1", "devices=1/all-ul-rep1")]
    assert json.loads((out / "campaign.json").read_text())["extended"][0]["renamed"] == ["devices=1/all-ul"]
    # Nothing more to add: it says so and runs nothing.
    capsys.readouterr()
    assert main(["campaign", "extend", str(out), "--repeats", "2", "--no-plots", "--quiet"]) == 0
    assert "added nothing" in capsys.readouterr().out and len(_rows(out)) == 2


@pytest.mark.live
@pytest.mark.slow  # two worker processes each import torch and load the pair: ~30 s on two idle cores
def test_two_runs_at_once_each_with_its_own_processes(tmp_path, capsys):
    out = tmp_path / "jobs"
    assert main(["campaign", "--sweep", "devices=1,2", "--out", str(out), "--jobs", "2", *SHORT]) == 0
    rows = _rows(out)
    assert [(r["value"], r["status"]) for r in rows] == [("1", "complete"), ("2", "complete")]
    for r in rows:
        meta = json.loads((out / r["run"] / "meta.json").read_text())
        assert meta["jobs"] == 2 and meta["pid"] != os.getpid()  # each ran in a worker process
        assert len(json.loads((out / r["run"] / "summary.json").read_text())["devices"]) == int(r["value"])
    pids = {json.loads((out / r["run"] / "meta.json").read_text())["pid"] for r in rows}
    assert len(pids) == 2  # side by side: one worker each


@pytest.mark.live
@pytest.mark.slow  # a local Ray instance starts in ~10 s
def test_runs_as_ray_tasks_on_a_local_instance(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    assert main(["campaign", "--sweep", "devices=1", "--out", str(out), "--ray", "--jobs", "1", *SHORT]) == 0
    row = _rows(out)[0]
    meta = json.loads((out / row["run"] / "meta.json").read_text())
    assert row["status"] == "complete" and meta["jobs"] == "ray:local" and meta["pid"] != os.getpid()


@pytest.mark.live
@pytest.mark.slow  # two runs side by side, stopped and resumed: ~2 min on a loaded 2-core host
def test_sigterm_stops_runs_side_by_side_and_extend_resumes_them(tmp_path):
    import signal
    import subprocess

    from support import CLI, kill_all, pid_alive, wait_until

    out = tmp_path / "stop"
    argv = ["campaign", "--sweep", "devices=1,2", "--out", str(out), "--jobs", "2", "--rounds", "60", "--channel",
            "virtual", "--policies", "all-ul", "--no-plots", "--quiet"]
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [out / "devices=1" / "all-ul" / "rounds.jsonl", out / "devices=2" / "all-ul" / "rounds.jsonl"]
    try:
        wait_until(lambda: all(f.is_file() and f.read_text().count("\n") >= 1 for f in logs) or proc.poll() is not None,
                   300, "both runs' first round")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
    finally:
        kill_all([proc])
    metas = [json.loads((f.parent / "meta.json").read_text()) for f in logs]
    assert [m["status"] for m in metas] == ["interrupted", "interrupted"]
    assert not any(pid_alive(m["pid"]) for m in metas)  # the workers are gone
    assert not any(pid_alive(p) for m in metas for p in (m.get("pids") or {}).values()
                   if isinstance(p, int))  # and so are their devices and emulators
    assert main(["campaign", "extend", str(out), "--jobs", "2", "--no-plots", "--quiet"]) == 0
    for f in logs:
        meta = json.loads((f.parent / "meta.json").read_text())
        assert meta["status"] == "complete" and meta["resumed"][0]["from_round"] >= 1
        assert [json.loads(x)["round"] for x in f.read_text().splitlines()] == list(range(60))
