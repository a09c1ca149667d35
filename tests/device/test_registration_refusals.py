"""A device against an edge that requires CURVE keys: without keys, or with a bundle from another key directory,
it is told why the edge does not answer instead of only timing out; with its keys it registers and measures
its clock's offset to the edge's (kept with its session). The real `DeviceNode` (micro pair drafter) in a
thread, the real edge (`EdgeServer`, fake verifier) in the test's thread, CURVE over tcp on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq
from support import make_server as make_edge
from support import wait_until

from device_node.drafter import OnnxDrafter
from device_node.node import DeviceNode
from device_node.options import ExitCode
from testbed.runtime.clock_offset import EXCHANGES
from testbed.runtime.security import ClientKeys, ServerKeys, generate_keys, make_server, stop_authenticators


@pytest.fixture
def keyed_edge(tmp_path, micro_pair):
    keys = tmp_path / "keys"
    generate_keys(keys, ["dev0"])
    generate_keys(tmp_path / "other", ["dev0"])
    vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
    server = make_edge("tcp://127.0.0.1:0", ("dev0",), vocab=vocab, keys_dir=str(keys))
    yield server, keys, tmp_path / "other"
    server.close()
    stop_authenticators()


def run_device(server, micro_pair, keys, timeout_s: float, until=None):
    """Run dev0 in a thread while the edge serves in this one; its exit code."""
    node = DeviceNode(server.endpoint, "dev0", OnnxDrafter(micro_pair.draft_onnx), keys=keys,
                      register_timeout_s=timeout_s, register_retry_s=0.5, calibrate_tokens=0)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", node.run()), daemon=True)
    thread.start()
    try:
        server.poll(time.monotonic() + timeout_s + 10, stop=lambda: not thread.is_alive() or (until and until()))
        if until is not None:
            server.finish("test over")  # bye: the device exits
            server.poll(time.monotonic() + 5, stop=lambda: not thread.is_alive())
        thread.join(5)
        return result.get("code")
    finally:
        node.close()


@pytest.mark.parametrize("bundle, device_says, edge_says", [
    (None, "the edge requires CURVE keys and this device has none", "no CURVE keys"),
    ("other", "the server key in this device's --keys is not the edge's", "its server key is not this edge's"),
])
def test_a_device_without_the_edge_keys_is_told_why(keyed_edge, micro_pair, caplog, bundle, device_says,
                                                    edge_says):
    server, _, other = keyed_edge
    caplog.set_level(logging.INFO)
    keys = None if bundle is None else ClientKeys.for_name(other, "dev0")
    code = run_device(server, micro_pair, keys, timeout_s=2.0)
    assert code == ExitCode.NO_EDGE
    device_lines = [r.getMessage() for r in caplog.records if r.name == "multispin.device" and r.levelno >= 40]
    # Said at the first retry, and again in the final line.
    assert any("does not answer: " in m and device_says in m for m in device_lines), device_lines
    assert any("no answer from the edge" in m and device_says in m for m in device_lines), device_lines
    edge_lines = [r.getMessage() for r in caplog.records if "refused a CURVE handshake" in r.getMessage()]
    assert len(edge_lines) == 1 and "from 127.0.0.1" in edge_lines[0] and edge_says in edge_lines[0], edge_lines
    assert "dev0" not in server.sessions


def test_with_its_keys_a_device_registers_and_measures_its_clock(keyed_edge, micro_pair, caplog):
    server, keys, _ = keyed_edge
    caplog.set_level(logging.INFO)
    code = run_device(server, micro_pair, ClientKeys.for_name(keys, "dev0"), timeout_s=20.0,
                      until=lambda: "dev0" in server.sessions and server.sessions["dev0"].clock is not None)
    assert code == ExitCode.OK
    clock = server.roster.finished.get("dev0", server.sessions.get("dev0")).clock
    assert clock["exchanges"] == EXCHANGES
    # One host, one clock: the true offset is 0, within the measurement's bound.
    assert abs(clock["offset_s"]) <= clock["uncertainty_s"] + 1e-6 and not clock["offset_exceeds_uncertainty"]
    assert not any("refused a CURVE handshake" in r.getMessage() for r in caplog.records)


def test_a_socket_whose_handshake_failed_does_not_block_the_device(tmp_path, micro_pair):
    """libzmq gives up on a connection refused for a mechanism mismatch: a DEALER left without a peer would block
    a send for good. The register on such a socket is not sent, and the next try opens a fresh socket. (A bare
    CURVE ROUTER that never reads: its refusal is the mismatch, not a hang-up.)"""
    generate_keys(tmp_path / "keys", ["dev0"])
    ctx = zmq.Context()
    edge = ctx.socket(zmq.ROUTER)
    edge.setsockopt(zmq.LINGER, 0)
    make_server(edge, ServerKeys.load(tmp_path / "keys"))
    port = edge.bind_to_random_port("tcp://127.0.0.1")
    drafter = OnnxDrafter(micro_pair.draft_onnx)
    try:
        for attempt in range(4):  # (whether the refused socket keeps a pipe is a race: several tries)
            node = DeviceNode(f"tcp://127.0.0.1:{port}", "dev0", drafter, register_timeout_s=1.0,
                              register_retry_s=0.5, calibrate_tokens=0)
            result = {}
            wait_until(node.handshake.poll, 10, "the first socket's handshake failing")
            thread = threading.Thread(target=lambda n=node, r=result: r.setdefault("code", n.run()), daemon=True)
            thread.start()
            thread.join(10)
            # (a blocked device is left as it is: closing its socket under the blocked send would abort)
            assert not thread.is_alive(), f"the device blocked on a send (attempt {attempt})"
            node.close()
            assert result["code"] == ExitCode.NO_EDGE
    finally:
        edge.close()
        stop_authenticators(ctx)
        ctx.term()
