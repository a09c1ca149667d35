"""The host-side supervisor `fleet up` leaves running: it starts each device of the host, restarts one that
exits (after a backoff that grows while a device keeps failing), and stops them all on SIGTERM.

    python -m testbed.fleet.supervisor SPEC.json          # started by `fleet up` under nohup, detached
    python -m testbed.fleet.supervisor --stop SPEC.json   # what `fleet down` runs: stop it, wait, print pids

It leads its own session and process group (setsid), writes SPEC's pid file (its pid and its devices' pids,
rewritten at each restart), appends each device's output to LOG_DIR/<name>.log, and removes the pid file
on the way out. Standard library only: it must start on a device host before anything else is checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0)
STABLE_S = 60.0  # a device that ran this long before exiting starts again at the first backoff
STOP_WAIT_S = 10.0
MARK = "testbed.fleet.supervisor"


class Supervisor:
    def __init__(self, spec: dict):
        self.spec = spec
        self.children: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.failures: dict[str, int] = {d["name"]: 0 for d in spec["devices"]}
        self.due: dict[str, float] = {d["name"]: 0.0 for d in spec["devices"]}
        self.stopping = False

    def note(self, name: str, text: str) -> None:
        with open(os.path.join(self.spec["log_dir"], f"{name}.log"), "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} supervisor: {text}\n")

    def start(self, device: dict) -> None:
        name = device["name"]
        log = open(os.path.join(self.spec["log_dir"], f"{name}.log"), "ab")
        env = {**os.environ, **self.spec.get("env", {})}
        self.children[name] = subprocess.Popen(device["argv"], stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, env=env)
        log.close()
        self.started[name] = time.monotonic()
        self.note(name, f"started {name} (pid {self.children[name].pid})")
        self.write_pids()

    def write_pids(self) -> None:
        tmp = self.spec["pid_file"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "pgid": os.getpgid(0),
                       "devices": {n: p.pid for n, p in self.children.items() if p.poll() is None}}, f)
        os.replace(tmp, self.spec["pid_file"])

    def reap(self) -> None:
        now = time.monotonic()
        for name, proc in list(self.children.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.children[name]
            ran = now - self.started[name]
            self.failures[name] = 0 if ran >= STABLE_S else self.failures[name] + 1
            wait = BACKOFF_S[min(max(self.failures[name] - 1, 0), len(BACKOFF_S) - 1)]
            self.due[name] = now + wait
            self.note(name, f"{name} exited with status {code} after {ran:.1f} s; restarting in {wait:g} s")
            self.write_pids()

    def run(self) -> int:
        os.makedirs(self.spec["log_dir"], exist_ok=True)
        self.write_pids()
        while not self.stopping:
            self.reap()
            now = time.monotonic()
            for device in self.spec["devices"]:
                if device["name"] not in self.children and now >= self.due[device["name"]]:
                    self.start(device)
            time.sleep(0.2)
        return self.shutdown()

    def shutdown(self) -> int:
        for proc in self.children.values():
            proc.terminate()
        end = time.monotonic() + STOP_WAIT_S
        for name, proc in self.children.items():
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.note(name, f"stopped {name} (status {proc.returncode})")
        try:
            os.unlink(self.spec["pid_file"])
        except FileNotFoundError:
            pass
        return 0


def alive(pid: int) -> bool:
    """`testbed.runtime.processes.pid_alive`, again: this module imports only the standard library."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited already (its parent will reap it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def is_supervisor(pid: int) -> bool:
    """The pid still names this module's process (not a later process that reused the number)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return MARK.encode() in f.read()
    except OSError:
        return alive(pid)  # no /proc (macOS): the pid file's pid, trusted


def stop(spec: dict) -> dict:
    """Stop the supervisor of `spec` and its devices; returns the pids and whether each is gone."""
    try:
        with open(spec["pid_file"]) as f:
            pids = json.load(f)
    except FileNotFoundError:
        return {"running": False, "stopped": {}}
    targets = {"supervisor": pids["pid"], **pids.get("devices", {})}
    if is_supervisor(pids["pid"]):
        os.kill(pids["pid"], signal.SIGTERM)
    end = time.monotonic() + STOP_WAIT_S + 5
    while any(alive(p) for p in targets.values()) and time.monotonic() < end:
        time.sleep(0.05)
    if any(alive(p) for p in targets.values()) and is_supervisor(pids["pid"]):
        os.killpg(pids["pgid"], signal.SIGKILL)  # the whole group it leads: its devices included
    for name, pid in targets.items():
        if name != "supervisor" and alive(pid):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.05)
    try:
        os.unlink(spec["pid_file"])
    except FileNotFoundError:
        pass
    return {"running": True, "stopped": {n: {"pid": p, "gone": not alive(p)} for n, p in targets.items()}}


def main(argv: list[str]) -> int:
    stopping = argv[0] == "--stop"
    with open(argv[-1]) as f:
        spec = json.load(f)
    if stopping:
        print(json.dumps(stop(spec)))
        return 0
    try:
        os.setsid()  # a group of its own: `down` can end it and its devices together
    except PermissionError:
        pass  # already a group leader
    supervisor = Supervisor(spec)

    def on_signal(signum, frame):
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the SSH session that started it closes
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
