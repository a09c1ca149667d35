"""A whole run on a hostile LAN (issue 9): real processes (edge, channel emulator, two devices) on loopback
tcp, while a fuzzer throws malformed and forged messages at the edge, the emulator's frontend and its control
socket; and a run whose channel emulator is killed. Nothing may crash, the honest devices keep producing
rounds, and what was recorded stays on disk.

Every process started here is stopped by its pid; every address is 127.0.0.1."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest
import zmq
from support import child_pids, kill_all, pid_alive, profile_data, start_run, wait_rounds

from testbed.runtime.security import ClientKeys, generate_keys, make_client
from testbed.wire import messages as M
from testbed.wire import protocol as P

FUZZ_MESSAGES = 2000  # per run; the wire parsers see 10^5 in tests/wire/test_wire_fuzz.py's slow run


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _tcp_profile(path: Path, pair, rounds: int, **overrides) -> dict:
    edge, front, ctl = (f"tcp://127.0.0.1:{p}" for p in _free_ports(3))
    data = profile_data(pair, rounds=rounds, channel={"mode": "real"},
                         endpoints={"edge_bind": edge, "channel_frontend": front, "channel_control": ctl},
                         **overrides)
    path.write_text(json.dumps(data))  # JSON is YAML
    return data["endpoints"]


def _hostile_messages(rng: random.Random) -> list[list[bytes]]:
    """One of many shapes of bad input: garbage, JSON that kills naive parsers, and well-formed messages
    with forged or absurd fields."""
    kind = rng.randrange(9)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:
        return [b'{"v": 1, "type": "draft", "round": NaN}']
    if kind == 2:
        return [b'{"v": 1, "type": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}"]
    if kind == 3:
        return [b'{"v": 1, "type": "register", "round": ' + b"9" * 5000 + b"}"]
    if kind == 4:
        hdr = {"type": "draft", "round": rng.randrange(0, 5), "arrays": [["q", "float32", [2**32, 2**32]]]}
        return [P.encode_header(hdr), b"\x00" * 16]
    if kind == 5:
        return M.register(rng.choice(["d0", "d1", "intruder", "x" * 300]), rng.randrange(-5, 10**6), {})
    if kind == 6:
        return M.report(rng.randrange(0, 5), rng.randrange(0, 320), 2, {"correction_s": 1e300},
                        {"bytes": 10, "rate_bps": 1e6})
    if kind == 7:
        return [P.encode_header({"type": "stop"})]
    return [P.encode_header({"type": rng.choice(["schedule", "verdict", "bye", "heartbeat", "configure"]),
                             "round": rng.randrange(-3, 3), "air": rng.choice(["ul", "dl", "both"])})]


def _fuzz(endpoints: dict, n: int, seed: int = 0) -> None:
    """Send `n` hostile messages from many identities to the edge, the frontend and the control socket."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    try:
        socks = []
        for i, target in enumerate(("edge_bind", "channel_frontend")):
            for j in range(4):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 10_000)
                if j:  # one anonymous peer, the others with names (never the honest devices' own)
                    s.setsockopt(zmq.ROUTING_ID, f"fuzz{i}{j}".encode())
                s.connect(endpoints[target])
                socks.append(s)
        control = ctx.socket(zmq.DEALER)  # a DEALER, so an unanswered request does not block the fuzzer
        control.setsockopt(zmq.LINGER, 0)
        control.connect(endpoints["channel_control"])
        for k in range(n):
            frames = _hostile_messages(rng)
            if k % 10 == 9:
                control.send_multipart([b"", frames[0]])
            else:
                rng.choice(socks).send_multipart(frames)
            if k % 200 == 199:
                time.sleep(0.05)  # a burst, then a breath: the honest rounds interleave
        time.sleep(0.5)  # the last burst's breath, before the sockets go (part of the fuzzing's pace)
    finally:
        ctx.destroy(linger=0)


