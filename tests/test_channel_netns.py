"""Across "hosts": the emulator in one network namespace, the sender in another, joined by a veth pair.

Only the emulator's clock decides air time (the tx_start marker starts it on arrival), and the receiver
checks the spacing of arrivals with its own clock: no clock of the sender is ever read or compared.
"""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from channel_emulator.netns import VethPair
from channel_emulator.proxy import ChannelControl
from testbed.wire.protocol import decode_header, encode_header

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.netns

SENDER = textwrap.dedent("""
    import json, sys, zmq
    from testbed.wire.protocol import encode_header, decode_header, tx_start_marker
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, b"far")
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 20000)
    s.connect(sys.argv[1])
    s.send(encode_header({"type": "register"}))
    assert decode_header(s.recv())["type"] == "go"
    for i in range(3):  # back to back: the emulator queues them FIFO on the far device's uplink
        s.send(tx_start_marker("ul"))
        s.send_multipart([encode_header({"type": "draft", "air": "ul", "i": i}), bytes(25000)])
    h, body = s.recv_multipart()  # a charged downlink message from the edge
    print(json.dumps({"dl": decode_header(h), "bytes": len(body)}), flush=True)
    s.close(); ctx.term()
""")


@pytest.fixture
def veth():
    try:
        pair = VethPair.create()
    except (PermissionError, FileNotFoundError) as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc}")
    try:
        yield pair
    finally:
        pair.close()


def test_emulator_across_namespaces_without_shared_clocks(veth, tmp_path):
    front = f"tcp://{veth.addr_a}:5600"
    edge_ep, ctl_ep = f"ipc://{tmp_path}/edge", f"ipc://{tmp_path}/ctl"  # path sockets reach across netns
    procs = []
    ctx = zmq.Context()
    edge = ctx.socket(zmq.ROUTER)
    edge.setsockopt(zmq.LINGER, 0)
    edge.setsockopt(zmq.RCVTIMEO, 20_000)
    edge.bind(edge_ep)
    control = ChannelControl(ctl_ep, timeout_s=20, context=ctx)
    try:
        procs.append(subprocess.Popen(veth.exec_args(veth.ns_a, sys.executable, "-m", "channel_emulator.proxy",
                                                     "--frontend", front, "--edge", edge_ep, "--control", ctl_ep),
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        rate = 2e6
        control.configure(round=0, links={"far": {"ul_rate_bps": rate, "dl_rate_bps": 4e6}})
        procs.append(subprocess.Popen(veth.exec_args(veth.ns_b, sys.executable, "-c", SENDER, front),
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        ident, hdr = edge.recv_multipart()
        assert ident == b"far" and decode_header(hdr)["type"] == "register"
        edge.send_multipart([b"far", encode_header({"type": "go"})])
        got = []
        for _ in range(3):
            ident, h, body = edge.recv_multipart()
            got.append((time.monotonic(), decode_header(h)))
        assert [g[1]["i"] for g in got] == [0, 1, 2]
        air = got[0][1]["channel"]["airtime_s"]
        assert air == pytest.approx(8 * (len(encode_header({"type": "draft", "air": "ul", "i": 0})) + 25000) / rate)
        assert all(g[1]["channel"]["marker"] for g in got)
        # On the receiver's own clock, FIFO arrivals are spaced by about one air time (100 ms).
        gaps = [b[0] - a[0] for a, b in zip(got, got[1:])]
        assert all(0.8 * air <= gap <= 2.5 * air for gap in gaps), (gaps, air)
        edge.send_multipart([b"far", encode_header({"type": "dist", "air": "dl"}), bytes(50_000)])
        out, err = procs[1].communicate(timeout=30)
        assert procs[1].returncode == 0, err
        dl = json.loads(out)
        assert dl["bytes"] == 50_000 and dl["dl"]["channel"]["link"] == "dl"
        assert dl["dl"]["channel"]["airtime_s"] == pytest.approx(8 * dl["dl"]["channel"]["bytes"] / 4e6)
        assert dl["dl"]["channel"]["held_s"] >= dl["dl"]["channel"]["airtime_s"] - 1e-4
    finally:
        try:
            control.stop()
        except (TimeoutError, RuntimeError):
            pass
        for p in procs:  # stop what this test started, by its handle
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        edge.close(linger=0)
        control.close()
        ctx.term()


def test_tc_backend_shapes_a_veth_and_refuses_missing_netem(veth):
    from channel_emulator.tc_backend import TcShaper, TcUnavailable, netem_available

    for qdisc in ("tbf", "htb"):
        shaper = TcShaper(veth.if_b, netns=veth.ns_b, qdisc=qdisc)
        shaper.set_rate(5e6)
        shown = shaper.show()
        assert qdisc in shown and "5Mbit" in shown, shown
        shaper.clear()
    with pytest.raises(ValueError, match="rate_bps=0"):
        shaper.set_rate(0)
    with pytest.raises(ValueError, match="qdisc='fq'"):
        TcShaper(veth.if_b, netns=veth.ns_b, qdisc="fq")
    ok, why = netem_available()
    if ok:
        pytest.skip("this kernel has netem; the refusal path cannot be exercised")
    with pytest.raises(TcUnavailable, match="netem.*base_latency_s"):
        shaper.set_delay(0.005)
