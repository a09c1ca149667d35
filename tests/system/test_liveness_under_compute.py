"""Issue 30, item 1: liveness does not depend on compute.

An edge whose verification outlasts the liveness window many times over, and a device whose drafting does, keep
every session: heartbeats go out from a heartbeat thread while the node computes, and what arrives meanwhile
counts as a sign of life. Real processes (micro pair): the edge in the test's thread with the real target behind a
slowed wrapper, the devices as `device_node.node` processes. The tokens are those of the same run unslowed
(temperature 0: the target's greedy continuation, whatever the draft lengths).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
from support import ROOT

from edge_node.controller import Controller
from edge_node.server import EdgeServer
from edge_node.verifier import BatchedVerifier, load_target
from testbed.core.sampling import SamplingParams
from testbed.run.launcher import child_env
from testbed.run.scenario_file import load_scenario

pytestmark = pytest.mark.live

HEARTBEAT_S, LIVENESS = 0.2, 3
WINDOW_S = HEARTBEAT_S * LIVENESS
SLOW_S = 3.5 * WINDOW_S  # each slowed call: well past the liveness window
ROUNDS = 4
NAMES = ("dev0", "dev1")
PROMPTS = [[5, 17, 42, 9], [7, 11, 3]]

# A device process whose drafter sleeps SLOW_S before each draft (it stands for a slow device's compute).
SLOW_DEVICE = """
import sys, time
from device_node.drafter import OnnxDrafter
from device_node.node import DeviceNode

