"""Issue 10's pieces in the live testbed: device link probes -> reports -> the live channel state; rate traces ->
the emulator, the plan and the record; the edge's rate estimate of a real link. Unit checks first (no
processes), then short live runs on the micro pair."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from device_node.link_probe import LinkMeasurement
from device_node.node import link_reading
from edge_node.controller import Controller, DeviceOutcome, channel_links, round_record
from testbed import PROFILES_DIR
from testbed.channel.state import ChannelState
from testbed.channel.traces import load_mahimahi, load_throughput_csv
from testbed.core import model
from testbed.core.optimizer import plan
from testbed.core.scenario import Scenario
from testbed.run.profile import ProfileError, load_profile
from testbed.runtime.link_estimate import GROUP_RECENT, LinkEstimator, fit_line
from testbed.wire import messages as M

TRACES = PROFILES_DIR / "traces"


def _scenario(**dev_extra) -> Scenario:
    return Scenario.from_dict({
        "vocab_size": 4096, "max_draft_len": 6, "uplink_bandwidth_hz": 2e6, "downlink_bandwidth_hz": 2e6,
        "downlink_power_w": 1.0,
        "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.001, "acceptance": 0.6, **dev_extra},
                    {"name": "b", "distance_m": 300, "draft_time_s": 0.001, "acceptance": 0.6}]})


# --- device side: what a report carries -----------------------------------------------------------------

def test_link_reading_carries_the_age_not_the_clock_and_keeps_within_the_wire_bounds():
    now = time.time()
    m = LinkMeasurement(17.5, -60.0, -77.5, now - 2.0, "file:/x")
    link = link_reading(m, now)
    assert link == {"age_s": pytest.approx(2.0), "snr_db": 17.5, "signal_dbm": -60.0, "noise_dbm": -77.5,
                    "source": "file:/x"}
    assert "t_wall" not in link
    # An SNR the wire would refuse (and the edge with it the whole report) is left out and said.
    bad = link_reading(LinkMeasurement(250.0, None, None, now, "command:x" + "y" * 100), now)
    assert "snr_db" not in bad and "250" in bad["error"] and len(bad["source"]) == 64
    parsed = M.parse_report({"type": "report", "round": 0, "token": 1, "n_accepted": 0, "timings": {},
                             "dl_channel": None, "link": bad}, 10)
    assert parsed.link["error"] == bad["error"]


# --- the plan: fixed rates in the core model -------------------------------------------------------------

def _fixed(sc, rates: dict) -> object:
    return sc.with_device_updates({n: {"fixed_ul_rate_bps": r.get("ul"), "fixed_dl_rate_bps": r.get("dl")}
                                   for n, r in rates.items()})


@pytest.mark.parametrize("rate", [2e5, 6e6, 34.7e6])
def test_a_fixed_ul_rate_is_planned_as_it_is_at_full_power_whatever_the_gain(rate):
    sc = _fixed(_scenario(energy_budget_j=1e-4), {"a": {"ul": rate}})
    a = sc.devices[0]
    for policy in ("all-ul", "all-dl", "proposed"):
        d = {p.name: p for p in plan(sc, policy).device_plans()}["a"]
        # power control has no effect on a fixed rate: P^max, and the energy budget does not lower it
        assert d.ul_rate_bps == pytest.approx(rate, rel=1e-9) and d.ul_power_w == pytest.approx(a.max_power_w)
    # The gain is the device's own: its modeled DL rate is untouched by the fixed UL rate.
    free = {p.name: p for p in plan(_scenario(energy_budget_j=1e-4), "all-dl").device_plans()}["a"]
    assert {p.name: p for p in plan(sc, "all-dl").device_plans()}["a"].dl_rate_bps == pytest.approx(
        free.dl_rate_bps, rel=1e-9)


def test_fixed_dl_rates_are_planned_as_they_are_and_take_no_downlink_power():
    data = _scenario().model_dump(exclude_none=True)
    data["devices"].append({"name": "c", "distance_m": 200, "draft_time_s": 0.001, "acceptance": 0.7})
    base = Scenario.from_dict(data)
    sc = _fixed(base, {"a": {"dl": 8e6}, "b": {"ul": 3e6, "dl": 5e6}})
    for policy in ("all-dl", "all-dl-equal-power", "proposed", "all-ul"):
        ev = {p.name: p for p in plan(sc, policy).device_plans()}
        assert ev["b"].ul_rate_bps == pytest.approx(3e6, rel=1e-9)
        for name, rate in (("a", 8e6), ("b", 5e6)):
            if ev[name].mode == "DL":
                assert ev[name].dl_rate_bps == pytest.approx(rate, rel=1e-9)
    # A measured DL rate leaves the device's modeled UL rate as it was (one gain no longer serves both).
    free = {p.name: p for p in plan(base, "all-ul").device_plans()}["a"]
    assert {p.name: p for p in plan(sc, "all-ul").device_plans()}["a"].ul_rate_bps == pytest.approx(
        free.ul_rate_bps, rel=1e-9)
    # A fixed-rate device takes no DL power: the optimal split gives all of P_s to the others.
    ev = model.evaluate(sc, ["DL"] * sc.num_devices, [2] * sc.num_devices)
    fixed = np.isfinite(sc.fixed_rates_bps("dl"))
    assert np.all(ev.dl_power_w[fixed] == 0) and ev.dl_power_w[~fixed].sum() == pytest.approx(sc.downlink_power_w)


def test_the_optimizer_follows_fixed_rates_between_modes():
    # Uplink far faster than the downlink: UL mode; the other way round: DL mode (the plan is told the rates).
    sc = _scenario()
    fast_ul = _fixed(sc, {d.name: {"ul": 2e8, "dl": 1e5} for d in sc.devices})
    fast_dl = _fixed(sc, {d.name: {"ul": 1e5, "dl": 2e8} for d in sc.devices})
    assert set(plan(fast_ul, "proposed").modes) == {"UL"}
    assert set(plan(fast_dl, "proposed").modes) == {"DL"}


def _trace_controller(tmp_path) -> Controller:
    cfg = {"source": "trace", "trace": {"index": "round", "devices": {
        "a": {"ul": str(TRACES / "example-ar1-6mbps.up")},
        "b": {"ul": str(TRACES / "example-walk-30mbps.csv"), "dl": str(TRACES / "example-walk-30mbps.csv")}}}}
    sc = _scenario()
    state = ChannelState.from_config(cfg, [d.model_dump() for d in sc.devices])
    return Controller(sc, channel_state=state)


def test_trace_rates_reach_the_emulator_links_and_the_record(tmp_path):
    c = _trace_controller(tmp_path)
    up = load_mahimahi(TRACES / "example-ar1-6mbps.up")
    walk = load_throughput_csv(TRACES / "example-walk-30mbps.csv")
    for r in range(5):
        rp = c.plan_round(r, ["a", "b"], t_s=0.3 * r)
        links = channel_links(rp)
        assert rp.rate_source == "trace"
        assert links["a"]["ul_rate_bps"] == pytest.approx(up.at_index(r, loop=True))
        assert links["b"]["ul_rate_bps"] == pytest.approx(walk.at_index(r))
        assert links["b"]["dl_rate_bps"] == pytest.approx(walk.at_index(r))  # the trace, in either mode
        assert rp.per_device["a"].ul_rate_bps == pytest.approx(up.at_index(r, loop=True), rel=1e-6)
        charged = {"rate_bps": links["a"]["ul_rate_bps"], "bytes": 900, "airtime_s": 0.001, "held_s": 0.001,
                   "mode": "real"}
        out = DeviceOutcome(n_accepted=1, tokens=2, dl_payload="token", ul_channel=charged, ul_bytes=900,
                            dl_bytes=70, up_phase_s=0.01, t_verdict=0.0)
        rec = round_record(rp, policy="proposed", outcomes={"a": out}, verify_s=0.01, round_s=0.05, t_start_s=0.0)
        a = rec["devices"]["a"]
        assert a["trace_rate_bps"] == {"ul": up.at_index(r, loop=True), "dl": None}
        assert a["measured"]["ul_rate_bps"] == a["trace_rate_bps"]["ul"]
        assert rec["channel_t_s"] == pytest.approx(0.3 * r)


# --- the live channel state: readings, staleness, drop ----------------------------------------------------

def _live_controller(fallback: str) -> Controller:
    sc = _scenario()
    state = ChannelState.from_config({"source": "live", "noise_figure_db": 9.0,
                                      "live": {"max_age_s": 3.0, "fallback": fallback}},
                                     [d.model_dump() for d in sc.devices])
    return Controller(sc, channel_state=state)


def test_a_fresh_reading_is_the_gain_planned_with_and_recorded():
    c = _live_controller("model")
    c.channel_state.report_live("a", {"snr_db": 12.5, "age_s": 0.4, "source": "file:x"}, t_s=9.6)
    rp = c.plan_round(3, ["a", "b"], t_s=10.0)
    assert rp.live_used["a"]["source"] == "live" and rp.live_used["a"]["value"] == 12.5
    assert rp.live_used["a"]["age_s"] == pytest.approx(0.4)
    assert rp.estimates["a"]["gain_db"] == pytest.approx(c.channel_state.snr_to_gain_db("a", 12.5))
    assert rp.live_used["b"]["source"] == "model"  # no reading: the mean path loss
    rec = round_record(rp, policy="proposed", outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0)
    assert rec["devices"]["a"]["live_used"]["value"] == 12.5 and "sat_out" not in rec
    # Later, the same reading is stale: the fallback (model) is used and said.
    rp = c.plan_round(4, ["a", "b"], t_s=20.0)
    assert rp.live_used["a"]["source"] == "model" and rp.live_used["a"]["age_s"] == pytest.approx(10.4)


def test_fallback_drop_sits_the_device_out_instead_of_failing_the_plan():
    c = _live_controller("drop")
    c.channel_state.report_live("a", 15.0, t_s=0.0)
    rp = c.plan_round(0, ["a", "b"], t_s=1.0)
    assert rp.devices == ["a"] and rp.requested == ["a", "b"] and set(rp.per_device) == {"a"}
    assert "drop" in rp.sat_out["b"] and rp.live_used["b"]["source"] == "drop"
    rec = round_record(rp, policy="proposed", outcomes={}, verify_s=None, round_s=0.1, t_start_s=0.0)
    assert rec["sat_out"]["b"]["live_used"]["source"] == "drop" and list(rec["devices"]) == ["a"]
    # Nobody fresh: an empty plan, not an exception.
    rp = c.plan_round(1, ["a", "b"], t_s=100.0)
    assert rp.devices == [] and set(rp.sat_out) == {"a", "b"}


# --- profile --------------------------------------------------------------------------------------------

def test_profile_link_probe_and_measure_links_are_checked():
    base = load_profile("trace-replay").snapshot()
    with pytest.raises(ProfileError, match="link_probe.*nope"):
        load_profile({**base, "link_probe": {"nope": "file:/x"}})
    with pytest.raises(ProfileError, match="link_probe.dev0"):
        load_profile({**base, "link_probe": {"dev0": "wifi"}})
    assert load_profile({**base, "link_probe": {"dev0": "file:/tmp/x"}}).link_probe == {"dev0": "file:/tmp/x"}
    with pytest.raises(ProfileError, match="passthrough"):
        load_profile({**base, "channel": {"mode": "real", "measure_links": True}})


# --- the edge's estimate of a real link -------------------------------------------------------------------

def test_the_line_fit_recovers_a_rate_from_one_sided_noise_and_claims_none_on_a_fast_link():
    import random

    rng = random.Random(3)
    rate = 8e6
    sizes = [400, 420, 65_000, 130_000, 197_000, 262_000, 327_000, 393_000] * 4
    samples = [(s, 0.004 + 8 * s / rate + rng.expovariate(2000.0)) for s in sizes]
    fit = fit_line(samples)
    assert fit.rate_bps == pytest.approx(rate, rel=0.01) and fit.intercept_s == pytest.approx(0.004, abs=1e-3)
    # A shaper's burst (10 kB at line rate): the large messages alone give the rate, not the line through
    # them and the small ones.
    burst = [(s, 0.004 + 8 * max(0, s - 10_000) / rate + rng.expovariate(2000.0)) for s in sizes]
    assert fit_line(burst).rate_bps == pytest.approx(rate, rel=0.01)
    # A link far faster than these sizes resolve: the scatter hides the transfer, no rate is claimed.
    fast = [(s, 0.004 + 8 * s / 1e11 + rng.expovariate(500.0)) for s in sizes]
    assert fit_line(fast) is None
    assert fit_line([(400, 0.01), (410, 0.011), (405, 0.0105), (402, 0.0101)]) is None  # no spread of sizes
    assert fit_line(samples[:3]) is None  # too few messages
    est = LinkEstimator()
    entries = [est.observe("d", "ul", s, t) for s, t in samples]
    assert entries[0]["s"] is None and entries[-1]["s"] == pytest.approx(8 * sizes[-1] / rate, rel=0.2)
    assert est.rates("d")["ul"] == pytest.approx(rate, rel=0.01) and est.rates("d")["dl"] is None
    assert math.isfinite(entries[-1]["fit"]["resid_rms_s"])


def test_the_estimate_follows_a_link_whose_rate_changes():
    import random

    rng = random.Random(4)
    sizes = [400, 130_000, 262_000, 393_000]
    est = LinkEstimator(window=40)
    for rate in (20e6, 4e6, 20e6):  # a tbf limit lowered, then lifted, mid-run
        for k in range(GROUP_RECENT * 4):  # each size group sees GROUP_RECENT messages at the new rate
            s = sizes[k % 4]
            est.observe("d", "ul", s, 0.004 + 8 * s / rate + rng.expovariate(2000.0))
        assert est.rates("d")["ul"] == pytest.approx(rate, rel=0.05)


def test_a_direction_of_one_message_size_takes_its_intercept_from_the_other_directions_small_messages():
    # DL mode at one draft length: every verdict measured is one distribution (304 kB), every upload small.
    est = LinkEstimator()
    for k in range(6):
        est.observe("d", "ul", 344 + k, 0.004 + 8 * 344 / 30e6)
        est.observe("d", "dl", 304_005, 0.004 + 8 * 304_005 / 4e6 + 1e-4 * k)
    assert est.rates("d")["ul"] is None  # the uplink's small messages alone tell no rate
    assert est.rates("d")["dl"] == pytest.approx(4e6, rel=0.01)
    # ... nor do they next to smaller ones of the other direction (a token verdict): no anchor for them.
    est.observe("d", "dl", 72, 0.0006)
    est.observe("d", "ul", 344, 0.0035)
    assert est.rates("d")["ul"] is None


@pytest.mark.live
def test_a_bad_link_probe_spec_stops_the_device_at_start_saying_why(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "device_node.node", "--connect", f"ipc://{tmp_path}/nobody",
                          "--name", "d0", "--draft", str(tmp_path / "missing.onnx"), "--link-probe", "wifi",
                          "--register-timeout", "0.2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "link probe 'wifi' is invalid" in out.stderr
    out = subprocess.run([sys.executable, "-m", "device_node.node", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert "--link-probe SPEC" in out.stdout and "--link-probe-period-s" in out.stdout
