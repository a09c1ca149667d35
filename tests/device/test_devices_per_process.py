"""Several emulated devices per process (`devices_per_process`, `device_node.host`): the same tokens as one
process per device, fewer processes, each device's own drafting time, and a dead host reported per device.

Live runs on the micro pair over ipc:// sockets; every process is started by the launcher and stopped by
its pid."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from support import profile_data

from device_node.gate import OPEN, Gate
from device_node.host import describe, exit_status, parse_devices
from device_node.options import ExitCode
from testbed.core.sampling import SamplingParams
from testbed.run.live import run_live
from testbed.run.profile import ProfileError, load_profile
from testbed.runtime.errors import TestbedError
from testbed.runtime.records import load_run
from testbed.wire import messages as M
from testbed.wire import protocol as P


def _profile(pair, n: int, k: int, **overrides):
    data = profile_data(pair, **overrides)
    data["devices_per_process"] = k
    data["scenario"]["devices"] = [{"name": f"d{i}", "distance_m": 100 + 50 * i, "draft_time_s": 0.001,
                                    "acceptance": 0.6} for i in range(n)]
    return load_profile(data)


def test_hosted_devices_draft_the_same_tokens_in_fewer_processes(micro_pair, tmp_path):
    # A pinned schedule, sampling at temperature 1 with the run's seeds: the tokens depend only on each
    # device's seeds, prompt and drafter state, never on which process drafted them.
    common = dict(rounds=8, pin={"mode": "UL", "draft_len": 3}, hardware={"d1": "laptop"}, deadline_s=5.0)
    outputs, metas = {}, {}
    for k in (1, 3):
        run_dir = tmp_path / f"k{k}"
        summary = run_live(_profile(micro_pair, 6, k, **common), run_dir, progress=False)
        assert summary["status"] == "complete"
        meta, records = load_run(run_dir)
        assert len(records) == 8 and all(not r["missed"] for r in records)
        outputs[k] = json.loads((run_dir / "outputs.json").read_text())
        metas[k] = meta
    names = [f"d{i}" for i in range(6)]
    for name in names:
        assert len(outputs[3][name]["output_ids"]) >= 8  # at least one token a round
        assert outputs[3][name]["output_ids"] == outputs[1][name]["output_ids"], name
    # Own seeds and KV cache per device: devices with the same prompt (round robin of two) still differ.
    assert outputs[3]["d0"]["output_ids"] != outputs[3]["d2"]["output_ids"]
    # 2 host processes of 3 devices instead of 6 device processes (plus the emulator); all ended with 0.
    assert metas[1]["processes"] == {"channel": 0, **{f"device-{n}": 0 for n in names}}
    assert metas[3]["processes"] == {"channel": 0, "devices-0": 0, "devices-1": 0}
    assert metas[3]["device_processes"] == {n: f"devices-{i // 3}" for i, n in enumerate(names)}
    # The slowed-down device (laptop: 1.5x) reports its own compute and the emulated extra.
    _, records = load_run(tmp_path / "k3")
    for r in records:
        m = r["devices"]["d1"]["measured"]
        assert m["compute_scale"] == 1.5 and m["emulated_extra_s"] == pytest.approx(0.5 * m["compute_s"])
        assert m["draft_s"] >= m["compute_s"] + m["emulated_extra_s"]
    # A hosted device says how long it waited for the others of its process (the virtual clock takes it
    # out); a device with a process of its own says nothing. How long depends on how the schedules happen to
    # arrive; `test_a_hosted_devices_wait_for_the_gate_is_reported_not_drafted` pins the figure itself.
    _, alone = load_run(tmp_path / "k1")
    assert all(x["measured"]["host_wait_s"] is None for r in alone for x in r["devices"].values())
    for r in records:
        waits = [r["devices"][n]["measured"]["host_wait_s"] for n in names]
        assert all(w is not None and w >= 0 for w in waits)


@contextlib.contextmanager
def _node_on_a_fake_edge(pair, tmp_path, gate, drafter=None, hardware=None):
    """A real device node in a thread of this process, registered with a fake edge (a ROUTER); yields the
    edge. The test's last message is `done`: the node must then end with 0."""
    from support import NAME, FakeEdge

    from device_node.drafter import OnnxDrafter
    from device_node.node import DeviceNode

    edge = FakeEdge(f"ipc://{tmp_path}/edge")
    node = DeviceNode(edge.sock.getsockopt_string(zmq.LAST_ENDPOINT), NAME,
                      drafter or OnnxDrafter(pair.draft_onnx), hardware, register_timeout_s=20, idle_timeout_s=20,
                      gate=gate)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("rc", node.run()), daemon=True)
    th.start()
    try:
        edge.register()
        yield edge
        edge.send(M.done("test over"))
        th.join(20)
        assert result.get("rc") == ExitCode.OK
    finally:
        node.close()
        edge.close()


