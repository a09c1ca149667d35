"""The workflow around runs: overrides and config (--set with indexes and names, --print-config, errors that
name the flag, did-you-mean, one profile resolution), finding and comparing runs (`runs`, `report A B`, a
compare directory, `compare --repeats`), the flat export, simulate's --out, and clear errors.

Run directories are synthesized with the real writer (RunRecorder) and real round records
(edge_node.controller.round_record), not by running the live testbed."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import SCEN, synth_records

from testbed.analysis import report
from testbed.analysis.export import columns, device_rows
from testbed.cli import main
from testbed.run.config_override import Override, fixed_length_notes, parse_set
from testbed.run.profile import ProfileError, find_profile, load_profile
from testbed.run.scenario_file import load_scenario
from testbed.runtime.records import RunRecorder


def synth_run(run_dir: Path, n: int = 4, policy: str = "proposed", status: str | None = "complete",
              slow: float = 1.5, planned: int | None = None, seed: int = 0, channel: str | None = None,
              **meta) -> Path:
    """A run directory as `multispin run` leaves it; status None: still "running" (no summary.json)."""
    rec = RunRecorder(run_dir)
    rec.write_meta({"name": "emulation", "policy": policy, "rounds": planned or n, "seed": seed,
                    **({"channel": {"mode": channel}} if channel else {})}, status="running", **meta)
    records = synth_records(n, policy, slow)
    for r in records:
        rec.append_round(r)
    if status is not None:
        rec.end_run(status, "done" if status == "complete" else "every device left", report.summarize(records))
    rec.close()
    return run_dir


# -- overrides and config ------------------------------------------------------------------------------

def test_set_takes_list_indexes_device_names_and_yaml_values():
    ovs = parse_set(["scenario.devices.0.distance_m=50", "scenario.devices.dev1.acceptance=0.7",
                     "deadline_s=5", "prompts=[hello, world]", "channel.state=null"])
    p = load_profile("emulation", ovs)
    devs = {d["name"]: d for d in p.scenario["devices"]}
    assert devs["dev0"]["distance_m"] == 50 and devs["dev1"]["acceptance"] == 0.7
    assert p.deadline_s == 5.0 and p.prompts == ["hello", "world"] and p.channel.state is None
    # A negative index counts from the end; the library's dict form still works.
    assert load_profile("emulation", parse_set(["scenario.devices.-1.distance_m=42"])).scenario["devices"][3][
        "distance_m"] == 42
    assert load_profile({"scenario": SCEN}, {"scenario.devices.b.draft_time_s": 0.5}).scenario["devices"][1][
        "draft_time_s"] == 0.5


@pytest.mark.parametrize("argv, expected", [
    (["--rounds", "0"], "--rounds 0: must be >= 1"),
    (["--policy", "propsed"], "--policy propsed: unknown policy; did you mean proposed?"),
    (["--seed", "-1"], "--seed -1: must be >= 0"),
    (["--set", "deadline=5"], "--set deadline=5: unknown key 'deadline' in a profile; did you mean deadline_s?"),
    (["--set", "scenario.devices.9.distance_m=5"], "index 9 is out of range: scenario.devices has 4 entries"),
    (["--set", "scenario.devices.dev9.distance_m=5"], "scenario.devices has no entry 'dev9'"),
    (["--set", "scenario.devices.dev0.acceptence=0.5"], "unknown key 'acceptence' under scenario.devices.0; did "
                                                        "you mean acceptance?"),
    (["--set", "scenario.devices.dev0.acceptance=1.5"], "--set scenario.devices.dev0.acceptance=1.5: must be in "
                                                        "(0, 1)"),
    (["--set", "channel.mode=fast"], "--set channel.mode=fast: must be one of"),
    (["--set", "channel={mod: real}"], "channel.mod: 'real' is not allowed: unknown field; did you mean mode?"),
    (["--set", "rounds.x=1"], "rounds is a value (80), not a section"),
    (["--set", "novalue"], "expected KEY=VALUE"),
])
def test_flag_errors_name_the_flag_not_the_file(argv, expected, capsys):
    assert main(["run", *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "emulation.yaml" not in err and "Traceback" not in err


def test_errors_in_the_file_name_the_file_with_a_did_you_mean(tmp_path):
    prof = tmp_path / "mine.yaml"
    prof.write_text(yaml.safe_dump({"scenario": SCEN, "deadlin_s": 3, "policy": "all_ul"}))
    with pytest.raises(ProfileError) as exc:
        load_profile(prof)
    text = str(exc.value)
    assert text.startswith(f"{prof}:") and "deadlin_s: 3 is not allowed: unknown field; did you mean deadline_s?" \
        in text and "did you mean all-ul?" in text
    # Both at once: the flag's problem by its flag, the file's under the file.
    with pytest.raises(ProfileError) as exc:
        load_profile(prof, [Override("rounds", 0, "--rounds 0")])
    assert "--rounds 0: must be >= 1" in str(exc.value) and f"{prof}:" in str(exc.value)


def test_print_config_prints_the_resolved_profile(capsys):
    assert main(["run", "--set", "scenario.devices.dev2.distance_m=77", "--rounds", "3", "--print-config"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    assert cfg["rounds"] == 3 and cfg["name"] == "emulation"
    assert [d["distance_m"] for d in cfg["scenario"]["devices"]] == [60, 180, 77, 450]
    assert cfg["channel"]["spin_s"] == 0.0005  # defaults are filled in
    assert load_profile(yaml.safe_load(out)).rounds == 3  # what it prints loads back
    assert main(["compare", "lan", "--print-config"]) == 0 and "deployment: lan" in capsys.readouterr().out
    assert main(["edge", "--profile", "lan", "--print-config"]) == 0


def test_plan_takes_set_in_the_profile_and_the_scenario_form(capsys):
    def dev0(argv):
        assert main(["plan", *argv, "--json"]) == 0
        return next(d for d in json.loads(capsys.readouterr().out)["devices"] if d["name"] == "dev0")

    base, far = dev0(["emulation"]), dev0(["emulation", "--set", "scenario.devices.dev0.distance_m=3000"])
    assert far["ul_rate_bps"] < base["ul_rate_bps"] / 10  # the override reached the plan
    assert dev0(["emulation", "--set", "devices.dev0.distance_m=3000"]) == far  # the scenario-relative form
    assert dev0(["emulation", "--set", "devices.0.distance_m=3000"]) == far  # an index
    # --print-config: the resolved run profile (what --set keys address), or the resolved scenario file.
    assert main(["plan", "emulation", "--set", "devices.dev1.distance_m=99", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["name"] == "emulation" and cfg["scenario"]["devices"][1]["distance_m"] == 99
    assert main(["plan", "default", "--set", "scenario.devices.d0.distance_m=51", "--set", "max_draft_len=6",
                 "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["devices"][0]["distance_m"] == 51 and cfg["max_draft_len"] == 6 and cfg["verify_batch"] == "ragged"
    assert load_scenario(cfg).max_draft_len == 6  # what it prints loads back
    # Errors name the flag, and say which form a key takes.
    for argv, expected in (
            (["default", "--set", "devices.d0.acceptance=1.5"], "--set devices.d0.acceptance=1.5: must be in (0, 1)"),
            (["emulation", "--set", "devices.dev0.acceptance=2"], "--set devices.dev0.acceptance=2: must be in"),
            (["default", "--set", "deadline_s=3"], "'deadline_s' is a run profile's field, and"),
            (["default", "--set", "max_draft=3"], "did you mean max_draft_len?"),
            (["emulation", "--set", "max_draft=3"], "neither a field of the run profile"),
            (["emulation", "--set", "devices.dev9.distance_m=1"], "scenario.devices has no entry 'dev9'"),
            (["emulation", "--channel-rounds", "2", "--set", "rounds=0"], "--set rounds=0: must be >= 1")):
        assert main(["plan", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert main(["plan", "emulation", "--set", "fixed_length=30", "--policy", "fixed-length", "--json"]) == 0
    captured = capsys.readouterr()
    assert "--set fixed_length=30 is clamped to max_draft_len 8" in captured.err
    assert {d["draft_len"] for d in json.loads(captured.out)["devices"]} == {8}


def test_campaign_print_config_is_its_base_profile(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["campaign", "--rounds", "3", "--set", "scenario.devices.dev1.distance_m=99", "--out", str(out),
                 "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rounds"] == 3 and cfg["scenario"]["devices"][1]["distance_m"] == 99 and not out.exists()
    assert main(["campaign", "--sweep", "devices=2,3", "--print-config"]) == 0  # the base, before the sweep
    assert len(yaml.safe_load(capsys.readouterr().out)["scenario"]["devices"]) == 4
    assert main(["campaign", "--sweep", "deadline=1,2", "--print-config"]) == 2  # the sweep is still checked
    assert "did you mean deadline_s?" in capsys.readouterr().err
    assert main(["campaign"]) == 2 and "--sweep KEY=V1,V2,... is required" in capsys.readouterr().err


def test_plan_help_says_plug_ins_are_accepted(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps (and hyphenates) to the terminal's width
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Plug-in policies are accepted too" in text and "`multispin plugins` lists them" in text
    assert "--set KEY=VALUE" in text and "--print-config" in text


def test_one_profile_resolution_for_every_command(capsys):
    assert find_profile("emulation").name == "emulation.yaml"
    assert find_profile("default").parent.name == "scenarios"
    assert find_profile("profiles/lan.yaml").name == "lan.yaml"  # the README's paths, from any folder
    with pytest.raises(ProfileError, match="did you mean emulation"):
        find_profile("emulaton")
    with pytest.raises(ProfileError, match="is a scenario file, not a run profile"):
        load_profile("default")
    # plan takes names, and a run profile's scenario: section (whose `rounds` is not the scenario's).
    assert main(["plan", "emulation", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["devices"]) == 4 and "is a run profile" in captured.err
    assert main(["plan", "example-two-devices"]) == 0
    assert main(["plan", "emulaton"]) == 2 and "did you mean emulation" in capsys.readouterr().err


def test_did_you_mean_on_policies_of_every_command(tmp_path, capsys):
    assert main(["plan", "default", "--policy", "al-dl"]) == 2
    assert "did you mean all-dl?" in capsys.readouterr().err
    assert main(["simulate", "--sweep", "devices=2", "--policies", "proposed,al-ul", "--out", str(tmp_path / "s"),
                 "--no-progress"]) == 2
    assert "unknown policy 'al-ul'; did you mean all-ul?" in capsys.readouterr().err
    assert main(["compare", "--policies", "proposd", "--print-config"]) == 2
    assert "did you mean proposed?" in capsys.readouterr().err


def test_fixed_length_clamped_or_ignored_is_warned(capsys):
    assert main(["plan", "default", "--policy", "fixed-length", "--fixed-length", "99", "--json"]) == 0
    captured = capsys.readouterr()
    assert "--fixed-length 99 is clamped to max_draft_len 12" in captured.err
    assert json.loads(captured.out)["devices"][0]["draft_len"] == 12
    assert main(["plan", "default", "--fixed-length", "3"]) == 0
    assert "--fixed-length 3 is ignored" in capsys.readouterr().err
    assert main(["plan", "default", "--policy", "fixed-length", "--fixed-length", "3"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert fixed_length_notes(None, ["proposed"], 8) == []
    assert main(["run", "--set", "fixed_length=20", "--policy", "fixed-length", "--print-config"]) == 0
    assert "--set fixed_length=20 is clamped to max_draft_len 8" in capsys.readouterr().err


def test_run_of_a_lan_profile_says_what_it_waits_for(tmp_path, monkeypatch, capsys):
    import testbed.cli.run as run_cmd

    seen = {}
    monkeypatch.setattr(run_cmd, "execute", lambda args, profile, run_dir, **kw: seen.setdefault("dir", run_dir) and 0)
    runs = tmp_path / "runs"
    # Without keys a LAN profile is refused before a run directory is made.
    assert main(["run", "lan", "--runs-dir", str(runs)]) == 2
    assert "security:" in capsys.readouterr().err and not runs.exists()
    assert main(["run", "lan", "--set", "security=insecure", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "waiting up to 600 s for 2 device(s) dev0, dev1 to connect to tcp://0.0.0.0:5600" in out
    # the command a device host runs: the edge host's address, not the wildcard it binds
    assert "  multispin device --connect tcp://" in out and "--name dev0 --draft /" in out
    assert seen["dir"].parent == runs


# -- runs, report A B, compare -----------------------------------------------------------------------------

def _utc(hhmmss: str) -> str:
    return f"2025-01-01T{hhmmss}+00:00"  # meta.json's created_utc


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / "runs"
    synth_run(root / "20250101-100000-proposed", 6, slow=1.25, created_utc=_utc("10:00:00"))
    synth_run(root / "20250101-110000-all-dl", 4, "all-dl", slow=2.0, created_utc=_utc("11:00:00"))
    synth_run(root / "20250101-120000-proposed", 2, status=None, planned=40, pid=2 ** 22 + 12345,
              host=__import__("socket").gethostname(), created_utc=_utc("12:00:00"))  # "running", no process: died
    synth_run(root / "20250101-130000-proposed", 1, status="failed", created_utc=_utc("13:00:00"))
    (root / "20250101-140000-proposed").mkdir()  # killed before its first round: meta.json only (no created_utc)
    (root / "20250101-140000-proposed" / "meta.json").write_text(json.dumps({"status": "interrupted",
                                                                             "profile": {"name": "lan"}}))
    (root / "notes").mkdir()  # not a run: skipped
    cmp = root / "20250101-150000-compare"
    for r in range(2):  # repeat-major, as compare runs them: each run starts 5 minutes after the one before
        for k, (policy, slow) in enumerate((("proposed", 1.2), ("all-ul", 1.8))):
            synth_run(cmp / f"{policy}-rep{r}", 3, policy, slow=slow * (1 + 0.1 * r), seed=r,
                      created_utc=_utc(f"15:{10 * r + 5 * k:02d}:00"))
    (cmp / "compare.json").write_text(json.dumps({"policies": ["proposed", "all-ul"], "repeats": 2}))
    return root


def test_runs_lists_every_run_with_status_and_goodput(runs_dir, capsys):
    assert main(["runs", str(runs_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "measured" in lines[0] and "[tok/s]" in lines[1]
    body = [ln for ln in lines if ln.startswith("2025-01-01")]
    assert len(body) == 5 + 4  # five runs, four in the compare directory
    by_name = {ln.split()[-1].split("/")[-1]: ln for ln in body}
    assert "complete" in by_name["20250101-100000-proposed"] and " 6/6 " in by_name["20250101-100000-proposed"]
    assert "died" in by_name["20250101-120000-proposed"] and "2/40" in by_name["20250101-120000-proposed"]
    assert "failed" in by_name["20250101-130000-proposed"]
    assert "interrupted" in by_name["20250101-140000-proposed"] and " - " in by_name["20250101-140000-proposed"]
    assert "20250101-150000-compare/proposed-rep0" in out and "every device left" in out
    s = report.summarize(synth_records(6, slow=1.25))
    assert f"{s['goodput_run_tps']['measured']:.2f}" in by_name["20250101-100000-proposed"]
    assert main(["runs", str(runs_dir), "--json", "--last", "2"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [Path(x["path"]).name for x in listed] == ["proposed-rep1", "all-ul-rep1"]  # the last two started
    assert main(["runs", str(runs_dir / "nope")]) == 2
    capsys.readouterr()
    assert main(["report", str(runs_dir)]) == 2  # a folder of unrelated runs is no comparison
    assert f"multispin runs {runs_dir}" in capsys.readouterr().err


def test_runs_in_a_compare_directory_have_their_own_start_oldest_first(runs_dir, capsys):
    assert main(["runs", str(runs_dir)]) == 0
    body = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("2025-01-01")]
    cmp = [(ln[:19], ln.split()[-1].split("/")[-1]) for ln in body if "-compare/" in ln]
    assert cmp == [("2025-01-01 15:00:00", "proposed-rep0"), ("2025-01-01 15:05:00", "all-ul-rep0"),
                   ("2025-01-01 15:10:00", "proposed-rep1"), ("2025-01-01 15:15:00", "all-ul-rep1")]
    assert [ln[:19] for ln in body] == sorted(ln[:19] for ln in body)  # oldest first, all of them
    # A run without created_utc keeps its folder's stamp; an offset other than UTC is converted.
    interrupted = next(ln for ln in body if ln.endswith("20250101-140000-proposed"))
    assert interrupted.startswith("2025-01-01 14:00:00")
    from testbed.analysis.runs_index import run_info

    run = synth_run(runs_dir / "late", 1, created_utc="2025-01-02T01:30:00+02:00")
    assert run_info(run).stamp == "2025-01-01 23:30:00"


def test_report_of_two_runs_side_by_side(runs_dir, capsys):
    a, b = runs_dir / "20250101-100000-proposed", runs_dir / "20250101-110000-all-dl"
    assert main(["report", str(a), str(b), "--no-plots"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert a.name in head and b.name in head
    row = next(ln for ln in out.splitlines() if ln.startswith("goodput measured [tok/s]"))
    ga = report.summarize(synth_records(6, slow=1.25))["goodput_run_tps"]["measured"]
    gb = report.summarize(synth_records(4, "all-dl", slow=2.0))["goodput_run_tps"]["measured"]
    assert row.split()[-2:] == [f"{ga:.2f}", f"{gb:.2f}"]
    assert "policy" in out and "all-dl" in out and "vs proposed" in out
    assert main(["report", str(a), "--json", "--no-plots", str(b)]) == 0  # runs on both sides of an option
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 2


def test_report_keeps_channel_modes_apart(tmp_path, capsys):
    real = synth_run(tmp_path / "20250101-100000-proposed", 4, slow=1.2, channel="real")
    virt = synth_run(tmp_path / "20250101-110000-proposed", 4, slow=1.0, channel="virtual")
    real2 = synth_run(tmp_path / "20250101-120000-proposed", 4, slow=1.4, channel="real")
    assert main(["report", str(real), str(virt), str(real2), "--no-plots"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0] + " " + ln.split()[1]: ln.split() for ln in out.splitlines()
            if ln.startswith("proposed [")}
    assert set(rows) == {"proposed [real]", "proposed [virtual]"}  # one row per policy and mode, not one mean
    assert rows["proposed [real]"][2] == "2" and rows["proposed [virtual]"][2] == "1"
    warning = next(ln for ln in out.splitlines() if ln.startswith("warning:"))
    assert "mix channel modes" in warning and f"real: {real.name}, {real2.name}" in warning \
        and f"virtual: {virt.name}" in warning
    assert main(["report", str(real), str(virt), "--json", "--no-plots"]) == 0
    per = json.loads(capsys.readouterr().out)["per_policy"]
    assert [(r["policy"], r["channel"], r["runs"]) for r in per] == [("proposed", "real", 1),
                                                                      ("proposed", "virtual", 1)]
    # One mode: the policy alone, no warning.
    assert main(["report", str(real), str(real2), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and any(ln.split()[:2] == ["proposed", "2"] for ln in out.splitlines())


def test_report_of_a_compare_directory(runs_dir, capsys):
    cmp = runs_dir / "20250101-150000-compare"
    assert main(["report", str(cmp)]) == 0
    out = capsys.readouterr().out
    assert "proposed-rep0" in out.splitlines()[0] and "no round records" not in out
    agg = [ln for ln in out.splitlines() if ln.startswith(("proposed ", "all-ul "))]
    assert len(agg) == 2 and all("±" in ln for ln in agg) and agg[0].startswith("proposed")
    assert (cmp / "plots" / "compare_goodput.png").stat().st_size > 5000


@pytest.mark.live
def test_compare_with_repeats_gives_the_spread_and_its_plot(tmp_path, monkeypatch, capsys):
    import testbed.run.launcher as launcher
    import testbed.run.live as live

    calls = []

    def fake_run_live(profile, run_dir, progress=True, pair=None, **kw):
        calls.append((profile.policy, profile.seed))
        synth_run(run_dir, 3, profile.policy, slow=1.2 + 0.1 * profile.seed + (profile.policy == "all-ul"),
                  seed=profile.seed)
        return json.loads((run_dir / "summary.json").read_text())

    monkeypatch.setattr(live, "run_live", fake_run_live)
    monkeypatch.setattr(launcher, "resolve_pair", lambda profile, progress=True: {})
    monkeypatch.setattr(launcher, "require_edge_extra", lambda: None)
    assert main(["compare", "--policies", "proposed,all-ul", "--repeats", "3", "--seed", "5", "--runs-dir",
                 str(tmp_path), "--quiet"]) == 0
    assert calls == [("proposed", 5), ("all-ul", 5), ("proposed", 6), ("all-ul", 6), ("proposed", 7), ("all-ul", 7)]
    parent = next(tmp_path.glob("*-compare"))
    data = json.loads((parent / "compare.json").read_text())
    per = {r["policy"]: r for r in data["per_policy"]}
    assert per["proposed"]["runs"] == 3 and per["proposed"]["measured_std_tps"] > 0
    assert per["proposed"]["measured_mean_tps"] > per["all-ul"]["measured_mean_tps"]
    assert (parent / "plots" / "compare_goodput.png").is_file()
    assert (parent / "proposed-rep2" / "plots" / "timeline.png").is_file()
    out = capsys.readouterr().out
    assert "mean ± sample standard deviation" in out
    assert main(["report", str(parent), "--no-plots"]) == 0


# -- the flat export -------------------------------------------------------------------------------------

def test_csv_has_one_row_per_device_and_round(runs_dir, capsys):
    run = runs_dir / "20250101-100000-proposed"
    assert main(["report", str(run), "--csv"]) == 0
    with open(run / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 * 2
    cols = list(rows[0])
    assert cols[:10] == ["policy", "seed", "tags", "status", "fallback_rounds", "round", "fallback", "device", "mode",
                         "draft_len"]  # the run's, then the row's
    assert (rows[0]["policy"], rows[0]["seed"], rows[0]["tags"]) == ("proposed", "0", "")
    first = {c.split("_")[0] for c in cols}
    assert {"predicted", "measured", "estimate", "round"} <= first
    assert cols.index("predicted_draft_s") < cols.index("measured_draft_s") < cols.index("round_measured_round_s")
    assert {"predicted_ul_air_s", "measured_ul_air_s", "round_predicted_goodput_tps", "round_time_base"} <= set(cols)
    assert [(r["round"], r["device"]) for r in rows[:3]] == [("0", "a"), ("0", "b"), ("1", "a")]
    rec = synth_records(6, slow=1.25)[0]
    assert float(rows[0]["predicted_draft_s"]) == pytest.approx(rec["devices"]["a"]["predicted"]["draft_s"])
    # stdout, and several runs into one file with a run column
    capsys.readouterr()
    assert main(["report", str(run), "--csv", "-"]) == 0
    assert capsys.readouterr().out.startswith(
        "policy,seed,tags,status,fallback_rounds,round,fallback,device,mode,draft_len,")
    out = runs_dir.parent / "all.csv"
    assert main(["report", str(run), str(runs_dir / "20250101-110000-all-dl"), "--csv", str(out)]) == 0
    with open(out) as fh:
        both = list(csv.DictReader(fh))
    assert len(both) == (6 + 4) * 2 and list(both[0])[:2] == ["run", "policy"]
    assert {r["policy"] for r in both} == {"proposed", "all-dl"}
    assert main(["report", str(run), str(runs_dir / "20250101-110000-all-dl"), "--csv"]) == 2  # where to?


def test_export_columns_keep_missed_devices():
    recs = synth_records(2)
    recs[1]["devices"]["b"] = {**recs[1]["devices"]["b"], "missed": True, "measured": None}
    rows = device_rows(recs)
    assert len(rows) == 4 and rows[3]["missed"] is True and rows[3]["measured"] is None
    cols = columns(rows)
    assert cols[:3] == ["round", "fallback", "device"] and "measured_draft_s" in cols
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)  # every row fits the columns


def _cells(table) -> list[list[str]]:
    """A pyarrow table's rows as the CSV writes them (None as an empty cell)."""
    cols = table.to_pydict()
    return [["" if v is None else str(v) for v in row] for row in zip(*cols.values())]


