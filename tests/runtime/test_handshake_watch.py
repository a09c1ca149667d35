"""Refused CURVE handshakes are said on both sides: the server logs the peer's address and why within a second,
one line per peer per interval; the client learns why the server does not answer (real sockets on 127.0.0.1)."""

from __future__ import annotations

import logging
import re
import time

import pytest
import zmq
from support import wait_until

from testbed.runtime.handshake_watch import (
    ClientHandshakeWatch,
    ServerHandshakeWatch,
    client_reason,
    server_reason,
)
from testbed.runtime.security import (
    ClientKeys,
    ServerKeys,
    generate_keys,
    make_client,
    make_server,
    stop_authenticators,
)

pytestmark = pytest.mark.live  # ZeroMQ sockets with CURVE in every test

log = logging.getLogger("test.handshakes")


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "keys", ["dev0"])
    generate_keys(tmp_path / "other", ["dev0"])
    return tmp_path / "keys", tmp_path / "other"


@pytest.fixture
def server(keys):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    make_server(sock, ServerKeys.load(keys[0]))
    watch = ServerHandshakeWatch(sock, log, interval_s=0.5)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield watch, f"tcp://127.0.0.1:{port}", ctx
    watch.close()
    sock.close()
    stop_authenticators(ctx)
    ctx.term()


def client(ctx, endpoint: str, keys: ClientKeys | None):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    make_client(s, keys)
    watch = ClientHandshakeWatch(s, has_keys=keys is not None)
    s.connect(endpoint)
    s.send(b"hello", zmq.NOBLOCK)
    return s, watch


def close(s, watch) -> None:
    watch.close()
    s.close(linger=0)


def own_address(sock: zmq.Socket) -> str:
    """The client's side of its TCP connection, as the server sees the peer ('127.0.0.1:PORT')."""
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


@pytest.mark.parametrize("case, tags, client_says", [
    # A keyless peer: the server sees the mechanism mismatch, or the peer hanging up on seeing it first.
    ("keyless", ("no_keys", "hung_up"), "requires CURVE keys and this device has none"),
    ("unlisted", ("unlisted_key",), "refused this device's CURVE key"),
    ("other_server", ("wrong_server_key",), "is not the edge's"),
])
def test_each_refusal_is_logged_with_the_peer_address_and_told_to_the_client(server, keys, caplog, case, tags,
                                                                             client_says):
    watch, endpoint, ctx = server
    other = ClientKeys.for_name(keys[1], "dev0")
    right_server = ClientKeys.for_name(keys[0], "dev0").server_public
    client_keys = {"keyless": None, "unlisted": ClientKeys(other.public, other.secret, right_server),
                   "other_server": other}[case]
    caplog.set_level(logging.WARNING, logger=log.name)
    t0 = time.monotonic()
    s, cw = client(ctx, endpoint, client_keys)
    try:
        # The server: within a second, one line naming the refused peer's address and the reason.
        line = wait_until(lambda: next((r.getMessage() for r in caplog.records if "refused a CURVE handshake"
                                        in r.getMessage()), None), 5.0, "the server's log line")
        assert time.monotonic() - t0 < 1.0 or case == "other_server", line  # see the comment below
        (address, got_tag) = next(iter(watch.refusals))  # the first refusal (libzmq may retry once more)
        assert got_tag in tags
        # The address is read from the accepted descriptor, or from /proc/net/tcp once it is closed: a host
        # loaded far beyond its cores can be late for both (seen once in a full run at load 9); libzmq's own
        # retries of the refused peer then give it more chances, and one of them must be caught.
        if address != "127.0.0.1":
            wait_until(lambda: any(a == "127.0.0.1" and t in tags for a, t in watch.refusals), 5.0,
                       f"an address caught among the retries ({dict(watch.refusals)})")
        else:
            assert address in line
        # The client: why nobody answers.
        assert client_says in wait_until(cw.poll, 5.0, "the client's explanation")
        assert not s.poll(200)  # and no message ever came through
    finally:
        close(s, cw)
    # (A wrong server key fails on the client's side first, which closes and retries: the server's line still
    # comes within the client's reconnect interval, 100 ms, of the connection.)


def test_a_retrying_peer_is_one_line_per_interval_with_a_count(server, caplog):
    watch, endpoint, ctx = server
    caplog.set_level(logging.WARNING, logger=log.name)
    sockets = []
    try:
        for _ in range(6):  # six keyless connections from one host in quick succession: one peer
            sockets.append(client(ctx, endpoint, None))
        wait_until(lambda: watch.refusals[("127.0.0.1", "no_keys")] + watch.refusals[("127.0.0.1", "hung_up")] >= 6,
                   5.0, "six refusals of 127.0.0.1")
        count = wait_until(lambda: [r.getMessage() for r in caplog.records if "more CURVE handshakes" in
                                    r.getMessage()], 5.0, "the count line after the interval")
        # (libzmq may retry a refused connection once more by itself: 5 or more)
        more = int(re.search(r"refused (\d+) more CURVE handshakes from 127\.0\.0\.1 in [\d.]+ s \(", count[0])
                   .group(1))
        assert more >= 5
        firsts = [r for r in caplog.records if "refused a CURVE handshake" in r.getMessage()]
        assert len(firsts) == 1  # the first refusal only; the others in the count
    finally:
        for s, cw in sockets:
            close(s, cw)


def test_repeated_refusals_of_one_address_are_counted_not_logged_each(caplog):
    """The aggregation itself, on one address: 50 refusals in an interval are 2 lines (the first, the count)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    caplog.set_level(logging.WARNING, logger=log.name)
    watch = ServerHandshakeWatch(sock, log, interval_s=0.3)
    try:
        t = 1000.0
        for i in range(50):
            watch.refused("10.0.0.7:5555", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, now=t + i * 0.001)
        watch.flush(t + 0.1)  # within the interval: nothing more
        assert len(caplog.records) == 1 and "10.0.0.7:5555" in caplog.records[0].getMessage()
        watch.flush(t + 0.4)
        assert len(caplog.records) == 2
        assert "refused 49 more CURVE handshakes from 10.0.0.7:5555" in caplog.records[1].getMessage()
        watch.flush(t + 1.0)  # a quiet peer is forgotten: its next refusal is a first line again
        watch.refused("10.0.0.7:5555", zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, now=t + 1.1)
        assert len(caplog.records) == 3 and "not among the authorized keys" in caplog.records[2].getMessage()
    finally:
        watch.close()
        sock.close(linger=0)
        ctx.term()


def test_reasons_name_the_failure():
    assert server_reason(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)[0] == \
        "no_keys"
    assert server_reason(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)[0] == "unlisted_key"
    assert server_reason(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32)[0] == "hung_up"
    assert server_reason(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_UNEXPECTED_COMMAND)[0] == \
        "handshake"
    # A keyless client whose server hung up first is told the same as on a mismatch.
    assert "requires CURVE keys" in client_reason(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, has_keys=False)
    assert "is not the edge's" in client_reason(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, has_keys=True)