def _more_rounds_then_sigterm(proc, run_dir: Path, more: int) -> tuple[int, dict]:
    """Wait for `more` rounds beyond those on disk, stop the run with SIGTERM; (rounds waited for, summary of
    the interrupted run)."""
    after = (run_dir / "rounds.jsonl").read_text().count("\n") + more
    wait_rounds(run_dir.parent, after, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary.get("reason")
    return after, summary


def test_a_fuzzed_lan_does_not_stop_the_run(micro_pair, tmp_path):
    endpoints = _tcp_profile(tmp_path / "p.yaml", micro_pair, rounds=5000)
    proc = start_run(tmp_path / "p.yaml", tmp_path / "runs")
    children: list[int] = []
    try:
        run_dir = wait_rounds(tmp_path / "runs", 2, proc)
        children = child_pids(proc.pid)
        _fuzz(endpoints, FUZZ_MESSAGES)
        # The honest devices go on after the attack: ten more rounds, then the run is stopped (SIGTERM).
        after, summary = _more_rounds_then_sigterm(proc, run_dir, 10)
        # The attack reached both nodes: the edge refused its share, the emulator counted what it dropped.
        assert summary["refused_messages"] >= FUZZ_MESSAGES // 10, summary["refusals"]
        counters = summary["channel_stats"]["counters"]
        assert counters["control_refused"] + counters["malformed"] + counters["refused_identity"] > 50, counters
        records = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in records] == list(range(len(records))) and len(records) >= after
        # The honest devices took part in the rounds after the attack as before it.
        late = records[after - 10:after]
        assert all(not r["missed"] and r["measured"]["tokens"] >= 2 for r in late)
        assert all(not pid_alive(c) for c in children)
    finally:
        kill_all([proc, *children])


HEARTBEAT_S, LIVENESS = 1.0, 5  # the profile defaults, set here: the bound below is made of them
END_MARGIN_S = 3.0  # the edge's own exit (torch, sockets, meta.json) on a busy 2-core machine


