"""A real device process against a fake edge that misbehaves: garbage, a schedule over an unverified draft,
an edge that vanishes (EDGE_GONE, or --reconnect to a new edge), a late edge, a draft model that does not
load. Every process started here is stopped by its pid."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from support import NAME, SAMPLING, FakeEdge, next_draft, serve_one_round, start_device, stop

from device_node.options import ExitCode
from testbed.run.launcher import child_env
from testbed.runtime.security import ServerKeys, generate_keys, stop_authenticators
from testbed.wire import messages as M
from testbed.wire import protocol as P


def garbage(rng: random.Random, vocab: int):
    """Malformed or out-of-place messages of every kind a peer could send (never a bye or a fatal error)."""
    values = [None, -1, 0, 1, 2**31, 2**63, 1e308, -0.5, "x", "", [], {}, [1, 2], {"a": 1}, True, "UL", 10**30]
    templates = [
        {"type": "schedule", "round": 1, "mode": "UL", "draft_len": 2, "ul_power_w": 0.1, "dl_power_w": 0.1,
         "deadline_s": 5.0},
        {"type": "verdict", "round": 1, "n_accepted": 0, "token": 3, "air": "dl"},
        {"type": "verdict", "round": 1, "dropped": True, "reason": "late"},
        {"type": "registered", "session": "s#9", "seed": 1, "sampling": SAMPLING, "bits_per_prob": 16,
         "on_air_vocab_size": None, "max_draft_len": 6, "tx_marker": False},
        {"type": "error", "message": "something", "round": None, "fatal": False},
        {"type": "heartbeat"}, {"type": "tx_start", "air": "dl", "marker": True}, {"type": "nonsense"},
    ]
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64))]
    if kind == 1:
        return [b'{"v": 1, "type": "schedule", "round": ' + rng.randbytes(8) + b"}"]
    if kind == 2:  # a header whose array table lies about the frames
        h = dict(rng.choice(templates[:2]))
        h["arrays"] = [{"name": "p", "dtype": rng.choice(["float16", "int8", "object"]),
                        "shape": rng.choice([[vocab], [2**40], [-1], "x", [1, 2, 3, 4, 5]])}]
        return [P.encode_header(h), rng.randbytes(rng.randrange(0, 32))]
    if kind == 3:  # a verdict with a distribution that is not one
        p = np.full(vocab, rng.choice([np.nan, np.inf, -1.0, 0.0, 2.0 / vocab]), np.float16)
        return P.encode({"type": "verdict", "round": rng.choice([0, 1, 7]), "n_accepted": 0, "token": None,
                         "air": "dl"}, {"p": p})
    h = dict(rng.choice(templates))
    if h["type"] == "error":
        h["fatal"] = rng.choice([False, None, "yes", 0])
    key = rng.choice(sorted(h))
    if kind == 4:
        h[key] = rng.choice(values)
    else:
        h.pop(key)
    if h.get("type") == "error" and h.get("fatal") is True:
        h["fatal"] = False  # a well-formed fatal error ends the device, as it should
    arrays = {"prompt_ids": np.array([1, 2], np.int32)} if h.get("type") == "registered" else None
    try:
        return P.encode(h, arrays)
    except P.ProtocolError:  # what our strict encoder will not send, a hostile peer still can
        return [json.dumps({"v": 1, **h}).encode()]


def test_device_survives_garbage_and_a_schedule_over_an_unverified_draft(micro_pair, tmp_path):
    from device_node.drafter import OnnxDrafter

    vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
    ep = f"ipc://{tmp_path}/edge"
    edge = FakeEdge(ep)
    log_path = tmp_path / "device.log"
    proc = start_device(micro_pair, ep, log_path)
    try:
        edge.register()
        token = serve_one_round(edge, 0, vocab)
        # A schedule while the draft of round 1 is unverified: refused with a log line, no crash; the
        # device then serves the next round from its committed context.
        edge.send(M.schedule(1, "UL", 3, 0.2, 0.0, 5.0))
        h, _ = next_draft(edge, 1)
        assert h["last_token"] == token
        edge.send(M.schedule(2, "DL", 3, 0.2, 0.0, 5.0))
        edge.send(M.verdict(1, 0, 4))  # round 1 was dropped on the device: refused too
        edge.send(M.schedule(3, "DL", 3, 0.2, 0.0, 5.0))
        # The refusal is said to the edge at once (its round need not wait for the deadline).
        h, _ = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
        assert h["type"] == "error" and h["round"] == 2 and not h["fatal"] and "unverified" in h["message"]
        h, _ = next_draft(edge, 3)
        assert h["last_token"] == token and h["mode"] == "DL"
        edge.send(M.dropped(3, "test"))
        # A few hundred malformed messages.
        rng = random.Random(9)
        n = 400
        for _ in range(n):
            edge.send(garbage(rng, vocab))
        # A clean session again (a fuzzed `registered` may have replaced ours), then a real round.
        edge.send(M.registered("s#1", [5, 6, 7, 8], seed=3, sampling=SAMPLING, bits_per_prob=16,
                               on_air_vocab_size=None, max_draft_len=6, tx_marker=False))
        serve_one_round(edge, 50, vocab)
        assert proc.poll() is None, "the device died"
        edge.send(M.done("test over"))
        assert proc.wait(20) == ExitCode.OK
    finally:
        stop(proc)
        edge.close()
    text = log_path.read_text()
    assert "Traceback" not in text
    assert "refused the schedule of round 2: the draft of round 1 is unverified" in text
    dropped = text.count("dropped a ")
    assert dropped >= n // 2, dropped  # one log line per refused message (valid fuzzed ones were served)


def test_device_leaves_with_edge_gone_when_the_edge_vanishes(micro_pair, tmp_path):
    ep = f"ipc://{tmp_path}/edge"
    edge = FakeEdge(ep)
    proc = start_device(micro_pair, ep, tmp_path / "device.log")
    try:
        edge.register(heartbeat_s=0.2, liveness=3)
        # The device heartbeats while nothing else is sent.
        h, _ = edge.recv(skip=())
        assert h["type"] == "heartbeat"
        for _ in range(5):  # alive edge: heartbeats both ways keep the device
            edge.send(M.heartbeat())
            time.sleep(0.2)  # the behaviour under test: an edge heartbeating every 0.2 s for longer than liveness
        assert proc.poll() is None
        edge.close()
        t0 = time.monotonic()
        code = proc.wait(20)
        gone_s = time.monotonic() - t0
    finally:
        stop(proc)
    assert code == ExitCode.EDGE_GONE == 7
    assert gone_s < 3.0, gone_s  # liveness window 0.6 s (+ start-up of the check)
    assert "was silent" in (tmp_path / "device.log").read_text()


def test_reconnecting_device_registers_again_with_a_new_edge(micro_pair, tmp_path):
    from device_node.drafter import OnnxDrafter

    vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
    ep = f"ipc://{tmp_path}/edge"
    edge = FakeEdge(ep)
    proc = start_device(micro_pair, ep, tmp_path / "device.log", "--reconnect")
    try:
        edge.register(heartbeat_s=0.2, liveness=3)
        serve_one_round(edge, 0, vocab)
        edge.close()  # the edge dies ...
        with pytest.raises(subprocess.TimeoutExpired):  # ... the device waits for it (liveness window 0.6 s)
            proc.wait(2.0)
        edge = FakeEdge(ep)  # ... a new edge on the same endpoint
        edge.register(heartbeat_s=0.2, liveness=3)
        serve_one_round(edge, 0, vocab)
        edge.send(M.done("test over"))
        assert proc.wait(20) == ExitCode.OK
    finally:
        stop(proc)
        edge.close()
    assert "reconnecting" in (tmp_path / "device.log").read_text()


def test_registration_is_retried_until_the_edge_is_up(micro_pair, tmp_path):
    ep = f"ipc://{tmp_path}/edge"
    proc = start_device(micro_pair, ep, tmp_path / "device.log")
    edge = None
    try:
        # The behaviour under test: the device starts first and its first register goes nowhere, so the edge
        # comes up 3 s late (a wait on the process: it ends at once, and fails, if the device gives up).
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(3.0)
        edge = FakeEdge(ep)
        edge.register()
        edge.send(M.done("test over"))
        assert proc.wait(20) == ExitCode.OK
    finally:
        stop(proc)
        if edge is not None:
            edge.close()


@pytest.mark.parametrize("bad", ["garbage", "missing"])
def test_a_device_that_cannot_load_its_model_tells_the_edge(micro_pair, tmp_path, bad):
    draft = tmp_path / "draft.onnx"
    if bad == "garbage":
        draft.write_bytes(b"this is not an onnx model")
    ep = f"ipc://{tmp_path}/edge"
    edge = FakeEdge(ep)
    proc = start_device(micro_pair, ep, tmp_path / "device.log", draft=draft)
    try:
        h, _ = edge.recv(skip=())
        assert proc.wait(20) == ExitCode.USAGE == 2
    finally:
        stop(proc)
        edge.close()
    err = M.parse_error(h)
    assert h["type"] == "error" and err.fatal and f"device {NAME} cannot start" in err.message
    assert str(draft) in err.message
    assert "Traceback" not in (tmp_path / "device.log").read_text()


def test_device_with_keys_is_a_curve_client_and_a_wrong_key_gets_nowhere(micro_pair, tmp_path):
    generate_keys(tmp_path / "keys", [NAME, "other"])
    ep = f"ipc://{tmp_path}/edge"
    edge = FakeEdge(ep, ServerKeys.load(tmp_path / "keys"))
    good = start_device(micro_pair, ep, tmp_path / "good.log", "--keys", str(tmp_path / "keys/clients" / NAME))
    plain = None
    try:
        edge.register()
        edge.send(M.done("test over"))
        assert good.wait(20) == ExitCode.OK
        # Without keys the CURVE server never hears the device: it gives up registering.
        plain = subprocess.Popen([sys.executable, "-m", "device_node.node", "--connect", ep, "--name", NAME,
                                  "--draft", str(micro_pair.draft_onnx), "--register-timeout", "2"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
        assert plain.wait(30) == ExitCode.NO_EDGE
        assert not edge.sock.poll(100)
    finally:
        for p in (good, plain):
            if p is not None:
                stop(p)
        edge.close()
        stop_authenticators()
    bad = subprocess.run([sys.executable, "-m", "device_node.node", "--connect", ep, "--name", NAME, "--draft",
                          str(micro_pair.draft_onnx), "--keys", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert bad.returncode == ExitCode.USAGE and "--keys" in bad.stderr and "Traceback" not in bad.stderr