def test_a_hosted_devices_wait_for_the_gate_is_reported_not_drafted(micro_pair, tmp_path):
    # A real device node on a shared gate, in this process, against a fake edge: while another device of the
    # process holds the gate for HOLD_S, a schedule and then a verdict arrive. Both waits are reported as
    # host_wait_s and neither is counted as drafting or correction.
    HOLD_S = 0.2
    gate = Gate()

    def held_while(send):  # the other device's work: HOLD_S with the gate, during which `send` happens
        with gate:
            send()
            time.sleep(HOLD_S)  # the behaviour under test: another device's work holding the gate

    with _node_on_a_fake_edge(micro_pair, tmp_path, gate) as edge:
        held_while(lambda: edge.send(M.schedule(0, "UL", 2, 0.2, 0.0, 5.0)))
        h, a = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
        assert h["type"] == "draft"
        t = h["timings"]
        assert HOLD_S - 0.02 <= t["host_wait_s"] <= HOLD_S + 0.5, t
        assert t["draft_s"] < HOLD_S / 2, t  # drafting two tokens of the micro pair: milliseconds
        held_while(lambda: edge.send(M.verdict(0, 2, 7)))
        h, _ = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
        assert h["type"] == "report" and h["token"] == 7
        assert HOLD_S - 0.02 <= h["timings"]["host_wait_s"] <= HOLD_S + 0.5, h["timings"]
        assert h["timings"]["correction_s"] < HOLD_S / 2
        # With the gate free nothing is waited for.
        edge.send(M.schedule(1, "UL", 2, 0.2, 0.0, 5.0))
        h, _ = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
        assert h["type"] == "draft" and h["timings"]["host_wait_s"] < HOLD_S / 2


class _Descheduled:
    """A drafter that, while drafting, is off the CPU for OFF_S (as a thread the system does not run):
    its wall time grows, its CPU time does not."""

    OFF_S = 0.25

    def __init__(self, drafter):
        self.inner = drafter

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, *args, **kwargs):
        time.sleep(self.OFF_S)  # the behaviour under test: a drafter descheduled for OFF_S
        return self.inner.draft(*args, **kwargs)


@pytest.mark.parametrize("hosted", [True, False])
def test_a_hosted_devices_drafting_time_is_its_cpu_time(micro_pair, tmp_path, hosted):
    # On a shared host the system runs the other devices' threads (and the other hosts) while one drafts:
    # the wall clock counts that, the thread's CPU clock does not. A hosted device reports the CPU time as
    # its compute (x its hardware's scale); a device with a process of its own reports the wall time.
    from device_node.drafter import OnnxDrafter
    from device_node.hardware import load_hardware

    drafter = _Descheduled(OnnxDrafter(micro_pair.draft_onnx))
    with _node_on_a_fake_edge(micro_pair, tmp_path, Gate() if hosted else OPEN, drafter,
                              load_hardware("laptop")) as edge:  # laptop: compute_scale 1.5
        edge.send(M.schedule(0, "UL", 2, 0.2, 0.0, 5.0))
        h, _ = edge.recv(skip=(P.HEARTBEAT, P.TX_START))
        t = h["timings"]
        assert h["type"] == "draft" and t["compute_scale"] == 1.5
        if hosted:
            assert t["compute_s"] < _Descheduled.OFF_S / 2, t  # two tokens of the micro pair: milliseconds
            assert t["emulated_extra_s"] == pytest.approx(0.5 * t["compute_s"])
            assert t["draft_s"] == pytest.approx(t["compute_s"] + t["emulated_extra_s"])
        else:
            assert t["compute_s"] >= _Descheduled.OFF_S, t
            assert t["draft_s"] >= t["compute_s"] + t["emulated_extra_s"]


