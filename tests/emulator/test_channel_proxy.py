"""The emulator as a real process between real ZeroMQ sockets (ipc:// in tmp_path).

Timing checks are loose on purpose (a shared, noisy machine): orderings and lower bounds, not precision.
"""

import json
import time

import numpy as np
import pytest
import zmq
from support import Bench

from channel_emulator.proxy import ChannelControl
from testbed.wire.protocol import ProtocolError, decode_header, encode_header, tx_start_marker


@pytest.fixture
def bench(tmp_path):
    b = Bench(tmp_path)
    yield b
    b.close()


def test_pass_through_and_routing_both_ways(bench):
    d = bench.device("dev-a")
    payload = np.arange(1000, dtype=np.float32)
    d.send_multipart([encode_header({"type": "heartbeat"}), payload])
    ident, hdr, body = bench.edge.recv_multipart()
    assert ident == b"dev-a" and "channel" not in decode_header(hdr)
    assert np.array_equal(np.frombuffer(body, np.float32), payload)  # frames unchanged
    bench.edge.send_multipart([b"dev-a", encode_header({"type": "schedule", "L": 4})])
    (hdr,) = d.recv_multipart()
    assert decode_header(hdr) == {"v": 1, "type": "schedule", "L": 4}


def test_charged_message_is_held_for_its_air_time_and_annotated(bench):
    d = bench.device("dev-a")
    bench.control.configure(round=3, links={"dev-a": {"ul_rate_bps": 1e6, "dl_rate_bps": 2e6}}, base_latency_s=0.01)
    payload = np.random.default_rng(0).integers(0, 255, 10_000, dtype=np.uint8)
    hdr = encode_header({"type": "draft", "air": "ul"})
    t0 = time.monotonic()
    d.send(tx_start_marker("ul"))
    d.send_multipart([hdr, payload])
    ident, h, body = bench.edge.recv_multipart()  # the marker itself is consumed, not forwarded
    elapsed = time.monotonic() - t0
    ch = decode_header(h)["channel"]
    nbytes = len(hdr) + payload.nbytes
    assert ch["bytes"] == nbytes and ch["rate_bps"] == 1e6 and ch["mode"] == "real" and ch["marker"] is True
    assert ch["airtime_s"] == pytest.approx(8 * nbytes / 1e6)
    assert ch["round"] == 3 and ch["base_latency_s"] == 0.01 and ch["queued_s"] == 0
    assert ch["held_s"] >= ch["airtime_s"] + 0.01 - 1e-4 and ch["late_s"] >= 0
    assert elapsed >= ch["airtime_s"] + 0.01 - 1e-3
    assert bytes(body) == payload.tobytes()
    # Downlink at its own rate.
    bench.edge.send_multipart([b"dev-a", encode_header({"type": "dist", "air": "dl"}), payload])
    h, _ = d.recv_multipart()
    ch = decode_header(h)["channel"]
    assert ch["link"] == "dl" and ch["airtime_s"] == pytest.approx(8 * ch["bytes"] / 2e6)
    st = bench.control.stats()
    assert st["links"]["dev-a"]["ul"]["messages"] == 1 and st["links"]["dev-a"]["dl"]["messages"] == 1
    assert st["counters"]["markers"] == 1


def test_fifo_per_link(bench):
    d = bench.device("dev-a")
    bench.control.configure(links={"dev-a": {"ul_rate_bps": 4e6}})
    air = 8 * (len(encode_header({"type": "m", "air": "ul", "i": 0})) + 20_000) / 4e6  # 40 ms
    for i in range(4):
        d.send_multipart([encode_header({"type": "m", "air": "ul", "i": i}), bytes(20_000)])
    got = []
    for _ in range(4):
        _, h, _ = bench.edge.recv_multipart()
        got.append((decode_header(h), time.monotonic()))
    assert [g[0]["i"] for g in got] == [0, 1, 2, 3]
    queued = [g[0]["channel"]["queued_s"] for g in got]
    assert queued[0] < air / 2 and all(b > a for a, b in zip(queued, queued[1:]))
    assert queued[3] == pytest.approx(3 * air, rel=0.2)
    # Measured on the receiver's clock: each message waits for the one before it.
    assert got[3][1] - got[0][1] >= 3 * air * 0.9


@pytest.mark.parametrize("dl_access", ["tdma", "fdma_equal_split"])
def test_shared_downlink(bench, dl_access):
    names = ["d0", "d1", "d2"]
    socks = {n: bench.device(n) for n in names}
    rate = 1e6
    bench.control.configure(dl_access=dl_access, links={n: {"ul_rate_bps": 1e6, "dl_rate_bps": rate} for n in names})
    t0 = time.monotonic()
    for n in names:
        bench.edge.send_multipart([n.encode(), encode_header({"type": "dist", "air": "dl"}), bytes(10_000)])
    arrivals, queued = {}, {}
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    while len(arrivals) < 3:
        for s, _ in poller.poll(10_000):
            h, _ = s.recv_multipart()
            n = s.getsockopt(zmq.ROUTING_ID).decode()
            arrivals[n] = time.monotonic() - t0
            queued[n] = decode_header(h)["channel"]["queued_s"]
    air = 8 * 10_050 / rate  # ~80 ms each
    if dl_access == "tdma":  # one after another on one link
        assert sorted(queued.values())[0] < air / 2
        assert sorted(queued.values())[2] == pytest.approx(2 * air, rel=0.2)
        assert max(arrivals.values()) >= 3 * air * 0.9
    else:  # each device on its own sub-band, in parallel
        assert max(queued.values()) < air / 2
        assert max(arrivals.values()) < 2.5 * air


