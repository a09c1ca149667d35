"""Starting and stopping the processes of a run (the edge in this process); `testbed.run.live` drives a whole run.

Emulation: the channel emulator and the device processes are started here (ipc:// sockets in a private
temp dir): one process per scenario device, or with `devices_per_process` k > 1 ceil(N/k) host processes
of k devices each (`device_node.host`); the edge server runs in this process. LAN: only the edge (and, if the
profile asks for a channel emulator, the emulator) start here; devices connect from other hosts.
Every process started is stopped by its own id at the end, also on errors, Ctrl-C and SIGTERM.
How a run is built and driven, step by step, is in `testbed.run.session`.

Children die with their parent: on Linux each child asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGTERM)``)
to be sent SIGTERM when the thread that started it exits, so even ``kill -9`` of ``multispin run`` leaves
no emulator or device behind. Fallback where prctl is missing (not Linux): a device still leaves on its
own once the edge is silent for its liveness window (exit status 7), while an emulator started by a run
that was killed with SIGKILL must be stopped by hand (its pid is in the run's meta.json).

Ctrl-C is the parent's: a terminal sends SIGINT to the whole foreground process group, and an emulator that
died of it would leave the stopping run waiting out its control timeout for the stats. Children start with
SIGINT ignored (Python keeps an inherited SIG_IGN), so the run stops them in order: the emulator's stats,
`done` to the devices, then SIGTERM by pid.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import re
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from testbed.run.profile import Profile
from testbed.runtime.errors import TestbedError
from testbed.runtime.processes import child_preexec, signals_held

log = logging.getLogger("multispin.launcher")

# The folder that holds the testbed, node and model_pairs packages: a checkout or site-packages.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """The environment of a child process: it imports the very packages this process runs."""
    env = dict(os.environ)
    site_dirs = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if PACKAGE_ROOT not in site_dirs:
        # Running from a checkout (installed editable, or not at all): put it first. An installed package
        # needs nothing, and site-packages on PYTHONPATH would come before the standard library.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


LEAVING_GRACE_S = 5.0


class Launcher:
    """Owns child processes; `stop_all` terminates each by pid (then kills what does not exit)."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs = []
        self.device_connect: str | None = None  # where devices connect in this run
        self.device_procs: dict[str, str] = {}  # device name -> label of the process it runs in
        self.keys_dir: str | None = None  # with CURVE keys: devices use <keys_dir>/clients/<name>/
        self.busy_poll = False  # devices started here busy-poll their socket (`testbed.runtime.waiting`)
        self.serve_runs = False  # devices wait for the next run after a bye (a warm pool's, `testbed.run.warm`)
        self.leaving: set[str] = set()  # processes asked to exit (the emulator after `stop`): waited for too

    def start(self, label: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        fh = open(self.log_dir / f"{label}.log", "ab")
        self._logs.append(fh)
        # The caller's working directory: relative paths in the profile mean what they meant there.
        with signals_held():
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env={**child_env(), **(env or {})},
                                    preexec_fn=child_preexec())
            self.procs[label] = proc
        log.debug("started %s (pid %d): %s", label, proc.pid, " ".join(argv))
        return proc

    def start_channel(self, frontend: str, edge: str, control: str, mode: str, spin_s: float, *,
                      token: str | None = None, keys_dir: str | None = None,
                      expect_devices: int = 0) -> subprocess.Popen:
        """The emulator; `token` (its control token) travels in the environment, never on the command line."""
        from channel_emulator.proxy import TOKEN_ENV

        argv = [sys.executable, "-m", "channel_emulator.proxy", "--frontend", frontend, "--edge", edge,
                "--control", control, "--mode", mode, "--spin-s", str(spin_s)]
        if keys_dir:
            argv += ["--keys", str(keys_dir)]
        if expect_devices:
            argv += ["--expect-devices", str(expect_devices)]
        return self.start("channel", argv, env={TOKEN_ENV: token} if token else None)

    def start_device(self, label: str, connect: str, draft_onnx: str, hardware: str | None,
                     name: str | None = None, extra_args: list[str] | None = None) -> subprocess.Popen:
        """A device process; `label` names its log (and process), `name` its device name (default: label);
        `extra_args` go to `device_node.node` as they are (e.g. a link probe)."""
        name = name or label
        argv = [sys.executable, "-m", "device_node.node", "--connect", connect, "--name", name,
                "--draft", str(draft_onnx)]
        if hardware:
            argv += ["--hardware", hardware]
        if self.keys_dir:
            argv += ["--keys", str(Path(self.keys_dir) / "clients" / name)]
        if self.busy_poll:
            argv += ["--busy-poll"]
        if self.serve_runs:
            argv += ["--serve-runs"]
        self.device_procs[name] = f"device-{label}"
        return self.start(f"device-{label}", argv + list(extra_args or []))

    def start_host(self, label: str, connect: str, draft_onnx: str, devices: list[dict]) -> subprocess.Popen:
        """A process of several devices (`device_node.host`) on one onnxruntime session; `devices`: one
        {name, hardware?, link_probe?, link_probe_period_s?} per device (keys are added from `keys_dir`).
        Its log and process are `label`'s; `device_label` maps each device to it."""
        specs = []
        for d in devices:
            spec = {k: v for k, v in d.items() if v is not None}
            if self.keys_dir:
                spec["keys"] = str(Path(self.keys_dir) / "clients" / d["name"])
            specs.append(spec)
        argv = [sys.executable, "-m", "device_node.host", "--connect", connect, "--draft", str(draft_onnx),
                "--devices", json.dumps(specs)] + (["--serve-runs"] if self.serve_runs else [])
        for d in devices:
            self.device_procs[d["name"]] = label
        return self.start(label, argv)

    def start_devices(self, connect: str, draft_onnx: str, devices: list[dict], per_process: int = 1) -> None:
        """Every device of `devices` ({name, hardware?, link_probe?, link_probe_period_s?} each): one process
        per device (`device-<name>`, as `start_device`) when `per_process` is 1, else ceil(N / per_process) host
        processes `devices-<i>` of up to `per_process` devices each, in the given order."""
        if per_process <= 1:
            for d in devices:
                probe = d.get("link_probe") or "none"
                extra = [] if probe == "none" else ["--link-probe", probe, "--link-probe-period-s",
                                                    str(d.get("link_probe_period_s", 1.0))]
                self.start_device(d["name"], connect, draft_onnx, d.get("hardware"), extra_args=extra)
            return
        for i in range(0, len(devices), per_process):
            self.start_host(f"devices-{i // per_process}", connect, draft_onnx, devices[i:i + per_process])

    def device_label(self, name: str) -> str:
        """The label of the process device `name` runs in (`device-<name>`, or its host's `devices-<i>`)."""
        return self.device_procs.get(name, f"device-{name}")

    def device_failures(self) -> dict[str, tuple[str, int]]:
        """Per device whose process exited with a non-zero status: (the process's label, its status); a host
        process that died is reported for each of its devices."""
        failed = self.failed()
        return {n: (label, failed[label]) for n, label in self.device_procs.items() if label in failed}

    def kill(self, label: str) -> None:
        proc = self.procs.get(label)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def failed(self) -> dict[str, int]:
        return {k: p.returncode for k, p in self.procs.items() if p.poll() is not None and p.returncode != 0}

    def pids(self) -> dict[str, int]:
        return {k: p.pid for k, p in self.procs.items()}

    def last_line(self, label: str) -> str:
        """The last non-empty line of a process's log (what a failed child said last)."""
        try:
            with open(self.log_dir / f"{label}.log", "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 4096))
                lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def stop_all(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """Give the devices `grace_s` to exit on their own (they leave on `bye`), then terminate by pid what
        still runs, and kill what ignores that. Returns each process's exit status."""
        deadline = time.monotonic() + grace_s
        for label, proc in self.procs.items():
            if label == "channel" and label not in self.leaving:  # it leaves on a `stop` request only
                continue
            # One asked to leave gets at least LEAVING_GRACE_S: its exit (sockets, interpreter) can lag the
            # devices' on a busy host, and terminating it then would report a clean exit as -15.
            wait_s = deadline - time.monotonic()
            if label in self.leaving:
                wait_s = max(wait_s, LEAVING_GRACE_S)
            try:
                proc.wait(max(0.0, wait_s))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(3)
        for fh in self._logs:
            fh.close()
        return {k: p.returncode for k, p in self.procs.items()}


# --- signals --------------------------------------------------------------------------------------------

class RunInterrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGINT, SIGTERM or SIGHUP during a run; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """While active: the first SIGINT/SIGTERM/SIGHUP raises `RunInterrupted`; after `shield()` (the run is
    shutting down) further signals are logged, not raised, so that stopping the children and writing the
    run directory complete."""

    SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)

    def __init__(self):
        self.received: int | None = None
        self.shielded = False

    def handler(self, signum, frame) -> None:
        if self.shielded or self.received is not None:
            log.warning("%s received while the run shuts down; finishing the shutdown first",
                        signal.Signals(signum).name)
            return
        self.received = signum
        raise RunInterrupted(signum)

    def shield(self) -> None:
        self.shielded = True


_active: _Interrupts | None = None


def raise_if_interrupted() -> None:
    """Raise the run's `RunInterrupted` again if a signal came and the run did not begin to stop: the handler's
    raise was swallowed (it ran inside a `__del__` or another place whose exceptions Python only prints), and
    the run would go on with every further signal ignored. Called at each edge tick (`EdgeServer.check_stop`):
    in every wait, and between rounds."""
    guard = _active
    if guard is not None and guard.received is not None and not guard.shielded:
        raise RunInterrupted(guard.received)

# How a run ended (meta.json and summary.json `status`).
COMPLETE, INCOMPLETE, INTERRUPTED, FAILED = "complete", "incomplete", "interrupted", "failed"


def status_of(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of a run that ended with `exc`."""
    if isinstance(exc, RunInterrupted):
        return INTERRUPTED, f"interrupted by {signal.Signals(exc.signum).name}"
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED, "interrupted (Ctrl-C)"
    if isinstance(exc, TestbedError):
        return FAILED, str(exc)
    return FAILED, f"{type(exc).__name__}: {exc}"


@contextmanager
def interrupt_signals():
    """SIGTERM (and SIGHUP) end a run like Ctrl-C: `RunInterrupted`, a KeyboardInterrupt, in the main thread.

    Nested uses share the outer guard; outside the main thread (where Python cannot install handlers) the
    guard does nothing."""
    global _active
    if _active is not None:
        yield _active
        return
    guard = _Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {s: signal.signal(s, guard.handler) for s in guard.SIGNALS}
    _active = guard
    try:
        yield guard
    finally:
        _active = None
        for s, h in previous.items():
            signal.signal(s, h)


# --- ports ----------------------------------------------------------------------------------------------

_TCP = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>\d+)$")


def tcp_port(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://HOST:PORT`` endpoint with a fixed port; None for anything else."""
    m = _TCP.match(endpoint or "")
    if not m or int(m["port"]) == 0:
        return None
    host = m["host"].strip("[]")
    return ("" if host in ("*", "0.0.0.0") else host), int(m["port"])


def port_holder(port: int) -> str | None:
    """'pid N (command)' of the process listening on a TCP port, read from /proc (Linux; None elsewhere or
    when the process is not visible to this user)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
                return f"pid {proc.name} ({cmd[:120]})"
        except OSError:
            continue
    return None


def port_in_use(what: str, endpoint: str, port: int) -> TestbedError:
    holder = port_holder(port)
    by = f" by {holder}" if holder else ""
    return TestbedError(f"{what} {endpoint}: port {port} is already in use{by}; stop that process or choose "
                        f"another port")


def check_ports_free(endpoints: dict[str, str | None]) -> None:
    """Raise a TestbedError naming the port (and its holder) when a TCP endpoint to bind is taken.

    `endpoints`: what -> endpoint, e.g. {"endpoints.edge_bind": "tcp://0.0.0.0:5555"}."""
    for what, ep in endpoints.items():
        hp = tcp_port(ep) if ep else None
        if hp is None:
            continue
        host, port = hp
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except socket.gaierror:
                continue  # an interface name ZeroMQ resolves itself
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise port_in_use(what, ep, port) from None
                raise TestbedError(f"{what} {ep}: cannot bind: {exc.strerror}") from None


# --- model pair --------------------------------------------------------------------------------------

def resolve_pair(profile: Profile, progress: bool = True) -> dict:
    """Paths of the target, the draft ONNX and the tokenizer (builds the default pair on first need)."""
    m = profile.model
    if m.pair == "local":
        # Absolute: device processes get the draft's path on their command line.
        paths = {k: str(Path(v).expanduser().resolve()) for k, v in
                 (("target", m.target), ("draft_onnx", m.draft_onnx), ("tokenizer", m.tokenizer))}
        for k, v in paths.items():
            if not Path(v).exists():
                raise TestbedError(f"model.{k}: {v!r} does not exist")
        return paths
    from model_pairs.cache import ensure_default_pair

    pp = ensure_default_pair(progress=progress)
    return {"target": str(pp.target_dir), "draft_onnx": str(pp.draft_onnx), "tokenizer": str(pp.tokenizer),
            "manifest": str(pp.manifest)}


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def require_edge_extra() -> None:
    """The edge runs the PyTorch target: on a device-only install, say what to install (no import traceback)."""
    missing = [m for m in ("torch", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        raise TestbedError(f"the edge needs {', '.join(missing)}, not installed here; "
                           "this looks like a device-only install; install the whole testbed: "
                           "pip install multispin-testbed (or pip install . in the clone)")