@pytest.mark.parametrize("when", ["rounds flowing", "a round waiting for a paused device"])
def test_a_killed_channel_emulator_ends_the_run_within_the_liveness_window(micro_pair, tmp_path, when):
    """kill -9 of the emulator ends the run within heartbeat_s x liveness + 3 s (8 s; measured about 1.3 s;
    before the edge polled the emulator's process it took 24 s, and a round waiting on a draft its deadline
    more): the edge sees the process gone at its next tick, also in a round, and asks it nothing more."""
    _tcp_profile(tmp_path / "p.yaml", micro_pair, rounds=400, heartbeat_s=HEARTBEAT_S, liveness=LIVENESS,
                 deadline_s=60.0)  # a round waiting on a paused device would wait a minute for its draft
    proc = start_run(tmp_path / "p.yaml", tmp_path / "runs")
    children: list[int] = []
    paused = None
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        cmdlines = {c: Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0") for c in children}
        emulators = [c for c, argv in cmdlines.items() if b"channel_emulator.proxy" in argv]
        assert len(emulators) == 1
        if when != "rounds flowing":
            paused = next(c for c, argv in cmdlines.items() if b"device_node.node" in argv and b"d1" in argv)
            os.kill(paused, signal.SIGSTOP)
            # The edge is in a round once no round is recorded for a while: it waits for d1's draft.
            n, still_since = -1, time.monotonic()
            while time.monotonic() - still_since < 1.0:
                now_n = (run_dir / "rounds.jsonl").read_text().count("\n")
                if now_n != n:
                    n, still_since = now_n, time.monotonic()
                time.sleep(0.05)
        recorded = (run_dir / "rounds.jsonl").read_text().count("\n")
        t_kill = time.monotonic()
        os.kill(emulators[0], signal.SIGKILL)
        if paused is not None:
            os.kill(paused, signal.SIGCONT)  # a stopped process would hold its SIGTERM until then
        out, _ = proc.communicate(timeout=90)
        ended_s = time.monotonic() - t_kill
        bound = HEARTBEAT_S * LIVENESS + END_MARGIN_S
        assert ended_s < bound, f"the run took {ended_s:.1f} s (> {bound:g} s) to end after its emulator died"
        assert proc.returncode == 2, out[-3000:]  # a TestbedError, as for any failed run
        summary = json.loads((run_dir / "summary.json").read_text())
        meta = json.loads((run_dir / "meta.json").read_text())
        assert summary["status"] == meta["status"] == "failed", summary
        assert "channel emulator" in summary["reason"] and "exited (killed by SIGKILL" in summary["reason"], summary
        assert meta["processes"]["channel"] == -signal.SIGKILL
        # Every round that ended is on disk, whole and in order; none was torn by the end.
        raw = (run_dir / "rounds.jsonl").read_text()
        assert raw.endswith("\n")
        rounds = [json.loads(line)["round"] for line in raw.splitlines()]
        assert rounds == list(range(len(rounds))) and len(rounds) >= recorded
        assert not any(pid_alive(c) for c in children), "orphaned device processes"
    finally:
        if paused is not None and pid_alive(paused):
            os.kill(paused, signal.SIGCONT)
        kill_all([proc, *children])


pytestmark = pytest.mark.timeout(400)


def _curve_dealer(ctx: zmq.Context, endpoint: str, keys, routing_id: bytes | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    make_client(s, keys)
    s.connect(endpoint)
    return s


def test_a_keyed_run_refuses_strangers_borrowed_names_and_unauthenticated_stops(micro_pair, tmp_path):
    """`multispin run` with CURVE keys (real processes, loopback tcp): an unlisted key gets no answer from the
    emulator or the edge; d1's listed key under the routing id d0 speaks for d1 only (its register as d0 is
    refused at the edge) and takes nothing from d0; a stop on the control socket without the edge's key is
    refused. The honest devices go on producing rounds throughout."""
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    generate_keys(keys, ["d0", "d1"])
    generate_keys(strangers, ["d0"])
    server_public = ClientKeys.for_name(keys, "d0").server_public
    other = ClientKeys.for_name(strangers, "d0")
    stranger = ClientKeys(other.public, other.secret, server_public)  # knows the server key, is not listed
    endpoints = _tcp_profile(tmp_path / "p.yaml", micro_pair, rounds=5000, security={"keys": str(keys)})
    proc = start_run(tmp_path / "p.yaml", tmp_path / "runs")
    children: list[int] = []
    ctx = zmq.Context()
    try:
        run_dir = wait_rounds(tmp_path / "runs", 2, proc)
        children = child_pids(proc.pid)
        # An unlisted key, at the frontend and straight at the edge: the handshake fails, nothing answers.
        for target in ("channel_frontend", "edge_bind"):
            s = _curve_dealer(ctx, endpoints[target], stranger, b"d0")
            s.send_multipart(M.register("d0", 320, {}))
            assert not s.poll(1500), f"{target} answered an unlisted key"
        # d1's key under the routing id d0, at the emulator's frontend: d1's key is held by d1's live connection,
        # so the emulator refuses the second one itself (one error naming the reason) and moves no route: the
        # squatter gets nothing of d0's or of d1's.
        squatter = _curve_dealer(ctx, endpoints["channel_frontend"], ClientKeys.for_name(keys, "d1"), b"d0")
        squatter.send_multipart(M.register("d0", 320, {}))
        if squatter.poll(3000):
            refusal = P.decode_header(squatter.recv_multipart()[0])
            assert refusal["type"] == "error" and "in use by another connection" in refusal["message"], refusal
        assert not squatter.poll(1000)
        # A stop with a device's key on the control socket: refused; with no key at all: no handshake.
        for ctl_keys in (ClientKeys.for_name(keys, "d0"), None):
            ctl = _curve_dealer(ctx, endpoints["channel_control"], ctl_keys)
            ctl.send_multipart([b"", P.encode_header({"type": "stop"})])
            if ctl_keys is None:
                assert not ctl.poll(1500)
            else:
                assert ctl.poll(5000) and not json.loads(ctl.recv_multipart()[-1])["ok"]
        after, summary = _more_rounds_then_sigterm(proc, run_dir, 5)
        assert summary["channel_stats"]["counters"]["control_refused"] >= 1
        # The squatter was refused at the frontend, and nothing of it reached the edge or d1.
        assert summary["channel_stats"]["counters"]["duplicate_key"] >= 1, summary["channel_stats"]["counters"]
        d1_log = (run_dir / "logs" / "device-d1.log").read_text()
        assert "differs from the sender's name" not in d1_log
        records = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
        late = records[after - 5:after]
        assert all(not r["missed"] and set(r["devices"]) == {"d0", "d1"} for r in late), late[-1]["missed"]
        assert all(not pid_alive(c) for c in children)
    finally:
        ctx.destroy(linger=0)
        kill_all([proc, *children])
