"""The edge under faults (issue 9, "LAN-grade"): refused drafts, killed devices, impostors, CURVE keys, a dead
channel emulator, interrupted runs, bad values from registered devices.

The edge runs in the test's thread with a fake verifier (uniform p: every draft is accepted); devices are
scripted DEALER sockets in threads, or a real `device_node.node` process where a process must die. Every
socket is on the loopback or ipc://; every process started here is stopped by its pid.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import support
import zmq
from support import TESTS, FakeVerifier, ScriptedDevice, V, make_server, wait_until

from channel_emulator.proxy import ChannelProxy
from edge_node.server import MAX_MSGS_PER_S
from testbed.runtime.errors import TestbedError
from testbed.runtime.records import RunRecorder, load_run
from testbed.runtime.security import ClientKeys, generate_keys, make_client, stop_authenticators
from testbed.wire import messages as M
from testbed.wire import protocol as P

pytestmark = pytest.mark.live  # the edge on real sockets in every test


@pytest.fixture
def ipc(tmp_path):
    return f"ipc://{tmp_path}/edge"


@pytest.fixture
def started():
    """Start scripted devices; stop and join them at the end."""
    devices: list[ScriptedDevice] = []

    def start(*args, **kw):
        d = ScriptedDevice(*args, **kw)
        d.start()
        devices.append(d)
        return d

    yield start
    for d in devices:
        d.stop.set()
    for d in devices:
        d.join(5)


def _wait_registered(server, names, timeout_s=10.0):
    assert server.wait_for_devices(list(names), timeout_s) == []


def _rounds_without_dev1(ipc, started, behaviour, rounds, recorder=None):
    """`rounds` rounds of an honest dev0 beside a dev1 of `behaviour` that misses every one: each round goes on
    without dev1 at once, not at the 3 s deadline. The (closed) server and dev1."""
    # A wide liveness window: on a loaded host a 0.6 s silence is no fault this test is about
    server = make_server(ipc, deadline_s=3.0, recorder=recorder, liveness=25)
    try:
        started(ipc, "dev0")
        dev1 = started(ipc, "dev1", behaviour=behaviour)
        _wait_registered(server, ["dev0", "dev1"])
        records = server.run(rounds)
    finally:
        server.close()
        if recorder is not None:
            recorder.close()
    assert len(records) == rounds
    for rec in records:
        assert rec["missed"] == ["dev1"] and not rec["devices"]["dev0"]["missed"]
        assert rec["measured"]["round_s"] < 0.5, rec["measured"]["round_s"]
    return server, dev1


def test_a_refused_draft_does_not_hold_up_the_round(ipc, tmp_path, started):
    server, bad = _rounds_without_dev1(ipc, started, "bad_draft", 6, RunRecorder(tmp_path / "run"))
    assert server.refusals["invalid"] >= 6
    wait_until(lambda: bad.dropped >= 6, 5, "the device read a dropped verdict for each of the 6 rounds")
    assert any("draft.mode" in e for e in bad.errors)


def test_a_device_that_refuses_its_schedule_does_not_hold_up_the_round(ipc, started):
    # A device that holds an unverified draft refuses the next schedule with an error naming the round: the
    # round goes on without it at once, not at the deadline, and the device stays in the run.
    server, refuser = _rounds_without_dev1(ipc, started, "refuse_schedule", 5)
    assert "dev1" in server.sessions and server.device_errors == {}
    # The last round's `dropped` verdict was sent as the run returned: the device's thread reads it soon after
    wait_until(lambda: refuser.dropped >= 5, 5, "dev1 read a dropped verdict for each of the 5 rounds")


def test_garbage_and_odd_values_cost_one_message_each(ipc, tmp_path, started, caplog):
    recorder = RunRecorder(tmp_path / "run")
    verifier = FakeVerifier()
    verifier.fail_open.add("dev2")  # a failure that is no ProtocolError while handling a register
    server = make_server(ipc, names=("dev0", "dev1", "dev2"), recorder=recorder, verifier=verifier)
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.ROUTING_ID, b"dev2")
    rogue.connect(ipc)
    try:
        started(ipc, "dev0")
        forger = started(ipc, "dev1", behaviour="forge")
        _wait_registered(server, ["dev0", "dev1"])
        for frames in ([b"not json"], [b'{"v": 2, "type": "draft"}'], [b"\xff\xfe"], [b""],
                       M.register("dev2", V, {}),                     # the verifier raises KeyError
                       M.heartbeat(),                                 # not registered
                       P.encode({"type": "verdict", "round": 0}),     # not a device's message
                       [P.encode_header({"type": "report", "round": 10**18, "token": 0, "n_accepted": 0})]):
            rogue.send_multipart(frames)
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.ROUTING_ID, b"d9")
        stranger.connect(ipc)
        stranger.send_multipart(M.register("d9", V, {}))
        with caplog.at_level(logging.WARNING, logger="multispin.edge"):
            records = server.run(4)
            server.poll(time.monotonic() + 2.0, stop=lambda: server.refused >= 9)  # whatever came after
        replies = [P.decode_header(rogue.recv_multipart()[0]) for _ in range(8) if rogue.poll(1000)]
        assert stranger.poll(1000)
        unknown = P.decode_header(stranger.recv_multipart()[0])
        stranger.close(linger=0)
    finally:
        rogue.close(linger=0)
        server.close()
        recorder.close()
    assert len(records) == 4 and all(not r["missed"] for r in records)
    assert len(replies) == 8 and all(r["type"] == "error" for r in replies)
    text = " | ".join(r["message"] for r in replies)
    assert "register could not be handled (KeyError)" in text and "not registered" in text
    # The unknown name is refused without the list of valid ones.
    assert "not a device of this profile" in unknown["message"] and "dev0" not in unknown["message"]
    assert server.refusals["internal"] == 1 and server.refusals["malformed"] >= 3
    assert server.refusals["unknown_device"] == 1 and server.refused >= 9
    assert "dev2" not in server.sessions
    # A forged annotation (no emulator in between) is ignored: ul_bytes are the bytes that came, and odd
    # timings reach the record as finite numbers.
    _, on_disk = load_run(tmp_path / "run")
    assert len(on_disk) == 4
    for rec in on_disk:
        d = rec["devices"]["dev1"]
        assert d["ul_channel"] is None
        L = d["draft_len"]
        assert d["measured"]["ul_bytes"] >= L * 4 + (L * V * 2 if d["mode"] == "UL" else L * 8)
        assert d["measured"]["draft_s"] == 1e9
    assert forger.verdicts == 4
    assert len([r for r in caplog.records if "refused a message" in r.getMessage()]) == server.refused


def test_an_unconfirmed_verdict_is_not_credited(ipc, tmp_path, started):
    server = make_server(ipc, deadline_s=0.5)
    try:
        started(ipc, "dev0")
        started(ipc, "dev1", behaviour="no_report")
        _wait_registered(server, ["dev0", "dev1"])
        records = server.run(3)
    finally:
        server.close()
    for rec in records:
        d0, d1 = rec["devices"]["dev0"], rec["devices"]["dev1"]
        assert d1["report_late"] and d1["verdict_unconfirmed"]
        assert d1["measured"]["tokens"] == 0 and d1["measured"]["tokens_sent"] == d1["n_accepted"] + 1
        assert not d0["report_late"] and rec["measured"]["tokens"] == d0["measured"]["tokens"] > 0


def test_a_refused_report_of_another_round_does_not_end_the_wait_for_the_right_one(ipc, started):
    server = make_server(ipc, deadline_s=2.0)
    try:
        liar = started(ipc, "dev0", behaviour="stale_report_first")
        started(ipc, "dev1")
        _wait_registered(server, ["dev0", "dev1"])
        records = server.run(5)
    finally:
        server.close()
    assert liar.verdicts == 5 and server.refusals["invalid"] == 5  # each stale report refused
    for rec in records:
        d0 = rec["devices"]["dev0"]
        assert not d0["report_late"] and d0["measured"]["tokens"] == d0["n_accepted"] + 1, d0


def test_a_second_connection_under_a_live_name_gets_nothing(ipc, started):
    server = make_server(ipc)
    rogue_replies = []
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.ROUTING_ID, b"dev0")
    try:
        honest = started(ipc, "dev0")
        started(ipc, "dev1")
        _wait_registered(server, ["dev0", "dev1"])
        sid = server.sessions["dev0"].sid

        def on_round(rec):
            if rec["round"] == 1:
                rogue.connect(ipc)
                rogue.send_multipart(M.register("dev0", V, {}))
            while rogue.poll(0):
                rogue_replies.append(P.decode_header(rogue.recv_multipart()[0]))

        records = server.run(8, on_round=on_round)
    finally:
        rogue.close(linger=0)
        server.close()
    assert all(not r["missed"] for r in records) and len(records) == 8
    assert server.sessions["dev0"].sid == sid and honest.verdicts == 8
    assert rogue_replies == []  # ZeroMQ never delivered the impostor's messages (no ROUTER_HANDOVER)


def test_name_in_use_until_the_old_session_is_silent(ipc, caplog):
    server = make_server(ipc, heartbeat_s=0.2, liveness=5)  # 1 s liveness window
    ctx = zmq.Context.instance()

    def register():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"dev0")
        s.connect(ipc)
        s.send_multipart(M.register("dev0", V, {}))
        return s

    def reply(s):
        end = time.monotonic() + 5
        while time.monotonic() < end:
            server.poll(time.monotonic() + 0.05)
            while s.poll(0):
                h, a = P.decode(s.recv_multipart())
                if h["type"] != P.HEARTBEAT:  # the edge beats to the name, whoever holds it now
                    return h, a
        raise AssertionError("no reply")

    first = register()
    try:
        h, a = reply(first)
        reg = M.parse_registered(h, a, vocab_size=V)
        assert (reg.heartbeat_s, reg.liveness) == (0.2, 5)
        first.close(linger=0)  # crashed: its connection is gone, its session not yet
        # Let the edge see the disconnect first: ZeroMQ ignores, for its whole life, a connection made while
        # the name is still held (a restarted device takes a second or more to come back anyway).
        server.poll(time.monotonic() + 0.1)
        second = register()
        h, _ = reply(second)
        assert h["type"] == "error" and "name in use" in h["message"]
        assert server.sessions["dev0"].sid == reg.session
        with caplog.at_level(logging.WARNING, logger="multispin.edge"):
            server.poll(time.monotonic() + 1.5)  # the old session falls silent and is dropped
        assert "dev0" not in server.sessions and "silent for" in caplog.text
        assert reg.session not in server.verifier.open_sids  # its KV cache was freed
        while second.poll(0):  # only heartbeats came meanwhile (a silent session gets no bye)
            assert P.decode_header(second.recv_multipart()[0])["type"] == P.HEARTBEAT
        second.send_multipart(M.register("dev0", V, {}))
        h, a = reply(second)
        assert h["type"] == "registered" and h["session"] != reg.session
        second.close(linger=0)
    finally:
        first.close(linger=0)
        server.close()
    assert server.refusals["name_in_use"] == 1


def test_curve_keys_admit_only_the_key_of_the_name(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, ["dev0", "dev1"])
    generate_keys(tmp_path / "other", ["dev0"])
    ctx = zmq.Context()
    server = make_server("tcp://127.0.0.1:0", keys_dir=str(keys), context=ctx)
    ep = server.endpoint
    sockets = []

    def client(routing_id: str, keys_: ClientKeys, close: bool = True):
        """Register as `routing_id` with `keys_`; the first reply's header, or None."""
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        make_client(s, keys_)
        s.connect(ep)
        sockets.append(s)
        s.send_multipart(M.register(routing_id, V, {}))
        server.poll(time.monotonic() + 1.0, stop=lambda: s.poll(0))
        h = P.decode_header(s.recv_multipart()[0]) if s.poll(200) else None
        if close:  # frees the routing id for the next client
            s.close(linger=0)
            server.poll(time.monotonic() + 0.1)
        return h

    try:
        assert ep.startswith("tcp://127.0.0.1:")
        # dev1's key under the routing id dev0, registering as dev0: it speaks for dev1 (its key's name), so
        # the register is refused, never processed ...
        h = client("dev0", ClientKeys.for_name(keys, "dev1"), close=False)
        assert h["type"] == "error" and "register.name: 'dev0' differs from the sender's name 'dev1'" in h["message"]
        assert "dev0" not in server.sessions and "dev1" not in server.sessions
        # ... and while it stays connected under the routing id dev0, the real dev0 (ZeroMQ picks its routing
        # id, as a device with keys does) still registers: a listed key cannot hold another device's name.
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        make_client(s, ClientKeys.for_name(keys, "dev0"))
        s.connect(ep)
        sockets.append(s)
        s.send_multipart(M.register("dev0", V, {}))
        server.poll(time.monotonic() + 1.0, stop=lambda: s.poll(0))
        assert s.poll(200) and P.decode_header(s.recv_multipart()[0])["type"] == "registered"
        assert sorted(server.sessions) == ["dev0"]
        server.roster.end("dev0", "test", notify=False)
        for sock in sockets:
            sock.close(linger=0)
        server.poll(time.monotonic() + 0.1)
        # An unlisted key (with the right server key) never gets past the handshake: no reply at all.
        other = ClientKeys.for_name(tmp_path / "other", "dev0")
        stranger = ClientKeys(other.public, other.secret, ClientKeys.for_name(keys, "dev0").server_public)
        assert client("dev1", stranger) is None and "dev1" not in server.sessions
        # Each device with its own key registers.
        assert client("dev0", ClientKeys.for_name(keys, "dev0"), close=False)["type"] == "registered"
        assert client("dev1", ClientKeys.for_name(keys, "dev1"), close=False)["type"] == "registered"
        assert sorted(server.sessions) == ["dev0", "dev1"]
    finally:
        for s in sockets:
            s.close(linger=0)
        server.close()
        stop_authenticators()
        ctx.term()


