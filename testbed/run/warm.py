"""Warm trials: what one live run of `multispin compare` or `campaign` leaves running for the next.

A `WarmPool` keeps, from one trial to the next,
- the edge's loaded target and tokenizer (same model pair, model device and threads), and
- the channel emulator and the device processes with their loaded drafters (same pair, device set, hardware,
  link probes, deployment, channel mode, keys and busy-polling; emulation with devices started here and
  private ipc:// endpoints only).

Everything else is the trial's own, as in a cold run: its recorder and run directory, controller (estimates,
calibration of the devices' drafting as they timed it at their start), the edge server and its sessions (the
verifier's caches are emptied), seeds, prompts and channel draws. Between trials the devices wait after the
edge's `bye` (`--serve-runs`, `device_node.next_run`); the next trial binds its edge on the same socket path,
resets the emulator's statistics (its `reset` request) and then signals the devices (SIGUSR1) to register
again: each gets a new session, a reset drafter and the new prompt, exactly as at a cold start. The
verification's calibration (t0, t1 timed on the target) is kept for trials of the same shapes: it times the
same target on the same host.

The processes write their logs in the pool's folder; each trial gets the part written during it in its own
run directory's logs/. A trial whose settings differ in what the processes hold starts them cold (the log says
why), and so does one after a trial that did not finish or whose processes are gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from testbed.run.launcher import Launcher, load_tokenizer

log = logging.getLogger("multispin.warm")


def model_key(profile, pair: dict) -> tuple:
    m = profile.model
    return pair.get("target"), pair.get("tokenizer"), m.device, m.threads, m.dtype


def process_key(s) -> tuple | None:
    """What the running emulator and device processes hold; None when a trial cannot share them (devices not
    started here, fixed endpoints: the next run could not bind them while these run)."""
    p = s.profile
    ep = p.endpoints
    if not s.start_devices or p.deployment != "emulation" or s.bind or any(
            (ep.edge_bind, ep.channel_frontend, ep.channel_control, ep.device_connect)):
        return None
    from testbed.run.session import device_specs

    devices = tuple(tuple(sorted(d.items())) for d in device_specs(s))
    return (model_key(p, s.pair), s.pair.get("draft_onnx"), devices, p.channel.mode, p.channel.spin_s,
            p.keys_dir, p.devices_per_process, s.busy_poll)


def why_cold(old: tuple | None, new: tuple | None) -> str:
    if new is None:
        return "devices not started here, or fixed endpoints"
    if old is None:
        return "first trial"
    names = ("model pair", "draft model", "device set (names, hardware, link probes)", "channel mode",
             "channel spin_s", "keys", "devices_per_process", "busy polling")
    return "its " + ", ".join(n for n, a, b in zip(names, old, new) if a != b) + " differ from the last trial's"


class WarmPool:
    """The target, the emulator and the device processes shared by trials run one after another in a process
    (`compare`, a campaign, a campaign worker). `close()` stops what runs; use it as a context manager."""

    def __init__(self, say=None):
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.model: tuple | None = None  # (key, tokenizer, verifier)
        self.key: tuple | None = None    # `process_key` of the processes kept
        self.launcher: Launcher | None = None
        self.tmp: Path | None = None     # the kept processes' ipc:// sockets and logs
        self.channel = None              # the kept emulator's control client
        self.calibrations: dict[tuple, dict] = {}
        self.trials = 0
        self.dropped: str | None = None  # why the last trial left no processes to the next, if it did not
        self._offsets: dict[str, int] = {}

    # -- the target ------------------------------------------------------------------------------------
    def tokenizer_and_verifier(self, profile, pair: dict, load):
        """The loaded tokenizer and verifier for this pair (`load()` builds them when the pair changed); the
        verifier's caches are emptied (a trial opens its own sessions)."""
        key = model_key(profile, pair)
        if self.model is None or self.model[0] != key:
            self.model = None  # the old target goes before the new one loads
            tokenizer, verifier = load_tokenizer(pair["tokenizer"]), load()
            self.model = (key, tokenizer, verifier)
        else:
            self.say("warm: the edge's target is loaded")
        self.model[2].sessions.clear()
        return self.model[1], self.model[2]

    def calibration(self, key: tuple, measure) -> dict:
        """The verification's calibration of these shapes (n devices, L_max, prompts) on the loaded target,
        measured once."""
        key = (self.model[0] if self.model else None, key)
        if key not in self.calibrations:
            self.calibrations[key] = measure()
        return self.calibrations[key]

    # -- the processes ---------------------------------------------------------------------------------
    def adopt(self, s) -> bool:
        """Give trial `s` the kept processes (True) or a fresh launcher and socket folder for a cold start."""
        self.trials += 1
        key = process_key(s)
        reason = self._unusable(key)
        if reason is None:
            s.launcher, s.tmp, s.channel = self.launcher, self.tmp, self.channel
            s.launcher.log_dir = self.tmp / "logs"
            self._offsets = self._log_sizes()
            self.say(f"warm: trial {self.trials} reuses the edge's target, the emulator and "
                     f"{len(set(self.launcher.device_procs.values()))} device process(es)")
            return True
        self.release()
        self.say(f"cold: trial {self.trials} starts every process ({reason})")
        s.tmp = Path(tempfile.mkdtemp(prefix="ms-"))
        s.launcher = Launcher(s.tmp / "logs" if key is not None else s.run_dir / "logs")
        s.launcher.serve_runs = key is not None
        self._offsets = {}
        return False

    def _unusable(self, key: tuple | None) -> str | None:
        if key is not None and self.key is None and self.dropped:
            return self.dropped
        if key is None or key != self.key:
            return why_cold(self.key, key)
        gone = [label for label, p in self.launcher.procs.items() if p.poll() is not None]
        if gone:
            return f"the last trial's {', '.join(gone)} exited"
        return None

    def keep(self, s, finished: bool) -> bool:
        """After trial `s`: keep its processes for the next trial (True), or not (the caller stops them, then
        calls `copy_logs`)."""
        key = process_key(s)
        alive = s.launcher is not None and all(p.poll() is None for p in s.launcher.procs.values())
        if not finished or key is None or not alive or not s.launcher.serve_runs:
            if s.launcher is self.launcher:
                self.launcher = self.channel = self.tmp = None  # the caller stops them
                self.key = None
            self.dropped = ("the last trial did not finish" if not finished else
                            "a process of the last trial exited" if not alive else None)
            return False
        self.dropped = None
        # The next edge binds the same ipc:// path: libzmq (4.3) leaves a closed socket's file in place, and a bind
        # replaces it.
        self.key, self.launcher, self.tmp, self.channel = key, s.launcher, s.tmp, s.channel
        return True

    def signal_next_run(self) -> None:
        """Tell every kept device process that the next run's edge is up: its devices register again."""
        for label in sorted(set(self.launcher.device_procs.values())):
            proc = self.launcher.procs.get(label)
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR1)

    def copy_logs(self, s) -> None:
        """What the pool's processes wrote during trial `s`, into its run directory's logs/."""
        if s.launcher is None or s.launcher.log_dir == s.run_dir / "logs":
            return
        dest = s.run_dir / "logs"
        dest.mkdir(parents=True, exist_ok=True)
        for label in s.launcher.procs:
            src = s.launcher.log_dir / f"{label}.log"
            try:
                with open(src, "rb") as fh:
                    fh.seek(self._offsets.get(label, 0))
                    (dest / f"{label}.log").write_bytes(fh.read())
            except OSError as exc:
                log.warning("logs/%s.log not copied: %s", label, exc)

    def _log_sizes(self) -> dict[str, int]:
        out = {}
        for label in self.launcher.procs:
            try:
                out[label] = (self.launcher.log_dir / f"{label}.log").stat().st_size
            except OSError:
                out[label] = 0
        return out

    def release(self) -> None:
        """Stop the kept processes (the emulator first asked to stop, then every process by its id)."""
        if self.launcher is None:
            return
        if self.channel is not None:
            try:
                self.channel.stop()
                self.launcher.leaving.add("channel")
            except (TimeoutError, RuntimeError) as exc:
                log.warning("channel emulator: %s", exc)
            self.channel.close()
        self.launcher.stop_all(grace_s=0.0)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.launcher = self.channel = self.tmp = self.key = None

    def close(self) -> None:
        self.release()
        self.model = None

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

