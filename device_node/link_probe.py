"""Link probes on a device: measure the radio link's SNR for the edge's ``live`` channel state.

Standard library only (no numpy, no torch), so any device can run them. A probe is chosen by a SPEC string:

- ``linux-wireless[:IFACE]``: signal and noise of a Wi-Fi interface. With ``iw`` installed and IFACE
  known: ``iw dev IFACE link`` (``signal: -56 dBm``) and the noise of the channel in use from
  ``iw dev IFACE survey dump``; otherwise ``/proc/net/wireless`` (``level`` and ``noise`` in dBm). A driver
  that reports no noise (0 or -256) gets ``noise_floor_dbm`` (default -95 dBm), and ``source`` says so.
- ``file:PATH``: a file any script can write: a bare number (the SNR in dB), or ``key=value`` lines with
  keys ``snr_db``, ``signal_dbm``, ``noise_dbm`` and optionally ``t_wall`` (seconds since the epoch;
  default: the file's modification time). ``#`` starts a comment.
- ``command:CMD``: run CMD (split like a shell would, but no shell: wrap a pipeline in ``sh -c '...'``)
  each time, killed after ``timeout_s`` (default 0.5 s); its standard output is parsed like ``file:``
  and stamped when the command finished.
- ``none``: no probing; every measurement is empty.

`Probe.measure` never raises: a failure is a `LinkMeasurement` with ``error`` set and no SNR, so a
broken probe never stops a device. Only `make_probe` raises, for a SPEC it cannot parse (a start-up
error). `BackgroundProbe` measures on a thread every ``period_s`` so that a slow probe never delays drafting.

Timestamps: ``t_wall`` is ``time.time()`` on the device. Clocks of the device and the edge are not
synchronized, so a report should carry the measurement's age on the device's own clock
(`LinkMeasurement.age_s`), and the edge stamps it with its clock on receipt minus that age.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROC_NET_WIRELESS = "/proc/net/wireless"
DEFAULT_NOISE_FLOOR_DBM = -95.0
DEFAULT_COMMAND_TIMEOUT_S = 0.5
KEYS = ("snr_db", "signal_dbm", "noise_dbm", "t_wall")


@dataclass(frozen=True)
class LinkMeasurement:
    """One reading. ``snr_db`` is None when the probe failed (``error`` says why) or has no reading."""

    snr_db: float | None
    signal_dbm: float | None
    noise_dbm: float | None
    t_wall: float
    source: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.snr_db is not None

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the measurement, on this host's wall clock (never negative)."""
        return max(0.0, (time.time() if now is None else now) - self.t_wall)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def failed(cls, source: str, error: str) -> LinkMeasurement:
        return cls(None, None, None, time.time(), source, error)


def _finite(text: str) -> float | None:
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def parse_report(text: str, source: str, t_default: float) -> LinkMeasurement:
    """A bare number (SNR dB) or ``key=value`` lines -> a measurement; a bad line is an error value."""
    values: dict[str, float] = {}
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    if len(lines) == 1 and "=" not in lines[0]:
        x = _finite(lines[0])
        if x is None:
            return LinkMeasurement.failed(source, f"{lines[0]!r} is not a number (an SNR in dB)")
        values["snr_db"] = x
    else:
        for i, ln in enumerate(lines, start=1):
            key, sep, val = ln.partition("=")
            key = key.strip()
            x = _finite(val.strip())
            if not sep or key not in KEYS or x is None:
                return LinkMeasurement.failed(source, f"line {i} {ln!r}: expected KEY=NUMBER, KEY in {', '.join(KEYS)}")
            values[key] = x
    snr = values.get("snr_db")
    sig, noise = values.get("signal_dbm"), values.get("noise_dbm")
    if snr is None and sig is not None and noise is not None:
        snr = sig - noise
    if snr is None:
        return LinkMeasurement.failed(source, "no snr_db, nor signal_dbm and noise_dbm")
    return LinkMeasurement(snr, sig, noise, values.get("t_wall", t_default), source)


class Probe:
    """Base: `measure` returns a `LinkMeasurement` and never raises."""

    spec = "none"

    def measure(self) -> LinkMeasurement:
        try:
            return self._measure()
        except Exception as exc:  # a probe failure is a value, never the end of a device
            return LinkMeasurement.failed(self.spec, f"{type(exc).__name__}: {exc}")

    def _measure(self) -> LinkMeasurement:
        return LinkMeasurement(None, None, None, time.time(), "none")


class NoneProbe(Probe):
    """``none``: no measurement."""


class FileProbe(Probe):
    """``file:PATH``: read what a script wrote."""

    def __init__(self, path: str):
        self.path, self.spec = Path(path), f"file:{path}"

    def _measure(self) -> LinkMeasurement:
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except OSError as exc:
            return LinkMeasurement.failed(self.spec, f"cannot read {self.path}: {exc.strerror or exc}")
        return parse_report(text, self.spec, mtime)