class _Interrupted(Exception):
    pass


def test_the_last_completed_round_is_on_disk_when_the_run_is_interrupted(ipc, tmp_path, started):
    recorder = RunRecorder(tmp_path / "run")
    server = make_server(ipc, recorder=recorder)

    def on_round(rec):
        if rec["round"] == 3:
            raise _Interrupted  # as Ctrl-C right after the round

    try:
        started(ipc, "dev0")
        started(ipc, "dev1")
        _wait_registered(server, ["dev0", "dev1"])
        with pytest.raises(_Interrupted):
            server.run(10, on_round=on_round, keep_records=False)
        # Read before the recorder is closed: what is on disk is what a crash would leave.
        lines = (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()
    finally:
        server.close()
        recorder.close()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2, 3]
    assert server.rounds_done == 4 and server.last_record["round"] == 3


class _Channel:
    """A channel control whose emulator stops answering once `dead` is set."""

    endpoint = "ipc://test-channel"
    dead = False
    requests = 0

    def _request(self):
        self.requests += 1
        if self.dead:
            raise TimeoutError("no reply within 100 ms")
        return {"ok": True}

    def configure(self, **kw):
        return self._request()

    def stats(self):
        return self._request()


def test_a_dead_channel_emulator_ends_the_run_with_a_clear_error(ipc, started):
    channel = _Channel()
    server = make_server(ipc, channel=channel, channel_mode="virtual")
    t_dead = []

    def on_round(rec):
        if rec["round"] == 2:
            channel.dead = True
            t_dead.append(time.monotonic())

    try:
        started(ipc, "dev0")
        started(ipc, "dev1")
        _wait_registered(server, ["dev0", "dev1"])
        with pytest.raises(TestbedError, match=r"channel emulator at ipc://test-channel stopped answering"):
            server.run(50, on_round=on_round, join_wait_s=0.3)
        assert time.monotonic() - t_dead[0] < 1.0  # checked while waiting between rounds
        # Known dead: asked nothing more (a request would only wait out its timeout), the same error again.
        asked = channel.requests
        with pytest.raises(TestbedError, match="stopped answering"):
            server.watch.call("stats", channel.stats)
        assert channel.requests == asked and "stopped answering" in server.channel_down
    finally:
        server.close()
    assert server.rounds_done == 3


