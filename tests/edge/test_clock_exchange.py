"""The clock offset between a device and the edge, measured NTP-style right after registration and kept with the
device's session (its records): the edge on a real socket in the test's thread, a DEALER speaking the protocol
with `device_node.clock_sync.ClockExchanges` (the device's own code) on a clock set off by a known amount."""

from __future__ import annotations

import logging
import time

import pytest
import zmq
from support import V, make_server

from device_node.clock_sync import ClockExchanges
from testbed.runtime.clock_offset import EXCHANGES
from testbed.wire import messages as M
from testbed.wire import protocol as P

pytestmark = pytest.mark.live  # the edge on real sockets


def measure(tmp_path, skew_s: float, caplog):
    """Register dev0 with a clock `skew_s` ahead of the edge's, run its exchanges; (its session, its result)."""
    server = make_server(f"ipc://{tmp_path}/edge")
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, b"dev0")
    s.connect(server.endpoint)

    def reply() -> dict:
        end = time.monotonic() + 5
        while time.monotonic() < end:
            server.poll(time.monotonic() + 0.05, stop=lambda: s.poll(0))
            while s.poll(0):
                h, _ = P.decode(s.recv_multipart())
                if h["type"] not in (P.HEARTBEAT, P.SCHEDULE):
                    return h
        raise AssertionError("no reply from the edge")

    try:
        caplog.set_level(logging.INFO, logger="multispin.edge")
        s.send_multipart(M.register("dev0", V, {}))
        h = reply()
        assert h["type"] == P.REGISTERED and h["clock"] is True  # the edge announces that it answers them
        clock = ClockExchanges("dev0", wall=lambda: time.time() + skew_s)
        out = clock.start()
        while out is not None and clock.result is None:
            s.send_multipart(out)
            h = reply()
            assert h["type"] == P.CLOCK, h
            out = clock.on_reply(h, clock.wall())
        s.send_multipart(out)  # the result
        server.poll(time.monotonic() + 1.0, stop=lambda: server.sessions["dev0"].clock is not None)
        return server.sessions["dev0"], clock.result
    finally:
        s.close(linger=0)
        server.close()


def test_an_offset_of_two_seconds_is_measured_and_flagged(tmp_path, caplog):
    session, result = measure(tmp_path, 2.0, caplog)
    assert result.exchanges == EXCHANGES
    # offset = edge - device = -2 s, within the measurement's own bound (half the shortest round trip)
    assert abs(result.offset_s - -2.0) <= result.uncertainty_s + 1e-6
    assert session.clock["offset_s"] == pytest.approx(result.offset_s)
    assert session.clock["rtt_s"] == pytest.approx(result.rtt_s)
    assert session.clock["offset_exceeds_uncertainty"] is True
    assert "dev0: its clock is +2.000 s off the edge's" in caplog.text


def test_clocks_in_step_are_not_flagged(tmp_path, caplog):
    session, result = measure(tmp_path, 0.0, caplog)
    # One host, one clock: the true offset is 0, so the measured one lies within its bound and is not flagged.
    assert abs(result.offset_s) <= result.uncertainty_s + 1e-6
    assert session.clock["offset_exceeds_uncertainty"] is False
    assert "its clock is" not in caplog.text


def test_a_clock_request_is_answered_before_registering(tmp_path):
    """Any peer may ask (a fleet check measures before a device registers): the reply echoes t0."""
    server = make_server(f"ipc://{tmp_path}/edge")
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, b"stranger")
    s.connect(server.endpoint)
    try:
        t0 = time.time()
        s.send_multipart(M.clock_request(t0))
        server.poll(time.monotonic() + 2.0, stop=lambda: s.poll(0))
        h, _ = P.decode(s.recv_multipart())
        got = M.parse_clock(h, reply=True)
        assert got[0] == t0 and got[0] <= got[1] <= got[2] <= time.time()
        # A result from a device that is not registered is refused, naming why.
        s.send_multipart(M.clock_result(0.1, 0.01, 3))
        server.poll(time.monotonic() + 2.0, stop=lambda: s.poll(0))
        h, _ = P.decode(s.recv_multipart())
        assert h["type"] == P.ERROR and "clock result from 'stranger', which is not registered" in h["message"]
    finally:
        s.close(linger=0)
        server.close()
