"""The offline simulator and the plan/simulate commands."""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from testbed import PROFILES_DIR
from testbed.cli import main
from testbed.cli.simulate import parse_sweep
from testbed.core import model
from testbed.core.simulate import SimulationError, monte_carlo, point_scenario, run_sweep, summary_table
from testbed.run.scenario_file import load_scenario

PROFILES = PROFILES_DIR / "scenarios"


def test_parse_sweep_and_unknown_key():
    assert parse_sweep("devices=5,10") == ("devices", [5, 10])
    assert parse_sweep("dl_bandwidth=1e6, 2e7") == ("dl_bandwidth", [1e6, 2e7])
    with pytest.raises(SimulationError, match="'bandwidth' is not allowed; allowed keys: devices, dl_bandwidth"):
        parse_sweep("bandwidth=1,2")
    with pytest.raises(SimulationError, match="must be an integer"):
        parse_sweep("devices=2.5")
    with pytest.raises(SimulationError, match="not a number"):
        parse_sweep("dl_power=ten")


def test_point_scenarios_nest_and_map_fields():
    base = load_scenario(PROFILES / "default.yaml")
    small = point_scenario(base, "devices", 5, drop_index=1, seed=0)
    large = point_scenario(base, "devices", 12, drop_index=1, seed=0)
    assert large.devices[:5] == small.devices
    assert point_scenario(base, "dl_power", 2.5, 0, 0).downlink_power_w == 2.5
    acc = point_scenario(base, "acceptance", 0.9, 0, 0)
    assert {d.acceptance for d in acc.devices} == {0.9}
    other = point_scenario(base, "devices", 5, drop_index=2, seed=0)
    assert other.devices != small.devices


def test_monte_carlo_agrees_with_the_analytic_value():
    # All-UL eager: the round time does not depend on the outcome, so MC goodput -> E[tokens] / T.
    sc = load_scenario(PROFILES / "example-two-devices.yaml")
    ev = model.evaluate(sc, ["UL", "UL"], [3, 5])
    mc = monte_carlo(sc, ev, 4000, np.random.default_rng(0))
    assert mc["mc_round_time_s"] == pytest.approx(ev.round_time_s)
    # 4.5 standard errors: false alarm < 1e-5
    assert abs(mc["mc_goodput_tps"] - ev.goodput_tps) < 4.5 * mc["mc_goodput_sem"]
    # All-DL worst case: a realized round is never longer than planned.
    ev = model.evaluate(sc, ["DL", "DL"], [3, 5])
    mc = monte_carlo(sc, ev, 500, np.random.default_rng(1))
    assert mc["mc_round_time_s"] <= ev.round_time_s * (1 + 1e-12)


def test_run_sweep_rows_and_summary():
    base = load_scenario(PROFILES / "default.yaml")
    rows = run_sweep(base, "dl_bandwidth", [2e6, 2e7], drops=2, policies=["proposed", "all-dl", "all-ul"],
                     monte_carlo_rounds=10)
    assert len(rows) == 2 * 2 * 3
    assert {"sweep_key", "value", "drop", "policy", "goodput_tps", "round_time_s", "num_ul_devices",
            "phase_uplink_s", "phase_verify_s", "phase_downlink_s", "mc_goodput_tps"} <= set(rows[0])
    for r in rows:
        assert r["round_time_s"] == pytest.approx(r["phase_uplink_s"] + r["phase_verify_s"] + r["phase_downlink_s"])
    table = summary_table(rows)
    assert "proposed" in table and "prop/best" in table and "Monte Carlo" in table
    with pytest.raises(SimulationError, match="unknown policy"):
        run_sweep(base, "devices", [2], policies=["nope"])