def test_parquet_is_the_csv_table(runs_dir, tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")  # the `parquet` extra; .ci/run installs it
    run = runs_dir / "20250101-100000-proposed"
    assert main(["report", str(run), "--csv", "--parquet"]) == 0
    assert "rounds.parquet: 12 rows (one per device per round)" in capsys.readouterr().out
    with open(run / "rounds.csv", newline="") as fh:
        want = list(csv.reader(fh))
    table = pq.read_table(run / "rounds.parquet")
    assert table.num_rows == 6 * 2 == len(want) - 1
    assert table.column_names == want[0]  # same columns, same order
    assert _cells(table) == want[1:]  # same values, row by row
    types = {f.name: str(f.type) for f in table.schema}
    assert types["round"] == "int64" and types["device"] == "string" and types["predicted_draft_s"] == "double"
    assert table.column("device").to_pylist()[:3] == ["a", "b", "a"]
    # Several runs into one file: the run column first, as in the CSV.
    both = [str(run), str(runs_dir / "20250101-110000-all-dl")]
    out = tmp_path / "export" / "all.parquet"  # a folder that does not exist yet
    assert main(["report", *both, "--parquet", str(out), "--csv", str(tmp_path / "all.csv")]) == 0
    with open(tmp_path / "all.csv", newline="") as fh:
        want = list(csv.reader(fh))
    table = pq.read_table(out)
    assert table.column_names[0] == "run" and table.column_names == want[0] and _cells(table) == want[1:]
    assert table.num_rows == (6 + 4) * 2
    assert main(["report", str(run), "--parquet", "-"]) == 2 and "binary" in capsys.readouterr().err


def test_parquet_keeps_missed_devices_and_mixed_columns(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from testbed.analysis.export import write_parquet

    recs = synth_records(2)
    recs[1]["devices"]["b"] = {**recs[1]["devices"]["b"], "missed": True, "measured": None}
    rows = device_rows(recs)
    rows[0]["note"], rows[2]["note"] = 3, "late"  # one column of a number and a word: kept as text
    assert write_parquet(rows, tmp_path / "r.parquet") == 4
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.column_names == columns(rows)
    assert table.column("missed").to_pylist()[3] is True
    assert table.column("measured_draft_s").to_pylist()[3] is None
    assert table.column("note").to_pylist() == ["3", None, "late", None]


def test_parquet_without_pyarrow_says_what_to_install(runs_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    run = runs_dir / "20250101-100000-proposed"
    assert main(["report", str(run), "--parquet"]) == 2
    err = capsys.readouterr().err
    assert "--parquet needs pyarrow" in err and "multispin-testbed[parquet]" in err and "--csv" in err
    assert not (run / "rounds.parquet").exists()


# -- simulate --out, clear errors ------------------------------------------------------------------------

def test_simulate_refuses_a_non_empty_out_and_writes_meta(tmp_path, capsys):
    out = tmp_path / "sim"
    args = ["simulate", "--sweep", "devices=2,3", "--drops", "1", "--policies", "proposed,all-dl", "--out", str(out),
            "--no-progress", "--seed", "3"]
    assert main([*args, "--monte-carlo", "--rounds", "10"]) == 0
    assert (out / "monte_carlo.png").is_file()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["seed"] == 3 and meta["argv"] and "git_revision" in meta and meta["version"]
    assert meta["sweep"] == {"key": "devices", "values": [2, 3], "given": "devices=2,3"} and meta["created_utc"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    (out / "mine.txt").write_text("kept")
    assert main([*args, "--force"]) == 0
    # The earlier sweep's Monte Carlo plot is gone; the user's own file stays.
    assert not (out / "monte_carlo.png").exists() and (out / "mine.txt").read_text() == "kept"
    assert main(["simulate", "--sweep", "devices=2", "--rounds", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--rounds 0: must be >= 1" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_device_connect_without_a_scheme_says_what_to_write(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["device", "--connect", "127.0.0.1:19070", "--name", "d0", "--draft", "x.onnx"])
    assert exc.value.code == 2
    assert "use tcp://HOST:PORT (here: tcp://127.0.0.1:19070)" in capsys.readouterr().err


@pytest.mark.live
def test_report_piped_into_head_exits_quietly(runs_dir):
    run = runs_dir / "20250101-100000-proposed"
    synth_run(run.parent / "long", 120)  # a CSV larger than a pipe's buffer
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "report", str(run.parent / "long"), "--csv", "-"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_quiet_means_warnings_only_and_no_progress_bars(monkeypatch, capsys):
    root = logging.getLogger()
    level = root.level
    for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(var, "")  # restored after the test
    try:
        assert main(["run", "--quiet", "--print-config"]) == 0
        assert root.level == logging.WARNING
        assert os.environ["TQDM_DISABLE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    finally:
        root.setLevel(level)