def test_virtual_mode_forwards_at_once_and_accounts_air_time(tmp_path):
    b = Bench(tmp_path, mode="virtual")
    try:
        d = b.device("dev-v")
        b.control.configure(links={"dev-v": {"ul_rate_bps": 1e6}})
        # A dense float16 distribution over 151,936 entries: 2.43 Mbit, 2.4 s at 1 Mbit/s.
        dist = np.zeros(151_936, np.float16)
        t0 = time.monotonic()
        d.send_multipart([encode_header({"type": "draft", "air": "ul"}), dist])
        _, h, _ = b.edge.recv_multipart()
        elapsed = time.monotonic() - t0
        ch = decode_header(h)["channel"]
        assert ch["mode"] == "virtual" and ch["airtime_s"] == pytest.approx(2.43, abs=0.01)
        assert elapsed < 1.0 < ch["airtime_s"]
        # A second message queues behind the first one's virtual air time.
        d.send_multipart([encode_header({"type": "draft", "air": "ul"}), dist])
        _, h, _ = b.edge.recv_multipart()
        assert decode_header(h)["channel"]["queued_s"] > 1.0
    finally:
        b.close()


def test_malformed_input_does_not_kill_the_proxy(bench):
    d = bench.device("dev-a")
    bench.control.configure(links={"dev-a": {"ul_rate_bps": 1e7}})
    bad = [[b"not json"], [b"\xff\xfe"], [b""], [b"[1,2]"], [encode_header({"type": "x"})[:-3]],
           [b'{"v": 99, "type": "x", "air": "ul"}', b"body"]]
    for frames in bad:
        d.send_multipart(frames)
        _, *got = bench.edge.recv_multipart()
        assert got == frames  # forwarded unchanged, not charged
    # A peer without a routing_id is refused (the edge could not address it), the proxy keeps serving.
    anon = bench.sock(zmq.DEALER)
    anon.connect(bench.eps["front"])
    anon.send(encode_header({"type": "register"}))
    # Control: garbage and bad configures get error replies naming the field.
    with pytest.raises(RuntimeError, match="dl_access='ofdma'"):
        bench.control.configure(dl_access="ofdma")
    with pytest.raises(RuntimeError, match=r"links\['dev-a'\].ul_rate_bps=-5"):
        bench.control.configure(links={"dev-a": {"ul_rate_bps": -5}})
    with pytest.raises(ProtocolError, match="base_latency_s"):  # strict JSON: refused before it is sent
        bench.control.configure(base_latency_s=float("nan"))
    bench.control.sock.send(b'{"v": 1, "type": "configure", "base_latency_s": NaN}')
    assert "not JSON" in json.loads(bench.control.sock.recv())["error"]
    bench.control.sock.send(b"{oops")
    reply = json.loads(bench.control.sock.recv())
    assert reply["ok"] is False and "not JSON" in reply["error"]
    with pytest.raises(RuntimeError, match="type='reboot'"):
        bench.control.request({"type": "reboot"})
    d.send_multipart([encode_header({"type": "ok", "air": "ul"}), b"x" * 100])
    _, h, _ = bench.edge.recv_multipart()
    assert decode_header(h)["channel"]["rate_bps"] == 1e7  # previous good config still in force
    st = bench.control.stats()
    assert st["counters"]["malformed"] >= 5 and st["counters"]["refused_identity"] == 1
    assert bench.alive()
    anon.close(linger=0)


def test_unconfigured_link_passes_uncharged(bench):
    d = bench.device("dev-u")
    d.send_multipart([encode_header({"type": "draft", "air": "ul"}), b"y" * 1000])
    _, h, _ = bench.edge.recv_multipart()
    ch = decode_header(h)["channel"]
    assert ch["rate_bps"] is None and ch["airtime_s"] == 0
    assert bench.control.stats()["counters"]["unconfigured"] == 1


def test_run_proxy_is_a_multiprocessing_target(tmp_path):
    import multiprocessing

    from channel_emulator.proxy import run_proxy

    eps = [f"ipc://{tmp_path}/{k}" for k in ("f", "e", "c")]
    proc = multiprocessing.get_context("spawn").Process(target=run_proxy, args=eps, kwargs={"mode": "virtual"})
    proc.start()
    ctx = zmq.Context()
    control = ChannelControl(eps[2], timeout_s=20, context=ctx)
    try:
        assert control.stats()["mode"] == "virtual"
        control.stop()
        proc.join(timeout=20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()  # started by this test: ended by its handle
            proc.join()
        control.close()
        ctx.term()


def test_the_links_of_a_thousand_devices_go_through_the_control_channel(bench):
    """A 1,024-device run's `configure` is 70 kB, more than a device's 64 KiB header: the edge's run ended with
    a ProtocolError at round 0. The control channel (the edge's only) takes up to 16 MiB."""
    links = {f"d{i:04d}": {"ul_rate_bps": 1e6 + i, "dl_rate_bps": 2e6 + i} for i in range(1200)}
    assert len(json.dumps({"type": "configure", "links": links})) > 64 * 1024
    bench.control.configure(round=0, links=links)
    d = bench.device("d1199")
    d.send_multipart([encode_header({"type": "draft", "air": "ul"}), bytes(125)])
    ident, hdr, _ = bench.edge.recv_multipart()
    assert ident == b"d1199" and decode_header(hdr)["channel"]["rate_bps"] == pytest.approx(1e6 + 1199)
    with pytest.raises(ProtocolError, match="exceeds 65536"):  # a device's header keeps its cap
        encode_header({"type": "draft", "links": links})