def test_memory_stays_bounded_over_many_rounds(ipc, started):
    import gc
    import tracemalloc

    names = ("dev0", "dev1", "dev2", "dev3")
    server = make_server(ipc, names=names)
    try:
        for name in names:
            started(ipc, name)
        _wait_registered(server, names)
        server.run(220, keep_records=False)  # fills the bounded windows of the estimates
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        server.run(150, keep_records=False)
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
    finally:
        server.close()
    ours = (__file__, support.__file__)
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.traceback[0].filename not in ours)
    # What must grow: the sessions' output ids (a few ints a round each). Records are not kept: they were
    # 9 KiB a round with these 4 devices.
    assert grown / 150 < 2048, grown / 150


def _flooder(endpoint: str, ctx: zmq.Context, name: bytes = b"flood") -> zmq.Socket:
    """A DEALER that queues whatever it is given (no high-water mark): a burst leaves at the transport's pace."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.ROUTING_ID, name)
    s.connect(endpoint)
    return s


def test_a_flooding_identity_is_rate_limited_while_honest_devices_are_served(ipc, started, caplog):
    # One peer sends 20,000 garbage messages as fast as the transport takes them while two devices run rounds:
    # the edge handles at most MAX_MSGS_PER_S a second from it (plus one second's burst), drops the rest before
    # decoding and unanswered, and the honest devices miss no round.
    n_flood = 20_000
    server = make_server(ipc, deadline_s=3.0, heartbeat_s=0.5, liveness=6)  # the default limit
    flood_ctx = zmq.Context()
    flooder = _flooder(ipc, flood_ctx)
    t_flood: list[float] = []
    try:
        started(ipc, "dev0")
        started(ipc, "dev1")
        _wait_registered(server, ["dev0", "dev1"])

        def on_round(rec):
            if rec["round"] == 9:
                t_flood.append(time.monotonic())
                for _ in range(n_flood):
                    flooder.send(b"\x00 not a header", zmq.NOBLOCK)  # no high-water mark: never blocks

        def all_in():
            return server.refusals["malformed"] + server.refusals["rate_limited"] >= n_flood

        with caplog.at_level(logging.WARNING, logger="multispin.edge"):
            records = server.run(40, on_round=on_round)
            server.poll(time.monotonic() + 10.0, stop=all_in)
            t_done = time.monotonic()
            server.poll(time.monotonic() + 1.1)  # the refusal log's last window closes
        handled, dropped = server.refusals["malformed"], server.refusals["rate_limited"]
        replies = 0
        while flooder.poll(200):
            flooder.recv_multipart()
            replies += 1
    finally:
        flooder.close(linger=0)
        flood_ctx.term()
        server.close()
    assert handled + dropped == n_flood
    flood_s = t_done - t_flood[0]  # an upper bound on how long the flood took to arrive
    before = [r["measured"]["round_s"] for r in records[:10]]
    during = [r["measured"]["round_s"] for r in records[10:]]
    print(f"\nflood of {n_flood} messages within {flood_s:.2f} s: {handled} handled, {dropped} dropped "
          f"(limit {MAX_MSGS_PER_S:g}/s); median round {1e3 * np.median(before):.1f} ms before, "
          f"{1e3 * np.median(during):.1f} ms during and after")
    assert handled <= MAX_MSGS_PER_S * (1.0 + flood_s) + 1 and dropped >= n_flood - handled
    assert replies == handled  # a dropped message is not answered
    # Every honest message got through: no round missed, nothing refused but the flood's.
    assert len(records) == 40 and all(not r["missed"] for r in records)
    assert server.refused == n_flood and set(server.refusals) == {"malformed", "rate_limited"}
    # The refusal log stays throttled (20 lines a second); the rest are counted per reason, none lost.
    lines = [r.getMessage() for r in caplog.records]
    logged = [m for m in lines if m.startswith("refused a message from 'flood'")]
    summaries = [m for m in lines if "more refused messages were not logged" in m]
    assert len(logged) <= 20 * (1 + (t_done - t_flood[0]) + 1.1)
    assert any("rate_limited: " in m for m in summaries)
    assert len(logged) + sum(int(m.split()[0]) for m in summaries) == n_flood


def test_a_poll_ends_on_time_while_a_peer_sends_faster_than_the_edge_reads(ipc):
    # Without a limit every garbage message is decoded and answered (tens of microseconds each): a queue of
    # 30,000 takes the edge about a second. A poll of 50 ms must still end after a batch or two, not drain it.
    server = make_server(ipc, max_msgs_per_s=None)
    flood_ctx = zmq.Context()
    flooder = _flooder(ipc, flood_ctx)
    try:
        for _ in range(30_000):
            flooder.send(b"\x00 not a header", zmq.NOBLOCK)
        assert server.sock.poll(5000)
        t = time.monotonic()
        server.poll(t + 0.05)
        took = time.monotonic() - t
        left = server.sock.poll(0)
        handled_then = server.refused
        # Read the rest before the flooder leaves: libzmq 4.3.5 aborts a process whose socket has transport
        # heartbeats on when a peer hangs up while that peer's receive queue is full.
        server.poll(time.monotonic() + 30.0, stop=lambda: server.refused >= 30_000)
    finally:
        flooder.close(linger=0)
        flood_ctx.term()
        server.close()
    assert took < 0.5 and handled_then < 30_000 and left, (took, handled_then)
    assert server.refused == server.refusals["malformed"] == 30_000  # then every one was handled


def test_behind_an_emulator_only_the_emulators_key_reaches_the_edge(tmp_path):
    # With an emulator in between, a device's own key straight to the edge would skip its air time: the edge
    # admits only the emulator's key (`channel`), already in the CURVE handshake, so the direct socket gets
    # nothing and holds no name; through the emulator the same device registers.
    keys = tmp_path / "keys"
    generate_keys(keys, ["dev0", "dev1"])
    ctx, proxy_ctx, dev_ctx = zmq.Context(), zmq.Context(), zmq.Context()
    server = make_server("tcp://127.0.0.1:0", keys_dir=str(keys), context=ctx, channel_mode="real")
    proxy = ChannelProxy("tcp://127.0.0.1:0", server.endpoint, "tcp://127.0.0.1:0", keys_dir=str(keys),
                         context=proxy_ctx)
    front = proxy.frontend.getsockopt(zmq.LAST_ENDPOINT).decode()
    thread = threading.Thread(target=proxy.run, daemon=True)
    thread.start()
    sockets = []

    def device(endpoint: str, name: str) -> zmq.Socket:
        s = dev_ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 1000)  # a refused CURVE client may never get a pipe to send on
        s.setsockopt(zmq.ROUTING_ID, name.encode())
        make_client(s, ClientKeys.for_name(keys, name))
        s.connect(endpoint)
        sockets.append(s)
        return s

    def reply(s: zmq.Socket, wait_s: float = 2.0):
        server.poll(time.monotonic() + wait_s, stop=lambda: s.poll(0))
        return P.decode_header(s.recv_multipart()[0]) if s.poll(200) else None

    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:") and front.startswith("tcp://127.0.0.1:")
        direct = [device(server.endpoint, "dev0"), device(server.endpoint, "dev1")]
        for s in direct:
            try:
                s.send_multipart(M.register(s.getsockopt(zmq.ROUTING_ID).decode(), V, {}))
            except zmq.Again:
                pass  # refused before any pipe was up: nothing can be delivered either
        assert reply(direct[0]) is None and reply(direct[1], 0.5) is None
        assert server.sessions == {} and server.refused == 0  # refused in the handshake: no message at all
        # The same devices through the emulator (its DEALERs authenticate as `channel`): both register, and the
        # direct sockets, still retrying their handshakes, hold neither name.
        for name in ("dev0", "dev1"):
            via = device(front, name)
            via.send_multipart(M.register(name, V, {}))
            h = reply(via, 5.0)
            assert h is not None and h["type"] == "registered", h
        assert sorted(server.sessions) == ["dev0", "dev1"] and proxy.counters["impersonation"] == 0
    finally:
        for s in sockets:
            s.close(linger=0)
        proxy.running = False
        thread.join(5)
        server.close()
        stop_authenticators(proxy_ctx)
        stop_authenticators(ctx)
        for c in (dev_ctx, proxy_ctx, ctx):
            c.term()


# -- with a real device process --------------------------------------------------------------------------

def test_a_killed_device_is_dropped_after_the_liveness_window_and_can_rejoin(micro_pair, tmp_path, started,
                                                                            caplog):
    from device_node.drafter import OnnxDrafter

    vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
    ep = f"ipc://{tmp_path}/edge"
    server = make_server(ep, vocab=vocab, deadline_s=2.0, heartbeat_s=0.25, liveness=4)
    argv = [sys.executable, "-m", "device_node.node", "--connect", ep, "--name", "dev1",
            "--draft", str(micro_pair.draft_onnx)]
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_registered(server, ["dev1"], 60)  # the real device first: it is the slow one to start
        first_sid = server.sessions["dev1"].sid
        started(ep, "dev0", vocab=vocab)
        _wait_registered(server, ["dev0"])

        def on_round(rec):
            if rec["round"] == 2:
                os.kill(procs[0].pid, signal.SIGKILL)
                procs[0].wait(10)
                # Restarted at once: refused ("name in use") until the dead session's window is over.
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        with caplog.at_level(logging.INFO, logger="multispin.edge"):
            records = server.run(9, on_round=on_round)
            # The restarted process gets a new session (its register is resent with backoff).
            assert server.wait_for_devices(["dev1"], 60) == []
            later = server.run(12, start_round=9)
    finally:
        server.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert len(records) == 9 and all(not r["devices"]["dev0"]["missed"] for r in records)
    assert all("dev1" in r["devices"] and not r["devices"]["dev1"]["missed"] for r in records[:3])
    # The dead session cost at most the one round that waited for its draft: after its liveness window (1 s)
    # it was dropped, or its restarted process took the name over.
    assert [r["round"] for r in records if "dev1" in r["missed"]] in ([], [3])
    assert sum(r["measured"]["round_s"] for r in records[3:]) < 2.0 + 1.5
    assert "dev1: left the session: silent for" in caplog.text or "dev1: re-registered" in caplog.text
    assert first_sid not in server.verifier.open_sids  # the dead session's KV cache was freed
    # The restarted process has a session of its own and takes part in every later round.
    assert server.sessions["dev1"].sid != first_sid
    assert [r["round"] for r in later] == [9, 10, 11]
    assert all(not r["devices"]["dev1"]["missed"] for r in later)


def test_a_device_that_cannot_start_tells_the_edge_why(ipc, caplog):
    from device_node.node import tell_edge

    server = make_server(ipc)
    try:
        with caplog.at_level(logging.ERROR, logger="multispin.edge"):
            tell_edge(ipc, "dev0", "device dev0 cannot start: draft.onnx: not a loadable ONNX model", None,
                      wait_s=1.0)
            tell_edge(ipc, "stranger", "let me in", None, wait_s=1.0)
            server.poll(time.monotonic() + 1.0, stop=lambda: "dev0" in server.device_errors)
        assert server.device_errors == {"dev0": "device dev0 cannot start: draft.onnx: not a loadable ONNX model"}
        assert "dev0: cannot take part: device dev0 cannot start" in caplog.text
        assert server.wait_for_devices(["dev1"], 0.2) == ["dev1"]  # the edge keeps serving
    finally:
        server.close()


BUSY_EDGE = """
import sys, time
sys.path.insert(0, {tests!r})
from support import make_server
server = make_server("tcp://127.0.0.1:0")
print(server.endpoint, flush=True)
for _ in range(6):  # read a batch, then busy (a long verification) while a flood fills the queue
    server.poll(time.monotonic() + 0.01)
    time.sleep(0.4)  # the behaviour under test: an edge busy verifying, not reading its socket
