"""The edge's link estimates on a real link, both directions shaped by `tc tbf` (6/30 and 30/6 Mbit/s UL/DL),
with the host idle and with one CPU core kept busy by a spinning process the test starts and stops: every
rate the plan used, in every round, within 5% of the payload rate tbf leaves TCP (x 1448 / 1514).

Slow (a run of 12 rounds with tbf-limited verdicts or uploads of 304 kB each): `-m "slow and netns"`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.runtime.records import load_run

# The sibling test's profile, processes and namespace fixture (a test folder is no package to import from).
_spec = importlib.util.spec_from_file_location("_measure_links_netns", Path(__file__).with_name(
    "test_measure_links_netns.py"))
_sibling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sibling)
MSS, _profile, _start, _stop, veth = _sibling.MSS, _sibling._profile, _sibling._start, _sibling._stop, _sibling.veth

pytestmark = [pytest.mark.netns, pytest.mark.slow]

BOUND = 0.05  # the target: within 5% of the payload rate


def _spin() -> subprocess.Popen:
    """A process that keeps one core busy until stopped (`_stop`)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def estimates(records: list[dict], ul_bps: float, dl_bps: float) -> dict:
    """Per direction: the registration sweep's rate and every planned rate, each as a ratio to the payload
    rate; and the reports/drafts the edge read late (queued while busy)."""
    payload = {"ul": ul_bps * MSS / (MSS + 66), "dl": dl_bps * MSS / (MSS + 66)}
    sweeps = {s["direction"]: s for s in records[0].get("link_probes", [])}
    out: dict = {"sweep": {}, "planned": {}, "sources": {}}
    for d in ("ul", "dl"):
        fit = (sweeps.get(d) or {}).get("fit")
        out["sweep"][d] = None if fit is None else round(fit["rate_bps"] / payload[d] - 1, 4)
        planned = [(r["devices"]["d0"].get("link_rate_bps") or {}).get(d) for r in records]
        out["planned"][d] = [None if p is None else round(p / payload[d] - 1, 4) for p in planned]
        out["sources"][d] = sorted({(r["devices"]["d0"].get("link_rate_source") or {}).get(d) for r in records})
    out["modes"] = "".join(r["devices"]["d0"]["mode"][0] for r in records)
    links = [(r["devices"]["d0"].get("measured") or {}).get("link") or {} for r in records]
    stamps = [x.get("stamp") for link in links for x in link.values()]
    out["stamps"] = {how: stamps.count(how) for how in ("idle", "queued", "late")}
    out["sweep_probes"] = {d: [(s["pings"], s.get("descheduled"), s.get("descheduled_used"),
                                round((s.get("fit") or {}).get("burst_bytes") or 0)) for s in records[0]["link_probes"]
                               if s["direction"] == d] for d in ("ul", "dl")}
    return out


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy-core"])
@pytest.mark.parametrize("ul_bps, dl_bps", [(6e6, 30e6), (30e6, 6e6)], ids=["6-30", "30-6"])
def test_link_estimates_stay_within_5_percent_of_the_tbf_payload_rate(micro_pair, veth, tmp_path, ul_bps,  # noqa: F811
                                                                      dl_bps, busy):
    from channel_emulator.tc_backend import TcShaper, TcUnavailable

    try:
        # A queue of 0.5 s: a 304 kB verdict at 6 Mbit/s takes 0.4 s (a shorter queue drops packets, and TCP's
        # retransmission timeouts would hold messages, which is not what this test is about).
        TcShaper(veth.if_b, netns=veth.ns_b, qdisc="tbf").set_rate(ul_bps, latency_s=0.5)  # device's egress: UL
        TcShaper(veth.if_a, netns=veth.ns_a, qdisc="tbf").set_rate(dl_bps, latency_s=0.5)  # edge's egress: DL
    except (TcUnavailable, RuntimeError) as exc:
        pytest.skip(f"tc tbf is not available here: {exc}")
    profile = _profile(micro_pair, "tbf-estimates", 11, 12, deadline_s=20.0, heartbeat_s=1.0, liveness=20)
    spinner = _spin() if busy else None
    try:
        edge, device, runs = _start(veth, profile, tmp_path, micro_pair)
        try:
            out, _ = edge.communicate(timeout=400)
            device_log = device.communicate(timeout=30)[1]
        finally:
            _stop(edge, device)
    finally:
        if spinner is not None:
            _stop(spinner)
    assert edge.returncode == 0, out[-3000:] + "\ndevice:\n" + device_log[-3000:]
    (run_dir,) = list(runs.iterdir())
    meta, records = load_run(run_dir)
    assert meta["status"] == "complete"
    got = estimates(records, ul_bps, dl_bps)
    print("\n" + json.dumps({"ul_mbps": ul_bps / 1e6, "dl_mbps": dl_bps / 1e6, "busy": busy, **got}))
    for d in ("ul", "dl"):
        assert got["sweep"][d] is not None and abs(got["sweep"][d]) < BOUND, (d, got)
        planned = [p for p in got["planned"][d] if p is not None]
        assert len(planned) == len(records), (d, got)  # every round planned with a measured rate
        assert max(abs(p) for p in planned) < BOUND, (d, got)