def test_a_dead_host_is_reported_for_each_of_its_devices(micro_pair, tmp_path):
    run_dir = tmp_path / "run"

    def on_round(rec, server, launcher):
        if rec["round"] == 1:
            launcher.kill(launcher.device_label("d2"))  # the host of d2 and d3

    profile = _profile(micro_pair, 4, 2, rounds=6, deadline_s=1.5, max_misses=1)
    summary = run_live(profile, run_dir, progress=False, on_round=on_round)
    meta, records = load_run(run_dir)
    assert summary["status"] == "complete" and len(records) == 6
    assert records[2]["missed"] == ["d2", "d3"]  # both devices of the dead host, and only they
    assert all(sorted(r["devices"]) == ["d0", "d1"] and not r["missed"] for r in records[3:])
    assert meta["device_processes"] == {"d0": "devices-0", "d1": "devices-0", "d2": "devices-1", "d3": "devices-1"}
    assert meta["processes"]["devices-1"] == -9 and meta["processes"]["devices-0"] == 0


def test_a_host_whose_devices_cannot_start_names_each_device(micro_pair, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    data = profile_data(micro_pair, wait_for_devices_s=60, devices_per_process=2)
    data["model"]["draft_onnx"] = str(bad)
    t0 = time.monotonic()
    with pytest.raises(TestbedError) as exc:
        run_live(load_profile(data), tmp_path / "run", progress=False)
    assert time.monotonic() - t0 < 40  # not the 60 s of wait_for_devices_s
    text = str(exc.value)
    assert "devices d0, d1 (in devices-0, status 2" in text and "not a loadable ONNX model" in text


def test_the_gate_gives_a_device_its_own_time():
    gate, held = Gate(), threading.Event()

    def other_device():  # takes the gate while the first device sleeps, and keeps it for 0.3 s
        with gate:
            held.set()
            time.sleep(0.3)  # the behaviour under test: the other device's work

    with gate:
        threading.Thread(target=other_device).start()
        t0 = time.perf_counter()
        waited = gate.sleep(0.05)
        total = time.perf_counter() - t0
    assert held.is_set() and total >= 0.3
    assert waited == pytest.approx(total - 0.05, abs=0.04)  # the other device's work, not this one's sleep
    assert OPEN.sleep(0.0) == 0.0


def test_shared_drafters_keep_their_own_context(micro_pair):
    from device_node.drafter import OnnxDrafter

    alone = OnnxDrafter(micro_pair.draft_onnx)
    a = OnnxDrafter(micro_pair.draft_onnx)
    b = a.share()
    assert b.session is a.session
    params = SamplingParams()
    alone.reset([5, 6, 7])
    a.reset([5, 6, 7])
    b.reset([9, 8])
    for r in range(3):  # interleaved on one session, a drafts exactly what a drafter of its own does
        da = a.draft(3, params, np.random.default_rng(r), wire_bits=16)
        b.draft(2, params, np.random.default_rng(100 + r), wire_bits=16)
        ref = alone.draft(3, params, np.random.default_rng(r), wire_bits=16)
        assert da.tokens == ref.tokens and np.array_equal(da.q, ref.q)
        a.commit(1, 11)
        alone.commit(1, 11)
        b.commit(0, 12)
    assert a.context == alone.context and b.context[:2] == [9, 8] and a.context != b.context


def test_bad_settings_are_named():
    with pytest.raises(ProfileError, match="devices_per_process=0: must be >= 1"):
        load_profile(None, {"devices_per_process": 0})
    with pytest.raises(ProfileError, match="devices_per_process: 'many' is not allowed: must be a valid integer"):
        load_profile({"scenario": {"devices": [{"name": "d0"}]}, "devices_per_process": "many"})
    for text, fragment in (("{", "not JSON"), ("[]", "non-empty JSON list"), ('[{"name": "d0", "gpu": 1}]', "gpu"),
                           ('[{"name": "d0"}, {"name": "d0"}]', "appears twice"),
                           ('[{"name": "d0", "link_probe_period_s": 0}]', "link_probe_period_s")):
        with pytest.raises(ValueError, match=fragment):
            parse_devices(text)
    assert [d.name for d in parse_devices('[{"name": "a"}, {"name": "b", "hardware": "phone"}]')] == ["a", "b"]
    assert exit_status({"a": 0, "b": 7, "c": 3}) == 7 and exit_status({"a": 0}) == 0
    assert describe({"a": 2, "b": 2, "c": 0}, {"a": "cannot start: x", "b": "cannot start: x"}) == \
        "a, b: status 2 (cannot start: x); c: status 0 (the edge ended the run)"


def test_a_host_process_imports_no_torch():
    code = ("import sys, device_node.host; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
