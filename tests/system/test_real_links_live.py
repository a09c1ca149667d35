"""Live runs (micro pair, real processes and sockets) with issue 10's pieces wired in: device link probes
feeding the edge's live channel state, and the shipped trace-replay profile following its traces."""

from __future__ import annotations

import time

import pytest

from testbed import PROFILES_DIR
from testbed.analysis.run_plots import write_run_plots
from testbed.channel.traces import load_mahimahi, load_throughput_csv
from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.plugins import channel_state_from_config
from testbed.runtime.records import load_run


def _model(pair) -> dict:
    return {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
            "tokenizer": str(pair.tokenizer)}


def test_probe_readings_reach_the_plan_and_a_stale_one_sits_its_device_out(micro_pair, tmp_path):
    """d0's probe (a command) is always fresh: its SNR is the gain planned with. d1's probe file holds a
    reading 100 s old: with `fallback: drop` d1 sits out, until the file gets a fresh reading, which its
    heartbeat carries to the edge while it idles."""
    stale = tmp_path / "d1.link"
    stale.write_text(f"snr_db=20.0\nt_wall={time.time() - 100:.3f}\n")
    profile = load_profile({
        "name": "probes", "rounds": 40, "seed": 3, "deadline_s": 5.0, "prompts": ["def f(x):", "import re"],
        "model": _model(micro_pair), "on_air_vocab_size": 4096, "wait_for_devices_s": 60,
        "channel": {"mode": "real", "state": {"source": "live", "noise_figure_db": 9.0,
                                              "live": {"max_age_s": 3.0, "fallback": "drop"}}},
        "link_probe": {"d0": "command:printf 'snr_db=12.5\\n'", "d1": f"file:{stale}"},
        "link_probe_period_s": 0.2,
        "scenario": {"bits_per_prob": 16, "max_draft_len": 6, "uplink_bandwidth_hz": 2e6,
                     "downlink_bandwidth_hz": 3e6, "downlink_power_w": 1.0, "noise_figure_db": 9.0,
                     "devices": [{"name": f"d{i}", "distance_m": 200, "draft_time_s": 0.001, "acceptance": 0.6}
                                 for i in range(2)]},
    })
    refreshed = {}

    def on_round(rec, server, launcher):
        if rec["round"] == 4:  # d1's probe now reads a fresh value (the file's time: now)
            stale.write_text("snr_db=20.0\n")
            refreshed["round"] = rec["round"]
        if rec["round"] >= 5:
            time.sleep(0.05)  # room for a heartbeat (1 s) within the remaining rounds

    run_dir = tmp_path / "run"
    run_live(profile, run_dir, progress=False, on_round=on_round)
    meta, records = load_run(run_dir)
    assert meta["status"] == "complete"
    # SNR -> gain as the run does it: the scenario's noise, and each device's power and UL bandwidth (2 MHz)
    state = channel_state_from_config(profile.channel.state, list(profile.scenario["devices"]),
                                      profile.scenario_obj())
    live_rounds = [r for r in records if (r["devices"].get("d0") or {}).get("live_used", {}).get("source") == "live"]
    assert len(live_rounds) >= len(records) - 3  # all but the first rounds, planned before any reading came
    for r in live_rounds:
        d0 = r["devices"]["d0"]
        assert d0["live_used"]["value"] == 12.5 and d0["live_used"]["age_s"] < 3.0
        assert "command:" in d0["live_used"]["probe"]
        assert d0["estimate"]["gain_db"] == pytest.approx(state.snr_to_gain_db("d0", 12.5))
    before = [r for r in records if r["round"] <= refreshed["round"]]
    assert before and all("d1" not in r["devices"] and r["sat_out"]["d1"]["live_used"]["source"] == "drop"
                          for r in before)
    back = [r for r in records if "d1" in r["devices"]]
    assert back, "d1 never came back after its probe read a fresh value"
    d1 = back[0]["devices"]["d1"]
    assert d1["live_used"]["source"] == "live" and d1["live_used"]["value"] == 20.0
    assert not back[0]["devices"]["d1"]["missed"]


def test_trace_replay_profile_follows_its_traces_on_the_micro_pair(micro_pair, tmp_path):
    profile = load_profile("trace-replay", {"model": _model(micro_pair), "rounds": 10, "on_air_vocab_size": 4096,
                                            "hardware": {}, "wait_for_devices_s": 60})
    run_dir = tmp_path / "run"
    run_live(profile, run_dir, progress=False)
    meta, records = load_run(run_dir)
    assert meta["status"] == "complete" and len(records) == 10
    traces = {"dev0": lambda t: load_mahimahi(PROFILES_DIR / "traces/example-ar1-6mbps.up").at_time(t, loop=True),
              "dev1": lambda t: load_throughput_csv(PROFILES_DIR / "traces/example-walk-30mbps.csv").at_time(t)}
    errors = []
    for rec in records:
        for name, rate_at in traces.items():
            d = rec["devices"][name]
            want = max(rate_at(rec["channel_t_s"]), 1e4)
            assert d["trace_rate_bps"]["ul"] == pytest.approx(want, rel=1e-9)
            assert d["predicted"]["ul_rate_bps"] == pytest.approx(want, rel=0.01)  # the plan knew it
            if not d["missed"]:
                got = d["ul_channel"]["rate_bps"]  # what the emulator charged the upload at
                errors.append(abs(got / want - 1))
                assert got == pytest.approx(want, rel=0.01), (rec["round"], name)
    assert len(errors) >= 15
    # The rates did change over the run: a trace, not a constant (how many values 10 rounds see depends on
    # how long they took: 2 on a fast run, more on a slow one).
    assert len({rec["devices"]["dev0"]["trace_rate_bps"]["ul"] for rec in records}) >= 2
    paths = write_run_plots(records, tmp_path / "plots", "trace-replay")
    assert all(p.stat().st_size > 0 for p in paths)
