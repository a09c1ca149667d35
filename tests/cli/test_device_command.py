"""The device command `multispin edge` prints is complete and runnable: parsed from the edge's output and run as
it is, a real device process registers and the run completes. Run without its `--keys`, the same device is
told that the edge requires keys, and the edge logs the refused handshake with the device's address within a
second (real processes, CURVE over tcp on 127.0.0.1)."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import threading
import time

import pytest
import yaml
from support import CLI, kill_all, profile_data, wait_until

from testbed.runtime.security import generate_keys

pytestmark = pytest.mark.slow  # an edge with a model pair and a device process: ~30 s on a shared host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Output(threading.Thread):
    """A process's output lines as they come, each with when it came."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.proc, self.lines = proc, []

    def run(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def test_the_printed_device_command_runs_and_a_keyless_device_is_told(micro_pair, tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys, ["d0"])
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    data = profile_data(micro_pair, rounds=2, channel={"mode": "passthrough"}, wait_for_devices_s=90,
                        security={"keys": str(keys)})
    data["scenario"]["devices"] = data["scenario"]["devices"][:1]
    prof = tmp_path / "lan.yaml"
    prof.write_text(yaml.safe_dump(data))
    edge = subprocess.Popen([*CLI, "edge", "--profile", str(prof), "--bind", endpoint, "--runs-dir",
                             str(tmp_path / "runs"), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out = Output(edge)
    out.start()
    procs = [edge]
    try:
        printed = wait_until(lambda: [line for _, line in out.lines if line.startswith("  multispin device ")],
                             120, "the edge's device command")
        assert len(printed) == 1
        argv = shlex.split(printed[0])
        assert argv[:2] == ["multispin", "device"]
        options = dict(zip(argv[2::2], argv[3::2]))
        assert options["--connect"] == endpoint and options["--name"] == "d0"
        assert options["--draft"] == str(micro_pair.draft_onnx.resolve())
        assert options["--keys"] == str((keys / "clients" / "d0").resolve())

        # The edge binds once its model is loaded: wait for the port to listen (read from /proc, no connection).
        wait_until(lambda: listening(int(endpoint.rpartition(":")[2])), 120, "the edge listening")
        # Without its --keys: the device says the edge requires keys; the edge names the refused address.
        keyless = [a for i, a in enumerate(argv) if a != "--keys" and (i == 0 or argv[i - 1] != "--keys")]
        bad = subprocess.run([*CLI, *keyless[1:], "--register-timeout", "3"], capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 3, bad.stderr[-2000:]  # no answer within --register-timeout
        assert "the edge requires CURVE keys and this device has none" in bad.stderr
        assert "--keys DIR" in bad.stderr
        refused = wait_until(lambda: [line for _, line in out.lines
                                      if "refused a CURVE handshake from 127.0.0.1" in line], 10,
                             "the edge's log line")
        assert "no CURVE keys" in refused[0]
        # Within a second of the device's first try: its socket connects as the process starts, its first log
        # line (the drafter's timing) comes a fraction of a second later (both logs stamp the same host's clock).
        tried = logged_at(next(line for line in bad.stderr.splitlines() if "drafting timed at" in line))
        assert abs(logged_at(refused[0]) - tried) < 1.0, (refused[0], tried)
        assert len(refused) == 1  # its retries are counted in one line per interval, not one line each

        # As printed: registers, and the run completes.
        device = subprocess.Popen([*CLI, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(device)
        device_out, _ = device.communicate(timeout=240)
        assert device.returncode == 0, device_out[-3000:]
        assert edge.wait(120) == 0, out.text()[-3000:]
        # Its clock's offset to the edge's, measured after registering, is in the run's per-device records.
        clock = json.loads(next((tmp_path / "runs").glob("*/outputs.json")).read_text())["d0"]["clock"]
        assert clock["exchanges"] == 5 and clock["offset_exceeds_uncertainty"] is False  # one host, one clock
    finally:
        kill_all(procs)


def listening(port: int) -> bool:
    with open("/proc/net/tcp") as f:
        rows = [row.split() for row in f.read().splitlines()[1:]]
    return any(int(r[1].rpartition(":")[2], 16) == port and r[3] == "0A" for r in rows)


def logged_at(line: str) -> float:
    """The time of a log line ('2026-01-02 03:04:05,678 name LEVEL ...'), in seconds since the epoch."""
    stamp = " ".join(line.split()[:2])
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:23]) / 1000