def test_simulate_command_writes_csv_and_plots(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", str(PROFILES / "default.yaml"), "--sweep", "devices=2,4", "--drops", "2",
               "--policies", "proposed,all-dl,all-ul", "--monte-carlo", "--rounds", "20", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 3 and {r["policy"] for r in rows} == {"proposed", "all-dl", "all-ul"}
    for name in ("goodput.png", "ul_devices.png", "monte_carlo.png"):
        assert (out / name).stat().st_size > 5000
    assert "mean goodput" in capsys.readouterr().out


def test_simulate_plots_show_spread_as_side_by_side_error_bars(tmp_path, monkeypatch):
    """goodput.png and ul_devices.png: one error-bar series per policy (min to max over the drops), set
    side by side around each swept value, and no shaded min-max bands (they overlapped into one mass)."""
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer
    from matplotlib.figure import Figure

    from testbed.analysis.sim_plots import plot_sweep

    figs = {}
    save = Figure.savefig

    def keep(self, path, *a, **kw):
        figs[Path(path).name] = self
        return save(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    policies = ["proposed", "all-dl", "all-ul", "common-length"]
    base = load_scenario(PROFILES / "default.yaml")
    rows = run_sweep(base, "devices", [3, 6], drops=3, policies=policies, seed=1)
    plot_sweep(rows, tmp_path)
    for name, shown in (("goodput.png", policies), ("ul_devices.png", ["proposed", "common-length"])):
        ax = figs[name].axes[0]
        assert not [c for c in ax.collections if isinstance(c, PolyCollection)], name
        bars = {c.get_label(): c for c in ax.containers if isinstance(c, ErrorbarContainer)}
        assert list(bars) == shown, name
        xs = [tuple(c.lines[0].get_xdata()) for c in bars.values()]
        assert len(set(xs)) == len(xs)  # each policy at its own x
        for x in zip(*xs):  # ... near the swept value, within a quarter of the gap
            assert max(x) - min(x) < 0.25 * 3 and min(x) < round(np.mean(x)) < max(x)
        for policy, c in bars.items():  # bars from the lowest to the highest drop
            metric = "goodput_tps" if name == "goodput.png" else "num_ul_devices"
            got = {}
            for r in rows:
                if r["policy"] == policy:
                    got.setdefault(r["value"], []).append(r[metric])
            (segments,) = c.lines[2]
            spans = np.array([(seg[0][1], seg[1][1]) for seg in segments.get_segments()])
            want = np.array([(min(got[v]), max(got[v])) for v in sorted(got)])
            assert spans.ravel() == pytest.approx(want.ravel()), (name, policy)
        assert "bars: min to max" in ax.get_title()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["3", "6"]


def test_simulate_command_bad_key_is_a_user_error(tmp_path, capsys):
    rc = main(["simulate", "--sweep", "speed=1,2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "speed" in err and "allowed keys" in err


def test_plan_command_json_is_one_object(capsys):
    rc = main(["plan", str(PROFILES / "example-two-devices.yaml"), "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    d = json.loads(out)  # exactly one JSON document
    assert {"policy", "goodput_tps", "round_time_s", "phases_s", "devices"} <= set(d)
    assert set(d["phases_s"]) == {"uplink", "verify", "downlink"}
    for dev in d["devices"]:
        assert {"name", "mode", "draft_len", "ul_power_w", "dl_power_w", "expected_tokens", "goodput_tps",
                "uplink_phase_s", "dl_air_s"} <= set(dev)
    assert d["goodput_tps"] == pytest.approx(sum(x["goodput_tps"] for x in d["devices"]))
    assert math.isclose(d["round_time_s"], sum(d["phases_s"].values()))


def test_plan_command_table_and_errors(tmp_path, capsys):
    assert main(["plan", str(PROFILES / "example-two-devices.yaml"), "--policy", "all-ul"]) == 0
    out = capsys.readouterr().out
    assert "policy all-ul" in out and "d0" in out and "UL" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  - {name: a, distance_m: 100, draft_time_s: 0.03, acceptance: 1.3}\n")
    assert main(["plan", str(bad)]) == 2
    assert "devices[0].acceptance: 1.3 is not allowed: must be in (0, 1)" in capsys.readouterr().err
    assert main(["plan", str(PROFILES / "example-two-devices.yaml"), "--policy", "nope"]) == 2
    assert "allowed: proposed" in capsys.readouterr().err
