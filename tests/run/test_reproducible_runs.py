"""Reproducible, comparable runs: what a run directory holds to be run again (meta.json's command line,
overrides, seed, tags, version, host; profile.yaml), `multispin rerun`, `report A B` grouping runs by their
settings, `runs` showing overrides, seed and tags, the exports' run columns, and --quiet.

Run directories are synthesized with the real writer (RunRecorder) and real round records; `run_live` is
replaced by a writer of such a directory, but for the one live test (rerun at temperature 0: the same tokens)."""

from __future__ import annotations

import csv
import json
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import CLI, profile_data, synth_records

from testbed.analysis import report
from testbed.analysis.export import device_rows, run_context
from testbed.analysis.runs_index import aggregate, differing_settings, flat_settings, run_info
from testbed.cli import main
from testbed.run.live import run_meta
from testbed.run.profile import load_profile
from testbed.runtime.records import PROFILE_FILE, RunRecorder, host_facts, run_facts


def write_run(run_dir: Path, profile, n: int = 3, slow: float = 1.5, status: str = "complete", **meta) -> Path:
    """A run directory as `run_live` leaves it, for a resolved profile and the command's meta fields."""
    rec = RunRecorder(run_dir)
    rec.write_meta(profile.snapshot(), **{"seed": profile.seed, **meta}, status="running")
    records = synth_records(n, profile.policy, slow)
    for r in records:
        rec.append_round(r)
    rec.end_run(status, "done", report.summarize(records))
    rec.close()
    return run_dir


@pytest.fixture
def fake_live(monkeypatch):
    """`run_live` writes a synthetic run directory with the meta it is given; returns the calls."""
    import testbed.run.launcher as launcher
    import testbed.run.live as live

    calls = []

    def fake_run_live(profile, run_dir, progress=True, pair=None, meta=None, **kw):
        calls.append((profile, Path(run_dir), meta))
        write_run(Path(run_dir), profile, slow=1.2 + 0.1 * len(calls), **(meta or {}))
        return json.loads((Path(run_dir) / "summary.json").read_text())

    monkeypatch.setattr(live, "run_live", fake_run_live)
    monkeypatch.setattr(launcher, "resolve_pair", lambda profile, progress=True: {})
    monkeypatch.setattr(launcher, "require_edge_extra", lambda: None)
    return calls


# -- what a run directory holds ----------------------------------------------------------------------------

def test_meta_holds_what_reruns_the_run_and_profile_yaml_the_resolved_profile(tmp_path):
    profile = load_profile(None, {"deadline_s": 5, "seed": 11})
    run = write_run(tmp_path / "r", profile, **run_meta(argv=["run", "--set", "deadline_s=5", "--seed", "11"],
                                                         overrides=["--set deadline_s=5", "--seed 11"],
                                                         tags=["base"], note="a note"))
    meta = json.loads((run / "meta.json").read_text())
    assert meta["command"] == "multispin run --set deadline_s=5 --seed 11"
    assert meta["argv"] == ["multispin", "run", "--set", "deadline_s=5", "--seed", "11"]
    assert meta["overrides"] == ["--set deadline_s=5", "--seed 11"] and meta["seed"] == 11
    assert meta["tags"] == ["base"] and meta["note"] == "a note"
    assert meta["version"] and "git_revision" in meta and meta["packages"]["numpy"] == np.__version__
    host = meta["host_info"]
    assert set(host) >= {"cpu_model", "cores", "memory_bytes", "os", "python"} and host["cores"] >= 1
    assert meta["profile"] == profile.snapshot()
    # profile.yaml: the same resolved profile, as a profile file that loads back to it
    data = yaml.safe_load((run / PROFILE_FILE).read_text())
    assert data == json.loads(json.dumps(profile.snapshot()))
    assert load_profile(str(run / PROFILE_FILE)).snapshot() == profile.snapshot()


def test_host_facts_and_run_facts_never_fail():
    facts = run_facts()
    assert facts["host_info"] == host_facts() or facts["host_info"]["cores"] == host_facts()["cores"]
    assert isinstance(facts["command"], str) and facts["cwd"]