class Slow:
    def __init__(self, inner, delay_s):
        self.inner, self.delay_s = inner, delay_s
    def __getattr__(self, key):
        return getattr(self.inner, key)
    def draft(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self.inner.draft(*args, **kwargs)

connect, name, path, delay_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
node = DeviceNode(connect, name, Slow(OnnxDrafter(path), delay_s), register_timeout_s=60)
try:
    sys.exit(int(node.run()))
finally:
    node.close()
"""


class SlowVerifier:
    """The real target, each verification first spinning `delay_s` with the GIL held (a slow target: the
    behaviour under test; spinning, not sleeping, so that the heartbeat thread has to win the GIL too)."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, key):
        return getattr(self.inner, key)

    def verify(self, items):
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:
            pass
        return self.inner.verify(items)


@pytest.fixture(scope="module")
def target(micro_pair):
    return load_target(micro_pair.target_dir, device="cpu")


def _run(micro_pair, target, tmp_path, *, verify_delay_s=0.0, slow_device: str | None = None,
         deadline_s: float = 5 * SLOW_S):
    """One run of ROUNDS rounds with two device processes; returns (records, outputs, device exit codes, the
    longest silence of each device the edge saw, the edge log)."""
    verifier = BatchedVerifier(target, device="cpu")
    scen = load_scenario({"bits_per_prob": 16, "max_draft_len": 4, "vocab_size": verifier.vocab_size,
                          "devices": [{"name": n, "distance_m": 100 + 50 * i, "draft_time_s": 0.01,
                                       "acceptance": 0.8} for i, n in enumerate(NAMES)]})
    ep = f"ipc://{tmp_path}/edge"
    server = EdgeServer(ep, SlowVerifier(verifier, verify_delay_s) if verify_delay_s else verifier,
                        scenario=scen, controller=Controller(scen), prompts=PROMPTS,
                        sampling=SamplingParams(temperature=0.0), vocab_size=verifier.vocab_size, seed=3,
                        deadline_s=deadline_s, max_misses=2, heartbeat_s=HEARTBEAT_S, liveness=LIVENESS)
    procs, logs = {}, {}
    for name in NAMES:
        logs[name] = tmp_path / f"{name}.log"
        if name == slow_device:
            argv = [sys.executable, "-c", SLOW_DEVICE, ep, name, str(micro_pair.draft_onnx), str(SLOW_S)]
        else:
            argv = [sys.executable, "-m", "device_node.node", "--connect", ep, "--name", name,
                    "--draft", str(micro_pair.draft_onnx), "--register-timeout", "60"]
        procs[name] = subprocess.Popen(argv, stdout=open(logs[name], "wb"), stderr=subprocess.STDOUT,
                                       env=child_env(), cwd=ROOT)
    arrivals: dict[str, list[float]] = {n: [] for n in NAMES}  # each message's arrival stamp, as the edge took it
    dispatch = server.inbox.dispatch

    def recording(frames, t_arr, *args, **kw):
        arrivals.setdefault(frames[0].bytes.decode(), []).append(t_arr)
        return dispatch(frames, t_arr, *args, **kw)

    server.inbox.dispatch = recording
    handler = _Collect()
    logging.getLogger("multispin.edge").addHandler(handler)
    try:
        assert server.wait_for_devices(list(NAMES), 90) == []
        t_start = time.monotonic()
        records = server.run(ROUNDS)
        t_end = time.monotonic()
        outputs = {n: list(s.output_ids) for n, s in server.finish().items()}
        codes = {n: p.wait(30) for n, p in procs.items()}
    finally:
        logging.getLogger("multispin.edge").removeHandler(handler)
        server.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    device_logs = {n: path.read_text(errors="replace") for n, path in logs.items()}
    # The longest silence of each device as the edge counted it: the largest gap between its messages' arrival
    # stamps during the rounds (held messages keep the stamps the heartbeat thread gave them).
    silence = {}
    for name in NAMES:
        stamps = [t_start] + [t for t in arrivals[name] if t_start <= t <= t_end] + [t_end]
        silence[name] = max(b - a for a, b in zip(stamps, stamps[1:]))
    return records, outputs, codes, silence, "\n".join(handler.lines), device_logs


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def unslowed(micro_pair, target, tmp_path_factory):
    return _run(micro_pair, target, tmp_path_factory.mktemp("unslowed"))


def _same_tokens(outputs: dict, reference: dict) -> None:
    for name in NAMES:
        a, b = outputs[name], reference[name]
        n = min(len(a), len(b))
        assert n >= ROUNDS, (name, a, b)  # every round commits at least one token
        assert a[:n] == b[:n], (name, a, b)


def _all_stayed(records, codes, edge_log, device_logs) -> None:
    assert [r["round"] for r in records] == list(range(ROUNDS)), edge_log
    assert all(not r["missed"] and set(r["devices"]) == set(NAMES) for r in records), edge_log
    assert "left the session" not in edge_log and "re-registered" not in edge_log, edge_log
    assert codes == dict.fromkeys(NAMES, 0), (codes, device_logs)  # bye from the edge: not EDGE_GONE (7)
    for text in device_logs.values():
        assert "silent for" not in text and "registering again" not in text, text


def test_a_verification_past_the_liveness_window_keeps_every_device(micro_pair, target, tmp_path, unslowed):
    # The drafts come within the deadline; the verification makes every round outlast it.
    records, outputs, codes, silence, edge_log, device_logs = _run(micro_pair, target, tmp_path,
                                                                    verify_delay_s=SLOW_S, deadline_s=SLOW_S / 2)
    _all_stayed(records, codes, edge_log, device_logs)
    assert all(r["measured"]["verify_s"] >= SLOW_S for r in records)  # each round did outlast the window
    # A round past its deadline is logged and recorded, and costs no device its session.
    assert all(r.get("past_deadline") is True for r in records)
    assert f"round {ROUNDS - 1} took" in edge_log and "past the deadline" in edge_log
    # What the devices sent during the verifications (their heartbeats) counted: none looked silent past the window.
    assert max(silence.values()) < WINDOW_S + HEARTBEAT_S, silence
    _same_tokens(outputs, unslowed[1])
    assert not any(r.get("past_deadline") for r in unslowed[0])


def test_a_draft_past_the_liveness_window_keeps_the_device(micro_pair, target, tmp_path, unslowed):
    records, outputs, codes, silence, edge_log, device_logs = _run(micro_pair, target, tmp_path,
                                                                    slow_device="dev0")
    _all_stayed(records, codes, edge_log, device_logs)
    assert all(r["devices"]["dev0"]["measured"]["draft_s"] >= SLOW_S for r in records), records[0]["devices"]
    # The slow device heartbeats while it drafts: the edge never saw it silent for the window.
    assert silence["dev0"] < WINDOW_S, silence
    _same_tokens(outputs, unslowed[1])
