"""A run under fading gets an expected goodput over its channel model (issue 29, item 3): the mean planned
goodput over the channel's seeded draws (rounds 0..D-1 of the profile's channel state, each planned with the
run's policy), with its number of draws and standard error, in summary.json and the report.

Each value is checked against an independent computation from `multispin plan --channel-rounds` (the live
controller's plans of the same draws)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from support import synth_records

from testbed.analysis import report
from testbed.cli import main
from testbed.run.planning import add_expected_goodput, expected_goodput
from testbed.run.profile import load_profile
from testbed.runtime.records import RunRecorder

DRAWS = 12


def _channel_rounds(capsys, *sets: str, rounds: int = DRAWS) -> tuple[float, float]:
    """(mean, standard error) of the planned goodput of `plan --channel-rounds`, computed here."""
    argv = ["plan", "emulation", "--channel-rounds", str(rounds), "--json"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    g = np.array([r["goodput_tps"] for r in json.loads(capsys.readouterr().out)["rounds"]])
    return float(g.mean()), float(g.std(ddof=1) / math.sqrt(g.size))


def test_expected_goodput_is_the_mean_of_the_plans_over_the_seeded_draws(capsys):
    profile = load_profile("emulation")  # channel.state: model, fading: rayleigh; seed 0
    e = expected_goodput(profile, draws=DRAWS)
    mean, stderr = _channel_rounds(capsys)
    assert e["draws"] == DRAWS and e["estimates"] == "prior" and e["policy"] == "proposed"
    assert e["tps"] == pytest.approx(mean, rel=1e-12)
    assert e["stderr_tps"] == pytest.approx(stderr, rel=1e-9)
    # The draws are the profile's seeded channel: another seed, other draws.
    other = expected_goodput(load_profile("emulation", {"seed": 3}), draws=DRAWS)
    assert other["tps"] != e["tps"] and other["channel_seed"] == 3
    assert other["tps"] == pytest.approx(_channel_rounds(capsys, "seed=3")[0], rel=1e-12)
    # The run's policy plans every draw.
    dl = expected_goodput(load_profile("emulation", {"policy": "all-dl"}), draws=DRAWS)
    assert dl["policy"] == "all-dl"
    assert dl["tps"] == pytest.approx(_channel_rounds(capsys, "policy=all-dl")[0], rel=1e-12)


def test_expected_goodput_plans_with_the_runs_last_estimates(capsys):
    """With records, each device's last alpha and drafting time and the last t_0, t_1, T_0 and H replace the
    priors: the same as planning a profile whose priors are those numbers (edge-class hardware: no scale)."""
    est = {"dev0": (0.8, 0.002), "dev1": (0.7, 0.003), "dev2": (0.75, 0.004), "dev3": (0.6, 0.006)}
    rec = {"devices": {n: {"estimate": {"alpha": a, "draft_time_s": t}} for n, (a, t) in est.items()},
           "verify_model": {"t0_s": 0.004, "t1_s": 0.0003}, "round_overhead_s": 0.002, "header_bits": 2500.0}
    e = expected_goodput(load_profile("emulation"), [rec], draws=DRAWS)
    assert e["estimates"] == "last round"
    sets = [f"scenario.devices.{n}.{k}={v}" for n, (a, t) in est.items()
            for k, v in (("acceptance", a), ("draft_time_s", t))]
    sets += [f"hardware.{n}=edge-class" for n in est]
    sets += ["scenario.verify_t0_s=0.004", "scenario.verify_t1_s=0.0003", "scenario.round_overhead_s=0.002",
             "scenario.header_bits=2500"]
    assert e["tps"] == pytest.approx(_channel_rounds(capsys, *sets)[0], rel=1e-9)
    assert e["tps"] != pytest.approx(expected_goodput(load_profile("emulation"), draws=DRAWS)["tps"])


def test_no_expected_goodput_without_fading():
    for over in ({"channel.state.fading": "none"}, {"channel.state": None}):
        profile = load_profile("emulation", over)
        assert expected_goodput(profile, draws=4) is None
        summary = add_expected_goodput({"rounds": 3}, profile, [])
        assert "expected_goodput_tps" not in summary


def test_summary_and_report_carry_the_expected_goodput(tmp_path, capsys):
    profile = load_profile("emulation")
    records = synth_records(3)  # devices a, b: not the profile's; their estimates are left out
    summary = add_expected_goodput(report.summarize(records), profile, records, draws=DRAWS)
    exp = summary["expected_goodput"]
    assert summary["expected_goodput_tps"] == exp["tps"] and exp["draws"] == DRAWS
    assert exp["stderr_tps"] > 0 and exp["estimates"] == "last round"
    text = report.format_summary(summary)
    assert f"expected goodput over the fading channel: {exp['tps']:.2f} +- {exp['stderr_tps']:.2f} tok/s " \
           f"({DRAWS} draws" in text
    # `multispin report RUN_DIR` computes it from meta.json's profile snapshot (default draws: 200).
    run = tmp_path / "run"
    rec = RunRecorder(run)
    rec.write_meta(profile.snapshot(), status="running")
    for r in records:
        rec.append_round(r)
    rec.end_run("complete", "done", summary)
    rec.close()
    assert main(["report", str(run), "--json", "--no-plots"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["expected_goodput"]["draws"] == 200 and got["expected_goodput_tps"] > 0
    assert got["prediction_basis"]["rates"] == "model"


def test_a_failing_offline_plan_is_recorded_not_raised(monkeypatch):
    import testbed.run.planning as planning

    def boom(*a, **k):
        raise RuntimeError("plug-in failed")

    monkeypatch.setattr(planning, "expected_goodput", boom)
    s = add_expected_goodput({"rounds": 2}, load_profile("emulation"), [])
    assert s["expected_goodput_tps"] is None and "plug-in failed" in s["expected_goodput"]["error"]
    assert "not computed (RuntimeError: plug-in failed)" in report.format_summary(
        {**report.summarize(synth_records(2)), **{k: s[k] for k in ("expected_goodput_tps", "expected_goodput")}})


def test_the_expected_goodput_plans_top_k_on_the_runs_learnt_alpha_under_k():
    from edge_node.controller import Controller
    from testbed.core.scenario import Scenario
    from testbed.run.planning import last_estimates, with_estimates

    sc = Scenario.from_dict({"vocab_size": 4096, "topk_choices": [16, 64], "devices": [
        {"name": n, "distance_m": 100, "draft_time_s": 0.002, "acceptance": 0.6} for n in ("a", "b")]})
    est = {"a": {"alpha": 0.8, "draft_time_s": 0.002, "alpha_topk": {"16": 0.4, "64": 0.6}},
           "b": {"alpha": 0.7, "draft_time_s": 0.002, "alpha_topk": {"16": 0.28, "64": 0.56}}}
    records = [{"round": 0, "devices": {n: {"estimate": e} for n, e in est.items()}}]
    ctl = Controller(sc)
    with_estimates(ctl, last_estimates(records))
    for n, e in est.items():  # alpha under each k as the run learnt it; the dense alpha stays the learnt one
        assert ctl.alpha_topk(n, 16) == pytest.approx(e["alpha_topk"]["16"], abs=1e-6)
        assert ctl.alpha_topk(n, 64) == pytest.approx(e["alpha_topk"]["64"], abs=1e-6)
        assert ctl.alpha_dense(n) == pytest.approx(e["alpha"], abs=0.06)
