"""The channel emulator's frontend (where LAN devices connect when it runs) logs a refused CURVE handshake with
the peer's address within a second, one line per peer per interval after that; a device with its keys goes
through as before (real emulator in a thread, CURVE over tcp on 127.0.0.1)."""

from __future__ import annotations

import logging
import threading
import time

import zmq
from support import wait_until

from channel_emulator.proxy import ChannelProxy
from testbed.runtime.security import (
    ClientKeys,
    ServerKeys,
    generate_keys,
    make_client,
    make_server,
    stop_authenticators,
)
from testbed.wire import messages as M


def test_a_keyless_device_at_the_frontend_is_logged_with_its_address(tmp_path, caplog):
    keys = tmp_path / "keys"
    generate_keys(keys, ["dev0"])
    proxy_ctx, dev_ctx = zmq.Context(), zmq.Context()
    edge = dev_ctx.socket(zmq.ROUTER)  # the edge's place: what the emulator forwards arrives here
    edge.setsockopt(zmq.LINGER, 0)
    make_server(edge, ServerKeys.load(keys))  # the emulator's links to the edge use its `channel` key
    edge_port = edge.bind_to_random_port("tcp://127.0.0.1")
    proxy = ChannelProxy("tcp://127.0.0.1:0", f"tcp://127.0.0.1:{edge_port}", "tcp://127.0.0.1:0",
                         keys_dir=str(keys), context=proxy_ctx)
    front = proxy.frontend.getsockopt(zmq.LAST_ENDPOINT).decode()
    thread = threading.Thread(target=proxy.run, daemon=True)
    caplog.set_level(logging.WARNING, logger="channel_emulator.proxy")
    thread.start()
    sockets = []

    def device(client_keys):
        s = dev_ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        make_client(s, client_keys)
        s.connect(front)
        sockets.append(s)
        return s

    try:
        t0 = time.monotonic()
        for _ in range(3):  # one host, three tries
            device(None).send_multipart(M.register("dev0", 100, {}), zmq.NOBLOCK)
        line = wait_until(lambda: [r.getMessage() for r in caplog.records
                                   if "refused a CURVE handshake" in r.getMessage()], 5, "the refusal line")
        assert time.monotonic() - t0 < 1.0
        # (the mechanism mismatch, or the device hanging up on seeing it first: both say no keys)
        assert len(line) == 1 and "channel emulator: refused a CURVE handshake from 127.0.0.1: it" in line[0]
        assert "no CURVE keys" in line[0]
        refusals = proxy.handshakes.refusals
        wait_until(lambda: refusals[("127.0.0.1", "no_keys")] + refusals[("127.0.0.1", "hung_up")] >= 3, 5,
                   "three refusals counted")
        # With its keys, the same device goes through (the edge's place gets its register).
        device(ClientKeys.for_name(keys, "dev0")).send_multipart(M.register("dev0", 100, {}))
        assert edge.poll(5000)
    finally:
        for s in sockets:
            s.close(linger=0)
        proxy.running = False
        thread.join(5)
        stop_authenticators(proxy_ctx)
        edge.close(linger=0)
        stop_authenticators(dev_ctx)
        for c in (dev_ctx, proxy_ctx):
            c.term()
