"""The device node against a test-driven edge socket: registration, drafting in both modes, a dropped
round, DL-mode correction, refusal of a bad verdict, and the end of the run (real ONNX drafter, real
ZeroMQ sockets on ipc://)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import zmq

from device_node.options import ExitCode
from testbed.wire import messages as M
from testbed.wire import protocol as P


@contextlib.contextmanager
def device_against_test_edge(tmp_path, name: str, drafter, hardware=None):
    """A DeviceNode in a thread against a ROUTER the test drives: yields (node, recv, send). `recv(timeout_ms,
    expect=True)` returns the next message decoded (None after the timeout when not `expect`). At the end the
    edge says `bye` and the device must exit OK."""
    from device_node.node import DeviceNode

    ep = f"ipc://{tmp_path}/edge"
    edge = zmq.Context.instance().socket(zmq.ROUTER)
    edge.setsockopt(zmq.LINGER, 0)
    edge.bind(ep)
    node = DeviceNode(ep, name, drafter, hardware, register_timeout_s=20, idle_timeout_s=20)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("rc", node.run()), daemon=True)
    th.start()

    def recv(timeout_ms=20_000, expect=True):
        if not edge.poll(timeout_ms):
            assert not expect, "device did not answer"
            return None
        ident, *frames = edge.recv_multipart()
        assert ident == name.encode()
        return P.decode(frames)

    def send(frames):
        edge.send_multipart([name.encode(), *frames])

    try:
        yield node, recv, send
        send(M.done("test over"))
        th.join(20)
        assert result.get("rc") == ExitCode.OK
    finally:
        node.close()
        edge.close(linger=0)


def test_device_node_protocol(micro_pair, tmp_path):
    from device_node.drafter import OnnxDrafter
    from device_node.hardware import load_hardware

    drafter = OnnxDrafter(micro_pair.draft_onnx)
    with device_against_test_edge(tmp_path, "dev-x", drafter, load_hardware("edge-class")) as (_, recv, send):
        h, _ = recv()
        assert h["type"] == "register" and h["vocab_size"] == drafter.vocab_size
        prompt = [5, 6, 7, 8]
        send(M.registered("s#0", prompt, seed=3, sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                          bits_per_prob=16, on_air_vocab_size=1000, max_draft_len=6, tx_marker=False))
        V = drafter.vocab_size
        # Round 0, UL mode: q rows padded to the on-air size; then the edge drops the round.
        send(M.schedule(0, "UL", 3, 0.2, 0.0, 5.0))
        h, a = recv()
        d = M.parse_draft(h, a, mode="UL", draft_len=3, vocab_size=V, bits_per_prob=16, on_air_vocab=1000)
        assert a["q"].shape == (3, 1000) and d.last_token == 8 and h["timings"]["draft_s"] > 0
        first_tokens = d.tokens.tolist()
        send(M.dropped(0, "late"))
        # Round 0 again (same seed, same round): after the reset the device drafts the same tokens.
        send(M.schedule(0, "DL", 3, 0.2, 0.1, 5.0))
        h, a = recv()
        d = M.parse_draft(h, a, mode="DL", draft_len=3, vocab_size=V, bits_per_prob=16, on_air_vocab=1000)
        assert d.tokens.tolist() == first_tokens and "q" not in a
        # A verdict for another round is refused; the device keeps serving.
        send(M.verdict(9, 0, 1))
        # DL-mode rejection at position 0 with p one-hot on a token the draft gave q < 1: the correction
        # from norm(max(0, p - q)) must be that token.
        target = (first_tokens[0] + 1) % V
        p = np.zeros(V, np.float16)  # a wire row (the edge sends to_wire_precision rows)
        p[target] = 1.0
        send(M.verdict(0, 0, None, p_row=p, bits_per_prob=16, on_air_vocab=1000))
        h, _ = recv()
        assert h["type"] == "report" and h["round"] == 0 and h["n_accepted"] == 0 and h["token"] == target
        # Next round: the upload carries the correction as the last committed token.
        send(M.schedule(1, "UL", 2, 0.2, 0.0, 5.0))
        h, a = recv()
        assert h["last_token"] == target and h["round"] == 1


def test_device_without_an_edge_exits_with_no_edge(micro_pair, tmp_path):
    from device_node.drafter import OnnxDrafter
    from device_node.node import DeviceNode

    node = DeviceNode(f"ipc://{tmp_path}/nobody", "dev-y", OnnxDrafter(micro_pair.draft_onnx), register_timeout_s=0.3)
    try:
        assert node.run() == ExitCode.NO_EDGE == 3
    finally:
        node.close()


def test_device_node_drafts_the_schedule_inside_a_verdict(micro_pair, tmp_path):
    # A device lists schedule_in_verdict; a verdict that carries the next round's schedule (`next`) is reported,
    # then drafted at once; a malformed `next` costs that schedule only (the report still comes).
    from device_node.drafter import OnnxDrafter

    with device_against_test_edge(tmp_path, "dev-y", OnnxDrafter(micro_pair.draft_onnx)) as (node, recv, send):
        h, _ = recv()
        assert M.parse_register(h).features == {M.SCHEDULE_IN_VERDICT, M.CLOCK_OFFSET}
        send(M.registered("s#0", [5, 6, 7], seed=1, sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                          bits_per_prob=16, on_air_vocab_size=None, max_draft_len=6, tx_marker=False))
        send(M.schedule(0, "UL", 2, 0.2, 0.0, 5.0))
        assert recv()[0]["round"] == 0
        send(M.verdict(0, 2, 11, next_schedule=M.schedule_fields(1, "DL", 3, 0.2, 0.1, 5.0)))
        h, _ = recv()
        assert (h["type"], h["round"], h["token"]) == ("report", 0, 11)  # the report before the next draft
        h, a = recv()
        assert (h["type"], h["round"], h["mode"], h["last_token"]) == ("draft", 1, "DL", 11) and a["tokens"].size == 3
        send(M.verdict(1, 3, 12, next_schedule=M.schedule_fields(2, "XX", 2, 0.2, 0.0, 5.0)))
        h, _ = recv()
        assert (h["type"], h["round"], h["token"]) == ("report", 1, 12)
        assert recv(timeout_ms=500, expect=False) is None  # no draft for a schedule it refused
        send(M.schedule(2, "UL", 2, 0.2, 0.0, 5.0))
        h, _ = recv()
        assert (h["type"], h["round"], h["last_token"]) == ("draft", 2, 12)
        assert node.dropped_messages == 1
