"""Several emulated devices in one process: one `DeviceNode` per device, each in its own thread with its own
ZeroMQ identity (DEALER), KV cache and seeds, all drafting on one onnxruntime session.

numpy, onnxruntime, pyzmq and pyyaml only, like `device_node.node`: no torch.

Run: ``python -m device_node.host --connect tcp://HOST:PORT --draft draft.onnx --devices JSON`` where JSON is
a list of devices, e.g. ``[{"name": "d0"}, {"name": "d1", "hardware": "phone", "keys": "DIR",
"link_probe": "file:/tmp/d1.snr", "link_probe_period_s": 1.0}]``. `multispin run` starts such processes
for a profile's `devices_per_process` (`testbed.run.launcher.Launcher.start_host`).

Timing: the devices of a process handle their messages one at a time (`device_node.gate.Gate`); a
device's drafting time is measured inside the gate, so it is its own compute, not its wait for the shared
session, and its hardware profile's slowdown is slept with the gate open. Each device ends as a device
process would (`ExitCode`); a device that cannot start (its keys, its hardware profile) tells the edge and
ends alone. The process exits with 0 when every device did, else with the status of the first device
that did not; its last log line lists every device's status.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from dataclasses import dataclass, fields

from device_node.gate import Gate
from device_node.hardware import load_hardware
from device_node.link_probe import BackgroundProbe, NoneProbe, make_probe
from device_node.node import DeviceNode, tell_edge
from device_node.options import EXIT_HELP, ExitCode, endpoint
from testbed.runtime.security import ClientKeys, SecurityError

log = logging.getLogger("multispin.host")


@dataclass(frozen=True)
class HostedDevice:
    """One device of a host process: what `device_node.node` takes as --name, --hardware, --keys and
    --link-probe / --link-probe-period-s."""

    name: str
    hardware: str | None = None
    keys: str | None = None
    link_probe: str = "none"
    link_probe_period_s: float = 1.0


def parse_devices(text: str) -> list[HostedDevice]:
    """--devices: a JSON list of device objects; a ValueError names the entry and the field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--devices: not JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ValueError("--devices: must be a non-empty JSON list of objects such as {\"name\": \"d0\"}")
    allowed = {f.name for f in fields(HostedDevice)}
    out, seen = [], set()
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ValueError(f"--devices[{i}]: must be an object with a name, not {entry!r}")
        extra = sorted(set(entry) - allowed)
        if extra:
            raise ValueError(f"--devices[{i}]: unknown field(s) {extra}; allowed: {sorted(allowed)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"--devices[{i}].name: {name!r} is not allowed: must be a non-empty string")
        if name in seen:
            raise ValueError(f"--devices[{i}].name: {name!r} appears twice; each device needs its own identity")
        seen.add(name)
        for key in ("hardware", "keys"):
            if entry.get(key) is not None and not isinstance(entry[key], str):
                raise ValueError(f"--devices[{i}].{key}: {entry[key]!r} is not allowed: must be a string")
        if not isinstance(entry.get("link_probe", "none"), str):
            raise ValueError(f"--devices[{i}].link_probe: {entry['link_probe']!r} is not allowed: must be a SPEC")
        period = entry.get("link_probe_period_s", 1.0)
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not period > 0:
            raise ValueError(f"--devices[{i}].link_probe_period_s: {period!r} is not allowed: must be a number > 0")
        out.append(HostedDevice(**entry))
    return out


class DeviceHost:
    """The devices of one process; `run` serves them all until each has ended and returns their statuses."""

    def __init__(self, connect: str, draft: str, devices: list[HostedDevice], *, register_timeout_s: float = 120.0,
                 reconnect: bool = False, tx_marker: bool = True, serve_runs: bool = False):
        self.connect, self.draft, self.devices = connect, draft, devices
        self.serve_runs = serve_runs  # every device waits for the next run after a bye (`device_node.next_run`)
        self.register_timeout_s, self.reconnect, self.tx_marker = register_timeout_s, reconnect, tx_marker
        self.gate = Gate()
        self.codes: dict[str, int] = {}
        self.reasons: dict[str, str] = {}  # why a device could not start
        self._sessions: dict[int, object] = {}  # onnxruntime intra-op threads -> the loaded drafter

    def _drafter(self, threads: int):
        """A drafter of its own on the process's one session for these intra-op threads (loaded once)."""
        from device_node.drafter import OnnxDrafter  # onnxruntime + numpy only

        if threads not in self._sessions:
            self._sessions[threads] = OnnxDrafter(self.draft, threads=threads)
        return self._sessions[threads].share()

    def _prepare(self, dev: HostedDevice) -> tuple[DeviceNode, BackgroundProbe | None] | None:
        """The device's node (None when it cannot start: it has told the edge why, and its status is set)."""
        keys = None
        if dev.keys:
            try:
                keys = ClientKeys.load(dev.keys)
            except SecurityError as exc:  # without keys the edge cannot even be told
                log.error("%s: keys: %s", dev.name, exc)
                self.codes[dev.name], self.reasons[dev.name] = ExitCode.USAGE, f"keys: {exc}"
                return None
        try:
            probe = make_probe(dev.link_probe)
            probe_thread = None if isinstance(probe, NoneProbe) else BackgroundProbe(probe, dev.link_probe_period_s)
            hardware = load_hardware(dev.hardware)
            drafter = self._drafter(hardware.threads)
        except (ValueError, FileNotFoundError) as exc:  # the message names the file, the profile or the SPEC
            log.error("%s: cannot start: %s", dev.name, exc)
            tell_edge(self.connect, dev.name, f"device {dev.name} cannot start: {exc}", keys,
                      wait_s=min(5.0, self.register_timeout_s))
            self.codes[dev.name], self.reasons[dev.name] = ExitCode.USAGE, f"cannot start: {exc}"
            return None
        node = DeviceNode(self.connect, dev.name, drafter, hardware, register_timeout_s=self.register_timeout_s,
                          tx_marker=self.tx_marker, keys=keys, reconnect=self.reconnect, serve_runs=self.serve_runs,
                          link_probe=probe_thread.start() if probe_thread else None, gate=self.gate)
        return node, probe_thread

    def _serve(self, name: str, node: DeviceNode, probe: BackgroundProbe | None) -> None:
        try:
            self.codes[name] = node.run()
        except Exception:  # one device's bug ends that device, not the others of the process
            log.exception("%s: unexpected error", name)
            self.codes[name] = 1
        finally:
            node.close()
            if probe is not None:
                probe.stop()

    def run(self) -> dict[str, int]:
        threads = []
        for dev in self.devices:
            prepared = self._prepare(dev)
            if prepared is None:
                continue
            # Daemon threads: a signal that ends the main thread ends the process, as it ends a device process.
            t = threading.Thread(target=self._serve, args=(dev.name, *prepared), name=dev.name, daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            while t.is_alive():
                t.join(0.5)  # in slices: the main thread stays responsive to signals
        return {d.name: self.codes.get(d.name, 1) for d in self.devices}


def exit_status(codes: dict[str, int]) -> int:
    """0 when every device ended with 0, else the status of the first one that did not."""
    return next((int(c) for c in codes.values() if c != ExitCode.OK), int(ExitCode.OK))


def describe(codes: dict[str, int], reasons: dict[str, str] | None = None) -> str:
    """Every device's status in one line, devices with the same status and reason together."""
    groups: dict[str, list[str]] = {}
    for name, code in codes.items():
        why = (reasons or {}).get(name) or EXIT_HELP.get(code, "an unexpected error (see the traceback above)")
        groups.setdefault(f"status {int(code)} ({why})", []).append(name)
    return "; ".join(f"{', '.join(names)}: {what}" for what, names in groups.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="device_node.host", description="Several multispin devices in one process.")
    parser.add_argument("--connect", required=True, type=endpoint, metavar="tcp://HOST:PORT",
                        help="edge (or channel emulator) endpoint")
    parser.add_argument("--draft", required=True, help="path to the draft model's ONNX file (one session for all)")
    parser.add_argument("--devices", required=True, metavar="JSON",
                        help='JSON list of devices: [{"name": "d0", "hardware": "phone", "keys": "DIR", '
                             '"link_probe": "SPEC", "link_probe_period_s": 1.0}, ...]; only name is required')
    parser.add_argument("--register-timeout", type=float, default=120.0,
                        help="seconds each device keeps registering before giving up")
    parser.add_argument("--reconnect", action="store_true", help="devices reconnect when the edge goes silent")
    parser.add_argument("--no-tx-marker", action="store_true", help="do not send tx_start markers")
    parser.add_argument("--serve-runs", action="store_true",
                        help="after a run, wait for SIGUSR1 and register again for the next (warm trials)")
    args = parser.parse_args(argv)
    if args.serve_runs:
        from device_node import next_run

        next_run.install()  # before the parent may signal the next run
    try:
        devices = parse_devices(args.devices)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host = DeviceHost(args.connect, args.draft, devices, register_timeout_s=args.register_timeout,
                      reconnect=args.reconnect, tx_marker=not args.no_tx_marker, serve_runs=args.serve_runs)
    codes = host.run()
    log.log(logging.INFO if exit_status(codes) == 0 else logging.ERROR, "devices ended: %s",
            describe(codes, host.reasons))
    return exit_status(codes)


if __name__ == "__main__":
    sys.exit(main())