class CommandProbe(Probe):
    """``command:CMD``: run CMD within ``timeout_s`` and parse its output."""

    def __init__(self, command: str, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S):
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("link probe 'command:': the command is empty; e.g. command:/usr/local/bin/snr")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"link probe: timeout_s={timeout_s!r}; allowed: a duration in s > 0")
        self.timeout_s, self.spec = float(timeout_s), f"command:{command}"

    def _measure(self) -> LinkMeasurement:
        try:
            # run() kills the child when the budget is spent, so a hung script cannot pile up.
            proc = subprocess.run(self.argv, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return LinkMeasurement.failed(self.spec, f"no answer within {self.timeout_s:g} s (killed)")
        except OSError as exc:
            return LinkMeasurement.failed(self.spec, f"cannot run {self.argv[0]!r}: {exc.strerror or exc}")
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            return LinkMeasurement.failed(self.spec, f"exit status {proc.returncode}: {tail[0][:200]}")
        return parse_report(proc.stdout, self.spec, time.time())


_IW_SIGNAL = re.compile(r"^\s*signal:\s*(-?\d+(?:\.\d+)?)\s*dBm", re.M)
_IW_NOISE = re.compile(r"^\s*noise:\s*(-?\d+(?:\.\d+)?)\s*dBm", re.M)


def parse_iw_link(text: str) -> float | None:
    """The ``signal: X dBm`` of ``iw dev IFACE link``; None when not connected."""
    m = _IW_SIGNAL.search(text)
    return float(m.group(1)) if m else None


def parse_iw_survey(text: str) -> float | None:
    """The noise (dBm) of the channel marked ``[in use]`` in ``iw dev IFACE survey dump``."""
    for block in text.split("Survey data from")[1:]:
        if "[in use]" in block:
            m = _IW_NOISE.search(block)
            return float(m.group(1)) if m else None
    return None


def parse_proc_net_wireless(text: str, interface: str | None) -> tuple[str, float, float | None] | None:
    """(iface, level dBm, noise dBm or None if not reported) of the named (or first) interface."""
    # Format: 2 header lines, then 'iface: status link level noise ...' ('.' marks an updated value).
    for line in text.splitlines()[2:]:
        iface, _, rest = line.partition(":")
        iface = iface.strip()
        if interface and iface != interface:
            continue
        fields = rest.split()
        if len(fields) < 4:
            continue
        level, noise = float(fields[2].rstrip(".")), float(fields[3].rstrip("."))
        return iface, level, None if noise in (0.0, -256.0) else noise
    return None


class LinuxWirelessProbe(Probe):
    """``linux-wireless[:IFACE]``: iw when present (signal; survey noise), else /proc/net/wireless."""

    def __init__(self, interface: str | None = None, proc_path: str = PROC_NET_WIRELESS,
                 noise_floor_dbm: float = DEFAULT_NOISE_FLOOR_DBM, iw: str | None = "auto",
                 timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S):
        self.interface, self.proc_path, self.noise_floor_dbm = interface or None, Path(proc_path), noise_floor_dbm
        self.iw = shutil.which("iw") if iw == "auto" else iw
        self.timeout_s = timeout_s
        self.spec = f"linux-wireless:{interface}" if interface else "linux-wireless"

    def _run_iw(self, *args: str) -> str | None:
        try:
            proc = subprocess.run([self.iw, "dev", self.interface, *args], capture_output=True, text=True,
                                  timeout=self.timeout_s)
        except (subprocess.TimeoutExpired, OSError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    def _measure(self) -> LinkMeasurement:
        now = time.time()
        proc_reading = None
        if self.proc_path.exists():
            proc_reading = parse_proc_net_wireless(self.proc_path.read_text(), self.interface)
        iface = self.interface or (proc_reading[0] if proc_reading else None)
        signal = noise = None
        how = []
        if self.iw and iface:
            self.interface = iface
            link = self._run_iw("link")
            signal = parse_iw_link(link) if link else None
            if signal is not None:
                how.append("iw link")
                survey = self._run_iw("survey", "dump")
                noise = parse_iw_survey(survey) if survey else None
                if noise is not None:
                    how.append("iw survey")
        if signal is None and proc_reading is not None:
            _, level, pnoise = proc_reading
            if level >= 0:  # a driver in relative units, not dBm: no SNR can be had from it
                return LinkMeasurement.failed(self.spec, f"{self.proc_path}: level {level} is not in dBm")
            signal, how = level, [str(self.proc_path)]
            noise = pnoise if pnoise is not None else noise
        if signal is None:
            where = f"interface {iface!r}" if iface else "any wireless interface"
            return LinkMeasurement.failed(self.spec, f"no signal level for {where} (not connected, no iw, and "
                                                     f"{self.proc_path} lists none)")
        if noise is None:
            noise, how = self.noise_floor_dbm, [*how, f"noise assumed {self.noise_floor_dbm:g} dBm"]
        return LinkMeasurement(signal - noise, signal, noise, now, f"{self.spec} ({', '.join(how)})")


def make_probe(spec: str | None, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> Probe:
    """The probe a SPEC names; ValueError (naming the SPEC and what is allowed) for one it cannot parse."""
    spec = (spec or "none").strip()
    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return NoneProbe()
    if kind == "linux-wireless":
        return LinuxWirelessProbe(arg or None, timeout_s=timeout_s)
    if kind == "file" and arg:
        return FileProbe(arg)
    if kind == "command" and arg:
        return CommandProbe(arg, timeout_s=timeout_s)
    raise ValueError(f"link probe {spec!r} is invalid; allowed: none, linux-wireless[:IFACE], file:PATH, "
                     "command:CMD")


class BackgroundProbe:
    """Runs a probe every ``period_s`` on a daemon thread; `latest` returns the newest measurement at once."""

    def __init__(self, probe: Probe, period_s: float = 1.0):
        if not (period_s > 0 and math.isfinite(period_s)):
            raise ValueError(f"link probe period_s={period_s!r}; allowed: a duration in s > 0")
        self.probe, self.period_s = probe, float(period_s)
        self._latest: LinkMeasurement | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="link-probe", daemon=True)

    def start(self) -> BackgroundProbe:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._latest = self.probe.measure()  # one reference assignment: readers see old or new, whole
            self._stop.wait(self.period_s)

    def latest(self) -> LinkMeasurement | None:
        return self._latest

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
