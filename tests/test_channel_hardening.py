"""The emulator on a shared LAN: order per link, capped and rate-limited identities, an authenticated control
socket, CURVE on the frontend. The emulator runs in a thread of this process (its own ZeroMQ context)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from channel_emulator.proxy import ChannelControl, ChannelProxy
from testbed.security import ClientKeys, generate_keys, make_client, stop_authenticators
from testbed.wire.protocol import decode_header, encode_header


class ThreadBench:
    def __init__(self, tmp_path, **proxy_kw):
        self.eps = {k: f"ipc://{tmp_path}/{k}" for k in ("front", "edge", "ctl")}
        if "keys_dir" in proxy_kw:  # CURVE needs tcp; loopback only
            self.eps["front"], self.eps["ctl"] = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
        self.ctx = zmq.Context()
        self.edge = self.sock(zmq.ROUTER)
        if "keys_dir" in proxy_kw:
            from testbed.security import ServerKeys, make_server

            make_server(self.edge, ServerKeys.load(proxy_kw["keys_dir"]))
        self.edge.bind(self.eps["edge"])
        self.proxy = ChannelProxy(self.eps["front"], self.eps["edge"], self.eps["ctl"], **proxy_kw)
        self.eps["front"] = self.proxy.frontend.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.eps["ctl"] = self.proxy.control.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.thread = threading.Thread(target=self.proxy.run, daemon=True)
        self.thread.start()

    def sock(self, kind, client_keys=None):
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        make_client(s, client_keys)
        return s

    def device(self, name, client_keys=None):
        s = self.sock(zmq.DEALER, client_keys)
        s.setsockopt(zmq.ROUTING_ID, name.encode())
        s.connect(self.eps["front"])
        return s

    def control(self, **kw):
        return ChannelControl(self.eps["ctl"], timeout_s=5, context=self.ctx, **kw)

    def close(self):
        self.proxy.running = False
        self.thread.join(5)
        self.edge.close()
        stop_authenticators(self.ctx)
        self.ctx.term()


@pytest.fixture
def bench(tmp_path):
    benches = []

    def make(**kw):
        b = ThreadBench(tmp_path, **kw)
        benches.append(b)
        return b

    yield make
    for b in benches:
        b.close()
    stop_authenticators()


def test_uncharged_message_waits_behind_a_held_one_of_its_link(bench):
    b = bench()
    d = b.device("dev0")
    d.send(encode_header({"type": "register"}))
    b.edge.recv_multipart()
    b.control().configure(links={"dev0": {"ul_rate_bps": 1e6, "dl_rate_bps": 1e5}})
    # A 50 ms verdict, then at once an uncharged schedule for the same device: the schedule must not
    # overtake the verdict (the device would get the next round's schedule first).
    b.edge.send_multipart([b"dev0", encode_header({"type": "verdict", "air": "dl"}), bytes(600)])
    b.edge.send_multipart([b"dev0", encode_header({"type": "schedule"})])
    t0 = time.monotonic()
    first = decode_header(d.recv_multipart()[0])
    second = decode_header(d.recv_multipart()[0])
    assert [first["type"], second["type"]] == ["verdict", "schedule"]
    assert time.monotonic() - t0 >= 0.04
    assert b.proxy.counters["queued_behind"] == 1


def test_a_heartbeat_overtakes_a_held_verdict_of_its_link(bench):
    # A verdict held for long (here 0.5 s) must not hold the edge's heartbeats: the device would count the
    # edge as gone after its liveness window.
    b = bench()
    d = b.device("dev0")
    d.send(encode_header({"type": "register"}))
    b.edge.recv_multipart()
    b.control().configure(links={"dev0": {"ul_rate_bps": 1e6, "dl_rate_bps": 1e4}})
    b.edge.send_multipart([b"dev0", encode_header({"type": "verdict", "air": "dl"}), bytes(600)])
    b.edge.send_multipart([b"dev0", encode_header({"type": "heartbeat"})])
    t0 = time.monotonic()
    first = decode_header(d.recv_multipart()[0])
    assert first["type"] == "heartbeat" and time.monotonic() - t0 < 0.3
    assert decode_header(d.recv_multipart()[0])["type"] == "verdict"
    assert b.proxy.counters["heartbeat_overtook"] == 1


def test_identities_are_capped_and_the_idle_ones_reaped(bench):
    b = bench(max_identities=3)
    for i in range(6):
        s = b.device(f"d{i}")
        s.send(encode_header({"type": "register"}))
        assert b.edge.recv_multipart()[0] == f"d{i}".encode()  # the oldest idle identity made room
        s.close()
    assert len(b.proxy.dealers) <= 3 and b.proxy.counters["reaped"] == 3


def test_rate_limit_per_identity(bench):
    b = bench(max_msgs_per_s=50)
    d = b.device("flood")
    for _ in range(400):
        d.send(encode_header({"type": "noise"}))
    got = 0
    b.edge.setsockopt(zmq.RCVTIMEO, 300)
    try:
        while True:
            b.edge.recv_multipart()
            got += 1
    except zmq.Again:
        pass
    assert 40 <= got < 120 and b.proxy.counters["rate_limited"] >= 280


def test_control_needs_the_token(bench):
    b = bench(control_token="s3cret")
    with pytest.raises(RuntimeError, match="token"):
        b.control().stop()
    assert b.proxy.running
    with pytest.raises(RuntimeError, match="token"):
        b.control(token="wrong").stop()
    assert b.control(token="s3cret").stats()["ok"]
    assert b.proxy.counters["control_refused"] == 2


def test_curve_frontend_and_control(bench, tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, ["dev0", "dev1"])
    b = bench(keys_dir=str(keys))
    honest = b.device("dev0", ClientKeys.for_name(keys, "dev0"))
    honest.send(encode_header({"type": "register"}))
    assert b.edge.recv_multipart()[0] == b"dev0"
    # dev1's key under the name dev0 is dropped at the emulator, never forwarded.
    forger = b.device("dev0x", ClientKeys.for_name(keys, "dev1"))
    forger.send(encode_header({"type": "register"}))
    b.edge.setsockopt(zmq.RCVTIMEO, 500)
    with pytest.raises(zmq.Again):
        b.edge.recv_multipart()
    assert b.proxy.counters["impersonation"] == 1
    # Only the edge's key may use the control socket.
    with pytest.raises(RuntimeError, match="only the edge"):
        b.control(keys=ClientKeys.for_name(keys, "dev0")).stop()
    assert b.control(keys=ClientKeys.for_name(keys, "edge")).stats()["ok"]


def test_a_senders_own_air_time_annotation_is_stripped(bench):
    b = bench()
    d = b.device("dev0")
    forged = {"bytes": 10, "rate_bps": 1e12, "airtime_s": 0.0, "held_s": 0.0, "mode": "real"}
    d.send_multipart([encode_header({"type": "draft", "round": 0, "channel": forged}), bytes(1000)])
    ident, header, _ = b.edge.recv_multipart()
    assert ident == b"dev0" and decode_header(header)["channel"] is None
    assert b.proxy.counters["forged_annotation"] == 1
