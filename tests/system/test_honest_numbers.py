"""Issue 14, the numbers: one time base in every channel mode, one phase vocabulary, named summary metrics,
and a channel validation that means what it prints.

The live test runs real processes (micro pair); the others are pure or use one emulator process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from support import ROOT

from channel_emulator import validate
from edge_node.controller import (
    PHASE_FIELDS,
    Arrival,
    Controller,
    DeviceOutcome,
    air_excess,
    round_record,
    virtual_round,
)
from testbed.analysis import report
from testbed.analysis.phases import PHASES
from testbed.core.vocabulary import LEGACY_DEVICE_FIELDS
from testbed.run.scenario_file import load_scenario
from testbed.wire.protocol import decode_header, encode_header

SCEN = {"vocab_size": 1000, "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.02, "acceptance": 0.7},
                                        {"name": "b", "distance_m": 300, "draft_time_s": 0.02, "acceptance": 0.6}]}


# -- 1. the virtual time base -------------------------------------------------------------------------

def _slow_channel_profile(pair, mode: str, rounds: int = 10):
    """Three DL-mode devices, L = 4, static gains: every air time is 60-100 ms (a ~400-byte upload at a
    few kbit/s, an 8 kB distribution on a 0.25 MHz downlink), against a few ms of compute (so that a few ms
    of scheduling noise on a shared host stay well inside the 5%)."""
    from testbed.run.profile import load_profile

    return load_profile({
        "name": "air-dominated", "rounds": rounds, "seed": 3, "deadline_s": 5.0,
        "prompts": ["def parse(text):", "import os", "class Node:"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer), "threads": 1},
        "channel": {"mode": mode}, "on_air_vocab_size": 4096, "wait_for_devices_s": 60,
        "pin": {"mode": "DL", "draft_len": 4},
        "scenario": {"bits_per_prob": 16, "max_draft_len": 6, "uplink_bandwidth_hz": 2.5e3,
                     "downlink_bandwidth_hz": 0.25e6, "downlink_power_w": 1.0,
                     "devices": [{"name": f"d{i}", "channel_gain_db": -112.0 - 3 * i, "draft_time_s": 0.001,
                                  "acceptance": 0.6} for i in range(3)]}})


def test_virtual_and_real_mode_give_the_same_phase_times(micro_pair, tmp_path):
    from testbed.run.live import run_live
    from testbed.runtime.records import load_run

    runs = {}
    for mode in ("virtual", "real"):
        run_live(_slow_channel_profile(micro_pair, mode), tmp_path / mode, progress=False)
        runs[mode] = load_run(tmp_path / mode)[1]
    virt, real = runs["virtual"], runs["real"]
    assert len(virt) == len(real) == 10
    assert {r["time_base"] for r in virt} == {"virtual"} and {r["time_base"] for r in real} == {"wall"}
    airs = []  # (virtual, real) air time of each upload
    for rv, rr in zip(virt, real):  # the same seeds: the same schedules, rates and outcomes
        for name in ("d0", "d1", "d2"):
            dv, dr = rv["devices"][name], rr["devices"][name]
            assert dv["n_accepted"] == dr["n_accepted"]
            assert dv["predicted"]["ul_rate_bps"] == pytest.approx(dr["predicted"]["ul_rate_bps"])
            airs.append((dv["measured"]["ul_air_s"], dr["measured"]["ul_air_s"]))
        # Virtual: the round took far less wall time than its virtual time (nothing was held).
        assert rv["measured"]["wall_round_s"] < rv["measured"]["round_s"]
        assert rv["measured"]["goodput_tps"] == pytest.approx(rv["measured"]["tokens"] / rv["measured"]["round_s"])
    # A real-mode air time is the emulator's hold (air + queueing + base latency + its lateness): never
    # shorter than the virtual one, and longer only when the shared host woke the emulator late, now and
    # then (one upload of 30 by 8 ms, seen once in a full test run); a wrong rate would move them all.
    assert not [(v, r) for v, r in airs if r < 0.95 * v - 1e-3], airs
    assert len([(v, r) for v, r in airs if r > 1.05 * v + 1e-3]) <= len(airs) // 10, airs
    assert float(np.median([r / v for v, r in airs])) == pytest.approx(1.0, abs=0.05)
    air = np.median([d["measured"]["ul_air_s"] for r in real for d in r["devices"].values()])
    assert 0.02 < air < 0.12  # the channel this test is about: air time dominates
    misses = _phase_misses(virt, real)
    if misses:
        # One more pair of runs before failing: the measured compute of one run can be stretched by another
        # process on a shared 2-core host (seen in 2 of 14 runs); a real disagreement fails both pairs.
        for mode in ("virtual", "real"):
            run_live(_slow_channel_profile(micro_pair, mode), tmp_path / f"{mode}-again", progress=False)
            runs[mode] = load_run(tmp_path / f"{mode}-again")[1]
        misses = _phase_misses(runs["virtual"], runs["real"])
    assert not misses, misses


def _phase_misses(virt: list[dict], real: list[dict]) -> list[tuple]:
    """(phase, virtual median, real median) for each phase whose medians differ by more than 5%."""
    out = []
    for key in ("uplink_phase_s", "downlink_phase_s", "round_s"):
        mv = float(np.median([r["measured"][key] for r in virt]))
        mr = float(np.median([r["measured"][key] for r in real]))
        if mv != pytest.approx(mr, rel=0.05):
            out.append((key, mv, mr))
    return out


def test_virtual_round_inserts_air_time_where_the_messages_were():
    # Edge busy until 20 ms; a draft sent at 5 ms with 60 ms of air arrives at 65 ms; the other one arrived
    # after the edge was free (exact stamp, 30 ms) with 10 ms of air: 40 ms.
    drafts = {"a": Arrival(at_s=0.020, waited=True, earliest_s=0.005, air_s=0.060),
              "b": Arrival(at_s=0.030, waited=False, earliest_s=0.004, air_s=0.010)}
    reports = {"a": Arrival(at_s=0.040, waited=False, earliest_s=0.039, air_s=0.050),
               "b": Arrival(at_s=0.036, waited=True, earliest_s=0.035, air_s=0.001)}
    v = virtual_round(drafts, reports, drafts_from_s=0.020, drafts_closed_s=0.031, reports_from_s=0.037,
                      end_s=0.041, all_drafts=True, all_reports=True)
    assert v["up_phase_s"] == pytest.approx({"a": 0.065, "b": 0.040})
    assert v["uplink_phase_s"] == pytest.approx(0.065)
    # Drafting closed 1 ms after the last stamp (handling): 66 ms virtual, 31 ms real -> shift 35 ms; the
    # last report: 40 + 50 ms air = 90 ms, +1 ms handling, + the shift.
    assert v["round_s"] == pytest.approx(0.035 + 0.090 + 0.001)
    # A device that never drafted: the round waited until the (wall-clock) deadline.
    v = virtual_round({"b": drafts["b"]}, {}, drafts_from_s=0.02, drafts_closed_s=5.0, reports_from_s=None,
                      end_s=5.01, all_drafts=False, all_reports=False)
    assert v["round_s"] == pytest.approx(5.01)


def test_virtual_round_takes_out_a_shared_hosts_wait_and_queues_the_edges_handling():
    # Three devices of one host process drafted one after the other: on the edge clock their drafts came at
    # 10, 20 and 30 ms, of which 0, 10 and 20 ms were each one's wait for the others (host_wait_s). With hosts
    # of their own all three arrive at 10 ms (+ 1 ms of air); the edge handles them one at a time, 2 ms
    # each: done at 11 + 3 x 2 = 17 ms instead of the edge clock's 32 ms.
    drafts = {n: Arrival(at_s=at, waited=False, earliest_s=0.0, air_s=0.001, host_wait_s=hw, handled_s=0.002)
              for n, at, hw in (("a", 0.010, 0.0), ("b", 0.020, 0.010), ("c", 0.030, 0.020))}
    v = virtual_round(drafts, {}, drafts_from_s=0.001, drafts_closed_s=0.032, reports_from_s=None,
                      end_s=0.050, all_drafts=True, all_reports=False)
    assert v["up_phase_s"] == pytest.approx({"a": 0.011, "b": 0.011, "c": 0.011})
    assert v["round_s"] == pytest.approx(0.050 + (0.017 - 0.032))
    # No host waits: the edge clock's own spacing, so handling never queues and nothing moves but the air.
    plain = {n: Arrival(a.at_s, False, 0.0, 0.001, handled_s=0.002) for n, a in drafts.items()}
    v = virtual_round(plain, {}, drafts_from_s=0.001, drafts_closed_s=0.032, reports_from_s=None, end_s=0.050,
                      all_drafts=True, all_reports=False)
    assert v["uplink_phase_s"] == pytest.approx(0.031) and v["round_s"] == pytest.approx(0.051)
    # A report's host wait comes off its arrival too (0.045 - 0.015 + 0.002 of air, after the 1 ms shift).
    reports = {"a": Arrival(at_s=0.045, waited=False, earliest_s=0.0, air_s=0.002, host_wait_s=0.015)}
    v = virtual_round(plain, reports, drafts_from_s=0.001, drafts_closed_s=0.032, reports_from_s=0.030,
                      end_s=0.046, all_drafts=True, all_reports=True)
    assert v["round_s"] == pytest.approx(0.001 + (0.045 - 0.015 + 0.002) + 0.001)


def test_a_hosted_devices_late_stamp_is_an_upper_bound_of_its_arrival():
    # A device with a process of its own: its stamp is when it sent (30 ms after its 20 ms of drafting).
    # Devices sharing a process also share the machine with the other hosts: the system ran them late,
    # which none of them measures. Their stamps are upper bounds; each is placed at its own drafting time
    # plus the least transport any hosted device showed (this round so far, then the last 20 rounds).
    from edge_node.virtual_clock import VirtualClock

    clock = VirtualClock()
    arrival = lambda *a, **k: clock.arrival(("draft", "UL"), *a, **k)
    own = arrival(0.050, False, 0.020, 0.001)
    assert own.sent_at_s() == pytest.approx(0.050)
    least: dict = {}
    first = arrival(0.021, False, 0.020, 0.001, 0.0, least=least)  # the least hosted transport: 1 ms
    late = arrival(0.500, False, 0.030, 0.001, 0.100, least=least)  # 100 ms of it waiting for its host
    assert first.sent_at_s() == pytest.approx(0.021) and late.sent_at_s() == pytest.approx(0.031)
    assert least == {("draft", "UL"): pytest.approx(0.001)}
    # Own-process devices keep their own estimate (the median of theirs, 30 ms), untouched by hosted ones.
    assert arrival(0.2, True, 0.010, 0.001).sent_at_s() == pytest.approx(0.040)
    # The next round: the least of the last rounds places a device whose every stamp came late.
    clock.remember_least(least)
    nxt = arrival(0.400, False, 0.025, 0.001, 0.0, least={})
    assert nxt.sent_at_s() == pytest.approx(0.026)


def test_virtual_queues_restart_at_every_configure(tmp_path):
    from support import Bench

    b = Bench(tmp_path, mode="virtual")
    try:
        d = b.device("dev-v")
        payload = np.zeros(50_000, np.uint8)  # 0.4 s at 1 Mbit/s
        for r in range(3):
            b.control.configure(round=r, links={"dev-v": {"ul_rate_bps": 1e6}})
            queued = []
            for _ in range(2):
                d.send_multipart([encode_header({"type": "draft", "air": "ul"}), payload])
                _, h, _ = b.edge.recv_multipart()
                queued.append(decode_header(h)["channel"]["queued_s"])
            # Within a round the second message queues behind the first; across rounds nothing piles up.
            assert queued[0] == pytest.approx(0.0, abs=0.05) and 0.3 < queued[1] < 0.5, (r, queued)
    finally:
        b.close()


# -- 2. one vocabulary ----------------------------------------------------------------------------------

def _outcome(rp, name, *, payload="p", channel_mode="real"):
    d = rp.per_device[name]
    return DeviceOutcome(
        n_accepted=1, tokens=2, dl_payload=payload, ul_bytes=10, dl_bytes=73, up_phase_s=d.uplink_s * 1.1,
        t_verdict=0.0, timings={"draft_s": d.draft_s},
        ul_channel={"mode": channel_mode, "held_s": d.tx_s + 0.001, "airtime_s": d.tx_s, "queued_s": 0.0,
                    "base_latency_s": 0.0, "lead_s": 0.0, "bytes": int(d.ul_bits / 8) + 40},
        dl_channel={"mode": channel_mode, "held_s": d.downlink_s, "airtime_s": d.downlink_s, "queued_s": 0.0,
                    "base_latency_s": 0.0, "bytes": 73})


def test_record_carries_the_vocabulary_and_the_old_names_beside_it():
    c = Controller(load_scenario(SCEN), pin_mode="DL", pin_draft_len=3)
    rp = c.plan_round(0, ["a", "b"])
    rec = round_record(rp, policy="p", outcomes={n: _outcome(rp, n) for n in ("a", "b")}, verify_s=0.01,
                       round_s=0.2, t_start_s=0.0)
    assert rec["time_base"] == "wall" and rec["measured"]["wall_round_s"] == 0.2
    assert rec["dl_provisioning"] == "worst_case" and rec["header_bits"] == rp.scenario.header_bits
    d, plan = rec["devices"]["a"], rp.per_device["a"]
    # Predicted: the names mean what the plan's own fields mean (uplink_phase_s is drafting + air time).
    assert d["predicted"]["ul_air_s"] == plan.tx_s and d["predicted"]["uplink_phase_s"] == plan.uplink_s
    assert d["predicted"]["uplink_phase_s"] == pytest.approx(d["predicted"]["draft_s"] + d["predicted"]["ul_air_s"])
    assert d["predicted"]["dl_air_s"] == plan.downlink_s
    for side in ("predicted", "measured"):  # one name per quantity: the old names are read, never written
        assert not set(LEGACY_DEVICE_FIELDS.values()) & set(d[side]), side
    m = d["measured"]
    assert m["ul_air_s"] == pytest.approx(plan.tx_s + 0.001)
    assert m["ul_air_excess_s"] == pytest.approx(0.001)  # held beyond the modeled air time
    assert m["ul_unmodeled_bits"] == pytest.approx(8 * (int(plan.ul_bits / 8) + 40) - plan.ul_bits)
    assert set(PHASE_FIELDS) >= {"draft_s", "ul_air_s", "uplink_phase_s", "verify_s", "dl_air_s", "round_s"}


def test_virtual_record_uses_the_virtual_round():
    c = Controller(load_scenario(SCEN))
    rp = c.plan_round(0, ["a", "b"])
    outcomes = {n: _outcome(rp, n, channel_mode="virtual") for n in ("a", "b")}
    virtual = {"up_phase_s": {"a": 0.5, "b": 0.4}, "uplink_phase_s": 0.5, "round_s": 0.8}
    rec = round_record(rp, policy="p", outcomes=outcomes, verify_s=0.01, round_s=0.05, t_start_s=0.0,
                       virtual=virtual)
    assert rec["time_base"] == "virtual"
    assert rec["measured"]["round_s"] == 0.8 and rec["measured"]["wall_round_s"] == 0.05
    assert rec["measured"]["uplink_phase_s"] == 0.5 and rec["measured"]["goodput_tps"] == pytest.approx(4 / 0.8)
    assert rec["devices"]["b"]["measured"]["uplink_phase_s"] == 0.4
    assert rec["devices"]["b"]["measured"]["wall_uplink_phase_s"] == pytest.approx(outcomes["b"].up_phase_s)
    assert air_excess(outcomes["a"].ul_channel) == 0.0


def _multispin(*args):
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_plan_json_and_table_use_the_record_names_with_units():
    scen = str(ROOT / "profiles" / "scenarios" / "example-two-devices.yaml")
    out = _multispin("plan", scen, "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["round_s"] == d["round_time_s"] and d["uplink_phase_s"] == d["phases_s"]["uplink"]
    assert d["verify_s"] == d["phases_s"]["verify"] and d["downlink_phase_s"] == d["phases_s"]["downlink"]
    for x in d["devices"]:
        # one vocabulary: the core's names (uplink_s = draft + air there, air only in records) are not shown
        assert not {"tx_s", "uplink_s", "downlink_s"} & set(x) and x["dl_air_s"] >= 0
        assert x["uplink_phase_s"] == pytest.approx(x["draft_s"] + x["ul_air_s"])
    table = _multispin("plan", scen)
    assert table.returncode == 0, table.stderr
    head, units = table.stdout.splitlines()[1:3]
    for name in ("draft_s", "ul_air_s", "uplink_phase_s", "dl_air_s", "goodput"):
        assert name in head
    assert "uplink ms" not in head and "[ms]" in units and "[tok/s]" in units and "[Mbit/s]" in units
    # The air-time column shows the 10 us air time, not the drafting time again.
    row = table.stdout.splitlines()[3].split()
    assert row[0] == "d0" and float(row[5]) == pytest.approx(1e3 * d["devices"][0]["draft_s"], rel=1e-3)
    assert float(row[6]) == pytest.approx(1e3 * d["devices"][0]["ul_air_s"], rel=1e-3)


# -- 3. summary names -----------------------------------------------------------------------------------

def _records(n=4):
    c = Controller(load_scenario(SCEN), pin_mode="DL", pin_draft_len=3)
    recs = []
    for r in range(n):
        rp = c.plan_round(r, ["a", "b"])
        outcomes = {"a": _outcome(rp, "a", payload="token"), "b": _outcome(rp, "b", payload="p")}
        recs.append(round_record(rp, policy="p", outcomes=outcomes, verify_s=0.01,
                                 round_s=0.1 * (r + 1), t_start_s=float(r)))
    return recs


def test_summary_names_both_goodputs_and_explains_its_columns():
    recs = _records()
    s = report.summarize(recs)
    tokens, time_s = 16, 0.1 + 0.2 + 0.3 + 0.4
    assert s["goodput_run_tps"]["measured"] == pytest.approx(tokens / time_s)
    assert s["goodput_mean_round_tps"]["measured"] == pytest.approx(np.mean([4 / (0.1 * k) for k in range(1, 5)]))
    assert s["goodput_measured_tps"] == s["goodput_run_tps"]["measured"]  # the earlier key, for one release
    dev = s["devices"]["a"]
    assert dev["acceptance_rate"] == pytest.approx(1 / 2) and dev["accepted_per_drafted"] == pytest.approx(1 / 3)
    assert set(s["phase_errors"]) == set(PHASES)
    assert s["phase_errors"]["dl_air_s[DL mode, p]"]["n"] == 4  # only b's verdicts carried p
    assert s["dl_mode_verdicts"] == {"with_distribution": 4, "with_token": 4, "token_bytes_median": 73.0,
                                     "provisioned_bits_median": pytest.approx(s["dl_mode_verdicts"]
                                                                              ["provisioned_bits_median"])}
    assert s["time_base"] == "wall" and s["dl_provisioning"] == ["worst_case"]
    text = report.format_summary(s)
    for fragment in ("goodput: measured", "goodput_run_tps", "goodput_mean_round_tps", "alpha: acceptance rate",
                     "acc/drft", "|diff|: |measured - predicted|", "unit", "dl_provisioning worst_case",
                     "73 bytes", "ul_unmodeled_bits", "DL-mode uploads on the wire"):
        assert fragment in text, fragment


def test_summary_reads_records_of_the_previous_release():
    recs = _records(2)
    for rec in recs:  # as written before this release: the old names only, no time base
        rec.pop("time_base")
        for d in rec["devices"].values():
            for side in ("predicted", "measured"):
                for new, old in LEGACY_DEVICE_FIELDS.items():
                    d[side][old] = d[side].pop(new)
    s = report.summarize(recs)
    assert s["phase_errors"]["ul_air_s[DL mode]"]["n"] == 4 and s["time_base"] == "wall"


# -- the header estimate --------------------------------------------------------------------------------

def test_header_prior_and_dl_mode_fit():
    from edge_node.server import draft_header_bits

    scen = load_scenario({**SCEN, "vocab_size": 4096, "max_draft_len": 6})
    h = draft_header_bits(scen, 16, None)
    assert 1500 < h < 5000  # a JSON header of a few hundred bytes
    c = Controller(scen)
    c.seed_header_bits(h)
    assert c.header_bits == h and c.scenario_for(["a"], c.static_gains).header_bits == h
    # UL-mode uploads say 2,000 bits; once 3 DL-mode uploads say 3,000, those win.
    for _ in range(5):
        c.observe_upload(1000, 8000.0 - 2000.0, 0.0, mode="UL")
    assert c.header_bits == pytest.approx(2000.0)
    for _ in range(3):
        c.observe_upload(100, 800.0 - 3000.0 + 0.0, 0.0, mode="DL")
    assert c.header_bits == pytest.approx(3000.0)
    c.seed_header_bits(9999.0)  # a fit is never replaced by the prior
    assert c.header_bits == pytest.approx(3000.0)


# -- 4. channel validate --------------------------------------------------------------------------------

def test_validate_virtual_compares_the_annotated_air_time():
    cells, lead = validate.run_validation(sizes=[1000, 20_000], rates=[1e6], repeats=2, mode="virtual")
    assert lead == {"lead_s": 0.0, "lead_per_byte_s": 0.0}
    for c in cells:
        s = c.summary()
        assert s["annotated_median_s"] == pytest.approx(c.modeled_s, rel=1e-9)
        assert s["median_error"] == pytest.approx(0.0, abs=1e-9) and s["meets_target"] is True
    assert validate.exit_status(cells) == 0
    table = validate.format_table(cells)
    assert "MISSED" not in table and "annotated s" in table and "2/2 cells meet it" in table


def test_validate_exit_status_on_a_miss():
    hit = validate.Cell(1000, 1e6, 0.008, mode="virtual", annotated_s=[0.008])
    miss = validate.Cell(1000, 1e6, 0.008, mode="virtual", annotated_s=[0.009])
    assert validate.exit_status([hit]) == 0 and validate.exit_status([hit, miss]) == 1
    assert "MISSED" in validate.format_table([hit, miss]) and "1/2 cells meet it" in validate.format_table([hit, miss])
    # Real mode: a short cell is out of scope (the clock, not the emulator), a skipped one is not counted.
    short = validate.Cell(10, 1e8, 1e-5, achieved_s=[2e-5])
    skipped = validate.Cell(10**8, 1e6, 800.0, skipped="modeled 800 s > 3 s")
    assert validate.exit_status([hit, short, skipped]) == 0
    assert validate.exit_status([skipped]) == 1  # nothing measured: nothing validated


def test_validate_refuses_a_grid_it_would_skip_and_never_calibrates_for_a_skipped_size():
    with pytest.raises(ValueError, match="--sizes: 100000000 bytes .* --max-modeled-s 3"):
        validate.run_validation(sizes=[1e8], rates=[1e6, 100e6])
    assert validate.measured_sizes([100, 1e8], [1e8], max_modeled_s=10.0) == [100, 100_000_000]
    assert validate.measured_sizes([100, 1e8], [1e8], max_modeled_s=3.0) == [100]  # the lead's sizes
    out = _multispin("channel", "validate", "--sizes", "1e8", "--mode", "virtual")
    assert out.returncode == 2 and "100000000 bytes" in out.stderr and "cells meet it" not in out.stdout
