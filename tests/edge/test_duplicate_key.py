"""A copy of a device's CURVE key (issue 35): a second connection that presents a live device's key is refused and
logged with its address, the honest holder keeps every message, and the key is taken over only once the holder
has been silent past its liveness window. The edge in the test's thread, the honest device a scripted one, the
duplicate a process of its own; real tcp sockets, real keys."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import zmq
from support import ScriptedDevice, V, make_server

from testbed.run.launcher import child_env
from testbed.runtime.security import ClientKeys, generate_keys, stop_authenticators

pytestmark = pytest.mark.live

# The duplicate: dev0's key file, ZeroMQ's own routing id (as a device with keys), for `seconds`: a register
# every 0.2 s and a heartbeat in between; with "--until-registered", until a `registered` comes. Prints every
# header it received, one JSON line each.
DUPLICATE = r"""
import json, sys, time, zmq
from testbed.runtime.security import ClientKeys, make_client
from testbed.wire import messages as M, protocol as P
endpoint, bundle, seconds, vocab = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
until_registered = "--until-registered" in sys.argv
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
make_client(s, ClientKeys.load(bundle))
s.connect(endpoint)
end, got = time.monotonic() + seconds, []
while time.monotonic() < end and not (until_registered and any(h["type"] == "registered" for h in got)):
    s.send_multipart(M.register("dev0", vocab, {"name": "duplicate"}))
    s.send_multipart(M.heartbeat())
    t = time.monotonic() + 0.2
    while (left := t - time.monotonic()) > 0 and s.poll(int(left * 1000) + 1):
        h = P.decode_header(s.recv_multipart()[0])
        got.append({"type": h["type"], "message": h.get("message"), "t": time.monotonic()})
for h in got:
    print(json.dumps(h))
"""


def _duplicate(endpoint: str, bundle, seconds: float, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DUPLICATE, endpoint, str(bundle), str(seconds), str(V), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def _replies(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return [json.loads(x) for x in out.splitlines()]


def test_a_duplicate_key_is_refused_and_takes_nothing_from_the_live_holder(tmp_path, caplog):
    keys = tmp_path / "keys"
    generate_keys(keys, ["dev0", "dev1"])
    ctx = zmq.Context()
    # 2 s liveness window: the duplicate tries for longer than that while dev0 is served.
    server = make_server("tcp://127.0.0.1:0", keys_dir=str(keys), context=ctx, heartbeat_s=0.2, liveness=10)
    ep = server.endpoint
    honest = ScriptedDevice(ep, "dev0", keys=ClientKeys.for_name(keys, "dev0"), context=ctx)
    other = ScriptedDevice(ep, "dev1", keys=ClientKeys.for_name(keys, "dev1"), context=ctx)
    procs: list[subprocess.Popen] = []
    try:
        honest.start()
        other.start()
        assert server.wait_for_devices(["dev0", "dev1"], 10) == []
        sid = server.sessions["dev0"].sid
        with caplog.at_level(logging.WARNING, logger="multispin.edge"):
            dup = _duplicate(ep, keys / "clients" / "dev0", 3.0)
            procs.append(dup)
            r, records = 0, []
            while dup.poll() is None or r < 5:  # rounds while the duplicate tries, and a few after
                records += server.run(r + 1, start_round=r)
                r += 1
                server.poll(time.monotonic() + 0.05)
                assert r < 500, "the duplicate did not end"
            replies = _replies(dup)
        # The duplicate got refusals only: its registers "name in use", its heartbeats "in use by another
        # connection"; each logged with the address it came from.
        assert replies and {h["type"] for h in replies} == {"error"}, replies
        assert any("name in use" in h["message"] for h in replies)
        assert any("in use by another connection" in h["message"] for h in replies)
        assert server.refusals["name_in_use"] >= 5 and server.refusals["duplicate_key"] >= 5, server.refusals
        assert "(from 127.0.0.1): name in use: 'dev0'" in caplog.text
        # The honest holder kept its session and every message: a schedule and a verdict in each round, no
        # refusal, no round missed.
        assert server.sessions["dev0"].sid == sid
        assert all(not rec["missed"] and set(rec["devices"]) == {"dev0", "dev1"} for rec in records)
        assert honest.schedules == honest.verdicts == len(records) == r, (honest.schedules, honest.verdicts, r)
        assert honest.errors == [] and honest.dropped == 0 and honest.bye is None
        # The holder falls silent (its process is gone): once past the liveness window, the key is taken over.
        honest.stop.set()
        honest.join(5)
        last_heard = server.sessions["dev0"].peer.last_heard
        dup = _duplicate(ep, keys / "clients" / "dev0", 20.0, "--until-registered")
        procs.append(dup)
        server.poll(time.monotonic() + 20, stop=lambda: dup.poll() is not None)
        replies = _replies(dup)
        assert replies[-1]["type"] == "registered", replies
        assert replies[-1]["t"] - last_heard >= 2.0  # not before the window
        assert sum(h["type"] == "error" and "name in use" in h["message"] for h in replies) >= 3
        assert server.sessions["dev0"].sid != sid and server.sessions["dev0"].hardware["name"] == "duplicate"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for d in (honest, other):
            d.stop.set()
            d.join(5)
        server.close()
        stop_authenticators()
        ctx.term()