server.close()
print("alive", flush=True)
"""


def test_a_peer_that_fills_the_queue_of_a_busy_edge_then_hangs_up_does_not_kill_it():
    # With ZeroMQ's transport heartbeat on the edge's socket, libzmq 4.3.5 aborts the process when a peer
    # hangs up with the queue full (stream_engine_base.cpp:310); the edge relies on its own heartbeats and
    # TCP keepalive instead.
    edge = subprocess.Popen([sys.executable, "-c", BUSY_EDGE.format(tests=str(TESTS))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        endpoint = edge.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), edge.stderr.read()
        for wait_s in (0.1, 0.2, 0.3, 0.5):  # the abort's window is narrow: hang up at several points
            flood = ctx.socket(zmq.DEALER)
            flood.setsockopt(zmq.LINGER, 0)
            flood.setsockopt(zmq.SNDHWM, 0)
            flood.connect(endpoint)
            for _ in range(30_000):
                flood.send(b"\x00 garbage", zmq.NOBLOCK)
            time.sleep(wait_s)  # the behaviour under test: hanging up at that point of the edge's busy spell
            flood.close(linger=0)
        out, err = edge.communicate(timeout=30)
        assert edge.returncode == 0 and out.strip() == "alive", (edge.returncode, err[-2000:])
    finally:
        ctx.destroy(linger=0)
        if edge.poll() is None:
            edge.kill()
            edge.wait()


IDLE_EDGE = """
import resource, sys, time
sys.path.insert(0, {tests!r})
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, hard))  # a shell's low soft limit, the hard one above it
from support import make_server
server = make_server("tcp://127.0.0.1:0")
print(server.endpoint, resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
end = time.monotonic() + 20
while time.monotonic() < end and "dev0" not in server.sessions:
    server.poll(time.monotonic() + 0.1)
print("sessions", sorted(server.sessions), flush=True)
server.close()
"""


def test_idle_connections_beyond_the_shells_file_limit_do_not_lock_devices_out():
    """400 idle peers that finished the handshake against an edge started with a soft limit of 200 open files:
    the edge raises its soft limit to the hard one, so the honest dev0 still registers (before, every file was
    taken and dev0 never got an answer)."""
    soft = 200
    edge = subprocess.Popen([sys.executable, "-c", IDLE_EDGE.format(tests=str(TESTS), soft=soft)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 4000)
    try:
        endpoint, limit = edge.stdout.readline().split()
        assert endpoint.startswith("tcp://127.0.0.1:"), edge.stderr.read()
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if hard != resource.RLIM_INFINITY and hard < 1000:
            pytest.skip(f"the hard limit on open files here is {hard}: nothing to raise to")
        assert int(limit) > 2 * 400, limit
        idle = []
        for i in range(400):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, f"idle{i}".encode())
            s.connect(endpoint)
            s.send(P.encode({"type": "heartbeat"})[0])  # completes the handshake: a connection held, not pending
            idle.append(s)
        time.sleep(2.0)  # kept: no event says the edge accepted all 400 (their handshakes finish in its I/O thread)
        dev0 = ctx.socket(zmq.DEALER)
        dev0.setsockopt(zmq.LINGER, 0)
        dev0.setsockopt(zmq.ROUTING_ID, b"dev0")
        dev0.connect(endpoint)
        dev0.send_multipart(M.register("dev0", V, {}))
        assert dev0.poll(10_000), "dev0 got no answer: the edge ran out of files"
        assert P.decode_header(dev0.recv_multipart()[0])["type"] == "registered"
        out, err = edge.communicate(timeout=30)
        assert edge.returncode == 0 and "sessions ['dev0']" in out, (edge.returncode, err[-2000:])
    finally:
        ctx.destroy(linger=0)
        if edge.poll() is None:
            edge.kill()
            edge.wait()


@pytest.fixture
def edge_and_rogue(ipc):
    """A real edge on `ipc` and a DEALER connected to it that no profile knows."""
    server = make_server(ipc)
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(ipc)
    try:
        yield server, rogue
    finally:
        rogue.close(linger=0)
        server.close()


def _logged(caplog, text: str):
    return lambda: [r for r in caplog.records if text in r.getMessage()]


def test_the_heap_is_given_back_once_a_flood_of_refused_messages_ends(edge_and_rogue, caplog):
    """The edge keeps freed heap for the optimizer's temporaries (`testbed.runtime.heap`); after a flood of
    refused messages that would stay its size (bench_flood: +52 to +87 MB). Once FLOOD_TRIM_REFUSALS have
    been refused and FLOOD_QUIET_S passed without one, it is trimmed, once per flood."""
    from edge_node.transport import FLOOD_QUIET_S, FLOOD_TRIM_REFUSALS

    server, rogue = edge_and_rogue
    ended = _logged(caplog, "a flood ended")
    with caplog.at_level(logging.INFO, logger="multispin.edge"):
        for _ in range(FLOOD_TRIM_REFUSALS):
            rogue.send_multipart([b"not json"])
        server.poll(time.monotonic() + 30, stop=lambda: server.refused >= FLOOD_TRIM_REFUSALS)
        assert server.refused >= FLOOD_TRIM_REFUSALS and not ended()  # not while it goes on
        quiet_from = time.monotonic()
        server.poll(time.monotonic() + 10 * FLOOD_QUIET_S, stop=lambda: bool(ended()))
        assert len(ended()) == 1 and time.monotonic() - quiet_from >= FLOOD_QUIET_S * 0.9
        rogue.send_multipart([b"not json"])  # a few more refusals are no new flood
        server.poll(time.monotonic() + 3 * FLOOD_QUIET_S)
        assert len(ended()) == 1


def test_a_trickle_of_refusals_gets_the_heap_trimmed_too(edge_and_rogue, caplog, monkeypatch):
    """A hostile device that registers again and again is refused a few times a minute, never 1,000 times, yet
    each time a session and its KV cache were built and dropped: TRICKLE_TRIM_S after the last trim, with a
    refusal since and FLOOD_QUIET_S quiet, the heap is trimmed; without a refusal it is not."""
    from edge_node import transport

    monkeypatch.setattr(transport, "TRICKLE_TRIM_S", 0.5)
    server, rogue = edge_and_rogue
    trimmed = _logged(caplog, "a trickle of refusals ended")
    with caplog.at_level(logging.INFO, logger="multispin.edge"):
        server.poll(time.monotonic() + 2 * transport.FLOOD_QUIET_S)  # past TRICKLE_TRIM_S, no refusal
        assert not trimmed()
        for _ in range(3):
            rogue.send_multipart([b"not json"])
        server.poll(time.monotonic() + 10 * transport.FLOOD_QUIET_S, stop=lambda: bool(trimmed()))
        assert len(trimmed()) == 1 and server.refused == 3