def test_run_stores_overrides_seed_tags_and_note(tmp_path, fake_live):
    argv = ["run", "--set", "deadline_s=5", "--seed", "3", "--tag", "a", "--tag", "b", "--tag", "a", "--note",
            "first try", "--runs-dir", str(tmp_path), "--no-plots", "--quiet"]
    assert main(argv) == 0
    (_, run_dir, _), = fake_live
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["overrides"] == ["--set deadline_s=5", "--seed 3"] and meta["seed"] == 3
    assert meta["tags"] == ["a", "b"] and meta["note"] == "first try"
    assert meta["argv"] == ["multispin", *argv] and meta["profile"]["deadline_s"] == 5
    assert (run_dir / PROFILE_FILE).is_file()
    # --resume continues a run as it was: no new tags or note
    assert main(["run", "--resume", str(run_dir), "--tag", "x"]) == 2


# -- multispin rerun --------------------------------------------------------------------------------------

def test_rerun_runs_the_resolved_profile_again_into_a_new_directory(tmp_path, fake_live, capsys):
    assert main(["run", "--set", "deadline_s=5", "--seed", "3", "--tag", "a", "--note", "n1", "--runs-dir",
                 str(tmp_path / "runs"), "--no-plots", "--quiet"]) == 0
    first, first_dir, _ = fake_live[0]
    assert main(["rerun", str(first_dir), "--runs-dir", str(tmp_path / "again"), "--tag", "b", "--no-plots",
                 "--quiet"]) == 0
    second, second_dir, _ = fake_live[1]
    assert second_dir.parent == tmp_path / "again" and second_dir != first_dir
    assert second.snapshot() == first.snapshot()  # the same seed, policy, prompts, everything
    meta = json.loads((second_dir / "meta.json").read_text())
    assert meta["rerun_of"] == str(first_dir.resolve())
    assert meta["overrides"] == ["--set deadline_s=5", "--seed 3"]  # what made the profile it repeats
    assert meta["tags"] == ["a", "b"] and meta["note"] == "n1" and meta["argv"][:2] == ["multispin", "rerun"]
    assert f"rerun of {first_dir}" in capsys.readouterr().out
    # --print-config shows what it would run
    assert main(["rerun", str(first_dir), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["deadline_s"] == 5
    # runs lists it with what it reruns
    assert main(["runs", str(tmp_path / "again")]) == 0
    assert f"rerun of {first_dir.resolve()}" in capsys.readouterr().out


def test_rerun_refuses_what_is_no_run(tmp_path, capsys):
    assert main(["rerun", str(tmp_path)]) == 2
    assert "no meta.json" in capsys.readouterr().err
    (tmp_path / "meta.json").write_text(json.dumps({"status": "failed"}))
    assert main(["rerun", str(tmp_path)]) == 2
    assert "no profile snapshot" in capsys.readouterr().err


# -- report A B: grouped by settings ---------------------------------------------------------------------------

def _runs_with_settings(tmp_path) -> list[Path]:
    base = load_profile(None)
    d5 = load_profile(None, {"deadline_s": 5})
    return [write_run(tmp_path / "a", base.model_copy(update={"seed": 1}), slow=1.2),
            write_run(tmp_path / "b", base.model_copy(update={"seed": 2}), slow=1.4),  # a repeat of a
            write_run(tmp_path / "c", d5, slow=2.0),
            write_run(tmp_path / "d", d5.model_copy(update={"policy": "all-dl"}), slow=2.0)]


def test_report_pools_equal_settings_and_shows_the_differences(tmp_path, capsys):
    runs = _runs_with_settings(tmp_path)
    infos = [run_info(r, fresh=True) for r in runs]
    assert differing_settings(infos) == ["policy", "seed", "deadline_s"]  # policy first, then in profile order
    rows = aggregate(infos)
    assert [(r["label"], r["runs"]) for r in rows] == [("proposed [deadline_s=10]", 2), ("proposed [deadline_s=5]", 1),
                                                        ("all-dl [deadline_s=5]", 1)]
    assert rows[1]["settings"] == {"deadline_s": 5}
    assert main(["report", *map(str, runs), "--no-plots"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("settings that differ"):].splitlines()
    assert table[0].startswith("settings that differ (3;")
    cells = {ln.split()[0]: ln.split()[1:] for ln in table[2:6]}
    assert cells == {"policy": ["proposed", "proposed", "proposed", "all-dl"], "seed": ["1", "2", "0", "0"],
                     "deadline_s": ["10", "10", "5", "5"], "group": ["1", "1", "2", "3"]}
    assert "3 group(s)" in out
    assert any(ln.split()[:3] == ["proposed", "[deadline_s=10]", "2"] for ln in out.splitlines())
    assert main(["report", *map(str, runs), "--json", "--no-plots"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings_differ"] == ["policy", "seed", "deadline_s"]
    assert data["runs"][2]["settings"]["deadline_s"] == 5 and len(data["per_policy"]) == 3
    # Runs whose settings are all equal: one group, said so
    assert main(["report", str(runs[0]), str(runs[0]), "--no-plots"]) == 0
    assert "the same in every run" in capsys.readouterr().out


def test_flat_settings_names_devices_and_keeps_lists_whole():
    flat = flat_settings({"scenario": {"devices": [{"name": "dev0", "distance_m": 50}, {"name": "dev1"}],
                                       "topk_choices": [16, 64]}, "channel": {"mode": "real"}, "seed": 1})
    assert flat == {"scenario.devices.dev0.distance_m": 50, "scenario.devices.names": ["dev0", "dev1"],
                    "scenario.topk_choices": [16, 64], "channel.mode": "real", "seed": 1}


# -- runs: overrides, seed, tags ------------------------------------------------------------------------------

def test_runs_shows_overrides_seed_and_tags_and_filters_by_tag(tmp_path, capsys):
    profile = load_profile(None, {"seed": 4})
    write_run(tmp_path / "20250101-100000-proposed", profile, created_utc="2025-01-01T10:00:00+00:00",
              **run_meta(overrides=["--set deadline_s=5", "--seed 4"], tags=["base", "wifi"], note="morning"))
    write_run(tmp_path / "20250101-110000-proposed", load_profile(None), created_utc="2025-01-01T11:00:00+00:00")
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["seed", "tags", "run"]
    first = next(ln for ln in lines if ln.endswith("20250101-100000-proposed"))
    assert first.split()[-3:-1] == ["4", "base,wifi"]
    assert lines[lines.index(first) + 1] == "    overrides: --set deadline_s=5 --seed 4; note: morning"
    second = next(ln for ln in lines if ln.endswith("20250101-110000-proposed"))
    assert second.split()[-3:-1] == ["0", "-"]
    assert main(["runs", str(tmp_path), "--tag", "wifi", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [x["tags"] for x in listed] == [["base", "wifi"]] and listed[0]["overrides"][0] == "--set deadline_s=5"
    assert main(["runs", str(tmp_path), "--tag", "wifi", "--tag", "nope"]) == 0
    assert "no runs" in capsys.readouterr().out


# -- exports: the run's own columns -------------------------------------------------------------------------------

def test_exports_carry_policy_seed_tags_and_the_sweep_point(tmp_path, capsys):
    profile = load_profile(None, {"seed": 2, "policy": "all-dl"})
    run = write_run(tmp_path / "r", profile, tags=["x", "y"], sweep={"key": "devices", "value": 4})
    meta = json.loads((run / "meta.json").read_text())
    assert run_context(meta) == {"policy": "all-dl", "seed": 2, "tags": "x;y", "status": "complete",
                                 "sweep_key": "devices", "sweep_value": 4}
    rows = device_rows(synth_records(1), run="r", context=run_context(meta))
    assert list(rows[0])[:8] == ["run", "policy", "seed", "tags", "status", "sweep_key", "sweep_value", "round"]
    assert main(["report", str(run), "--csv", str(tmp_path / "t.csv")]) == 0
    with open(tmp_path / "t.csv") as fh:
        got = list(csv.DictReader(fh))
    assert (got[0]["policy"], got[0]["seed"], got[0]["tags"], got[0]["sweep_value"]) == ("all-dl", "2", "x;y", "4")


def test_campaign_results_carry_tags(tmp_path):
    from testbed.run.campaign import RESULT_FIELDS, parse_sweep, plan_campaign, result_row

    camp = plan_campaign(tmp_path / "c", load_profile(None, {"rounds": 3}), parse_sweep("deadline_s=5,6"),
                         ["proposed"], 1)
    run = camp.runs[0]
    write_run(run.run_dir, run.profile, tags=["t1", "t2"], sweep={"key": "deadline_s", "value": 5})
    row = result_row(camp, run)
    assert set(row) == set(RESULT_FIELDS)
    assert (row["key"], row["value"], row["policy"], row["seed"], row["tags"]) == ("deadline_s", 5, "proposed", 0,
                                                                                  "t1;t2")


# -- --quiet ------------------------------------------------------------------------------------------------

def test_quiet_drops_python_warnings(monkeypatch, capsys):
    for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(var, "")
    import logging

    level = logging.getLogger().level
    try:
        with warnings.catch_warnings():
            assert main(["run", "--quiet", "--print-config"]) == 0
            capsys.readouterr()
            warnings.warn("a library's warning", RuntimeWarning, stacklevel=1)
            np.log1p(np.array([1e308]) / np.array([1e-300]))  # numpy's overflow warning
        assert capsys.readouterr().err == ""
    finally:
        logging.getLogger().setLevel(level)


def test_a_fixed_dl_rate_far_above_the_band_plans_without_overflow():
    """`channel.measure_links` on a loopback link: measured rates of Gbit/s become fixed rates whose equivalent
    gains hit the optimizer's cap (1e300); ln(1 + R / sum 1/g) is then taken in log space, finite, and the
    plan has no RuntimeWarning (it printed through --quiet)."""
    from testbed.core.optimizer import plan
    from testbed.core.power import log1p_ratio
    from testbed.run.scenario_file import load_scenario

    assert log1p_ratio(1.0, 1e-300) == pytest.approx(np.log(1e300))
    assert log1p_ratio(np.array([3.0, 0.5]), np.array([1.5, 2.0])).tolist() == np.log1p([2.0, 0.25]).tolist()
    sc = load_scenario({"bits_per_prob": 16, "max_draft_len": 4, "vocab_size": 320, "uplink_bandwidth_hz": 2e6,
                        "downlink_bandwidth_hz": 3e6,  # 3 Gbit/s in 1.5 MHz: the equivalent gain hits the cap
                        "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.002, "acceptance": 0.6,
                                     "fixed_ul_rate_bps": 2e9, "fixed_dl_rate_bps": 3e9},
                                    {"name": "b", "distance_m": 250, "draft_time_s": 0.002, "acceptance": 0.7,
                                     "fixed_ul_rate_bps": 1e9, "fixed_dl_rate_bps": 2.5e9}]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for policy in ("proposed", "all-dl", "all-ul", "common-length"):
            ev = plan(sc, policy).evaluation
            assert np.isfinite(ev.round_time_s) and ev.round_time_s > 0 and ev.goodput_tps > 0


# -- live: a rerun at temperature 0 gives the same tokens --------------------------------------------------------

NEW_TOKENS = 24


@pytest.mark.live
def test_rerun_at_temperature_zero_gives_the_same_tokens(micro_pair, tmp_path):
    prof = tmp_path / "t0.yaml"
    # Each run plans its draft lengths on its own measured timings, so the rounds may end at other token
    # counts: both runs go to max_new_tokens, and the sequences must agree token for token up to it.
    prof.write_text(yaml.safe_dump(profile_data(micro_pair, rounds=200, max_new_tokens=NEW_TOKENS,
                                                sampling={"temperature": 0})))
    runs = tmp_path / "runs"

    def cli(*argv):
        out = subprocess.run([*CLI, *argv, "--quiet", "--no-plots"], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Warning" not in out.stderr, out.stderr
        return out

    cli("run", str(prof), "--runs-dir", str(runs), "--tag", "t0")
    first = next(runs.iterdir())
    cli("rerun", str(first), "--runs-dir", str(runs))
    second = next(p for p in runs.iterdir() if p != first)
    outputs = [json.loads((d / "outputs.json").read_text()) for d in (first, second)]
    ids = [{name: o["output_ids"] for name, o in out.items()} for out in outputs]
    assert all(len(v) >= NEW_TOKENS for run in ids for v in run.values())
    head = [{n: v[:NEW_TOKENS] for n, v in run.items()} for run in ids]
    assert head[0] == head[1]
    meta = json.loads((second / "meta.json").read_text())
    assert meta["rerun_of"] == str(first.resolve()) and meta["tags"] == ["t0"]
    assert meta["profile"] == json.loads((first / "meta.json").read_text())["profile"]
