"""`multispin simulate --set` and a campaign's sweep strings; the shared-uplink sweep keys; the figures of
docs/where-each-mode-wins.md (tools/make_mode_figures.py) on a tiny grid."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from testbed import PROFILES_DIR
from testbed.cli import main
from testbed.cli.simulate import parse_sweep
from testbed.core.simulate import SimulationError, point_scenario, run_sweep, summary_table
from testbed.run import campaign
from testbed.run.scenario_file import load_scenario

DEFAULT = PROFILES_DIR / "scenarios" / "default.yaml"
ROOT = Path(__file__).resolve().parents[2]


def _rows(out: Path) -> list[dict]:
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("text, key, values", [
    ("devices=2,4,8", "devices", [2, 4, 8]),
    ("dl_bandwidth=1e6, 2e6", "dl_bandwidth", [1e6, 2e6]),
    ("scenario.downlink_bandwidth_hz=1e6,2e6", "dl_bandwidth", [1e6, 2e6]),  # a campaign's dotted key
    ("scenario.ul_access=dedicated,fdma_shared", "ul_access", ["dedicated", "fdma_shared"]),
    ("ul_access=dedicated,fdma_shared", "ul_access", ["dedicated", "fdma_shared"]),
    ("uplink_total_bandwidth_hz=5e6,2e7", "uplink_total_bandwidth_hz", [5e6, 2e7]),
    ("scenario.uplink_total_bandwidth_hz=5e6", "uplink_total_bandwidth_hz", [5e6]),
    ("vocab_size=32000,151936", "vocab_size", [32000, 151936]),
    ("ul_bandwidth=5e5,1e6", "ul_bandwidth", [5e5, 1e6]),
    ("scenario.ul_min_share=0.05,0.2", "ul_min_share", [0.05, 0.2]),  # any scenario field
    ("drop.max_power_w=0.1,0.2", "drop.max_power_w", [0.1, 0.2]),
])
def test_a_campaign_sweep_string_reads_the_same_in_simulate(text, key, values):
    assert parse_sweep(text) == (key, values)


def test_the_new_keys_are_campaign_keys_too():
    assert campaign.parse_sweep("ul_access=dedicated,fdma_shared").path == "scenario.ul_access"
    assert campaign.parse_sweep("uplink_total_bandwidth_hz=5e6,2e7").values == (5e6, 2e7)
    with pytest.raises(campaign.CampaignError, match="not a number"):
        campaign.parse_sweep("uplink_total_bandwidth_hz=wide")


@pytest.mark.parametrize("text, message", [
    ("channel.base_latency_s=0,0.01", "run profile's key"),
    ("on_air_vocab_size=1000", "sweep vocab_size"),
    ("scenario.devices.d0.distance_m=50,100", "drawn per drop"),
    ("scenario.bandwidth=1,2", "allowed keys: devices, dl_bandwidth"),
    ("ul_min_share=wide", "not a number"),
    ("devices=2,2", "listed twice"),
])
def test_sweeps_simulate_cannot_run_are_refused(text, message):
    with pytest.raises(SimulationError, match=message):
        parse_sweep(text)


def test_shared_uplink_points():
    base = load_scenario(DEFAULT)
    shared = point_scenario(base, "ul_access", "fdma_shared", 0, 0)
    assert shared.ul_access == "fdma_shared" and base.ul_access == "dedicated"
    shared_base = base.model_copy(update={"ul_access": "fdma_shared"})
    sc = point_scenario(shared_base, "uplink_total_bandwidth_hz", 5e6, 0, 0)
    assert sc.uplink_total_bandwidth_hz == 5e6
    assert point_scenario(base, "drop.max_power_w", 0.1, 0, 0).devices[0].max_power_w == 0.1
    with pytest.raises(ValueError, match="fdma_shared"):  # a total band needs the shared uplink
        point_scenario(base, "uplink_total_bandwidth_hz", 5e6, 0, 0)
    rows = run_sweep(shared_base, "uplink_total_bandwidth_hz", [2e6, 2e8], drops=1,
                     policies=["proposed", "all-dl", "multispin-homogeneous"])
    by = {(r["value"], r["policy"]): r for r in rows}
    # a wider shared uplink helps the UL-mode baseline; the all-DL plan uploads token ids only
    assert by[2e8, "multispin-homogeneous"]["goodput_tps"] > 2 * by[2e6, "multispin-homogeneous"]["goodput_tps"]
    assert by[2e8, "all-dl"]["goodput_tps"] == pytest.approx(by[2e6, "all-dl"]["goodput_tps"], rel=1e-3)
    names = run_sweep(base, "ul_access", ["dedicated", "fdma_shared"], drops=1, policies=["proposed", "all-ul"])
    assert "fdma_shared" in summary_table(names)


def test_simulate_set_and_campaign_sweep(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", str(DEFAULT), "--set", "ul_access=fdma_shared", "--set", "scenario.drop.num_devices=3",
               "--sweep", "scenario.uplink_total_bandwidth_hz=2e6,2e7", "--drops", "1", "--jobs", "1",
               "--policies", "proposed,all-ul,multispin-heterogeneous", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = _rows(out)
    assert len(rows) == 2 * 3 and {r["num_devices"] for r in rows} == {"3"}
    assert {r["sweep_key"] for r in rows} == {"uplink_total_bandwidth_hz"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["scenario"]["ul_access"] == "fdma_shared"
    assert meta["set"] == ["ul_access=fdma_shared", "scenario.drop.num_devices=3"]
    assert meta["sweep"]["given"] == "scenario.uplink_total_bandwidth_hz=2e6,2e7"
    assert (out / "goodput_ul_share.png").stat().st_size > 5000
    capsys.readouterr()


def test_simulate_over_names_and_set_errors(tmp_path, capsys):
    out = tmp_path / "names"
    rc = main(["simulate", "--sweep", "ul_access=dedicated,fdma_shared", "--set", "drop.num_devices=2", "--drops",
               "1", "--jobs", "1", "--policies", "proposed,all-ul", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert [r["value"] for r in _rows(out)] == ["dedicated"] * 2 + ["fdma_shared"] * 2
    for name in ("goodput.png", "ul_devices.png", "goodput_ul_share.png"):
        assert (out / name).is_file()
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert main(["simulate", "--set", "ul_acess=fdma_shared", "--sweep", "devices=2", "--out", str(bad),
                 "--no-progress"]) == 2
    assert "did you mean ul_access" in capsys.readouterr().err
    # a total band on dedicated uplinks: the scenario's own message, before --out exists
    assert main(["simulate", "--sweep", "uplink_total_bandwidth_hz=1e6", "--out", str(bad), "--no-progress"]) == 2
    assert "fdma_shared" in capsys.readouterr().err and not bad.exists()


def test_the_mode_figures_script_on_a_tiny_grid(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_mode_figures", ROOT / "tools" / "make_mode_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path), "--quick", "--only", "mode_vs_vocab,mode_vs_ul_band"]) == 0
    for name in ("mode_vs_vocab", "mode_vs_ul_band"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
        assert (tmp_path / f"{name}.svg").read_text().lstrip().startswith("<?xml")
    tables = (tmp_path / "tables.md").read_text()
    assert "| vocab_size | proposed | all-ul | all-dl |" in tables and "multispin simulate" in tables
    capsys.readouterr()
