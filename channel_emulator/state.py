"""Channel state: the power gain g_k (dB) of every device per round, modeled or measured.

Sources (``cfg["source"]``):
- ``model``: path loss (``testbed.core.radio.path_loss_db``) + log-normal shadowing (sigma dB, one draw per
  device) + Rayleigh block fading (exponential power gain, redrawn per round) + mobility (distance over
  time). Every draw is seeded by (seed, device name[, round]) so results do not depend on query order.
- ``trace``: an SNR trace CSV ``time_s,device,snr_db`` replayed by time (nearest earlier sample) or by
  round index.
- ``live``: the latest SNR a device reported (``report_live``); devices may read it with
  ``ProcNetWirelessReader`` on Linux hosts with a wireless interface.

SNR <-> gain: snr = p g / (N0 B), with p and B the reference power and bandwidth of the measurement: per
device ``max_power_w`` (or ``max_power_dbm``) and ``ul_bandwidth_hz`` (or ``uplink_bandwidth_hz``), else
``cfg["snr_reference"] = {"power_dbm": 23, "bandwidth_hz": 1e6}``; N0 from ``noise_psd_dbm_hz`` (-174) and
``noise_figure_db`` (0) in cfg.
"""

from __future__ import annotations

import csv
import math
import zlib
from bisect import bisect_right
from pathlib import Path
from typing import Any

import numpy as np

from testbed.core import radio

SOURCES = ("model", "trace", "live")
FADING = ("rayleigh", "none")
MOBILITY = ("none", "linear", "random_waypoint")
TRACE_INDEX = ("time", "round")


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"channel config: {field}={value!r} is invalid; allowed: {allowed}")


def _stable_id(name: str) -> int:
    # Python's hash() is salted per process; crc32 keeps draws identical across processes and hosts.
    return zlib.crc32(name.encode())


def _rng(seed: int, name: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), _stable_id(name), *extra])


class Mobility:
    """Distance from the edge (m) over time for one device."""

    def __init__(self, kind: str, d0: float, seed: int, name: str, speed_mps: float,
                 min_distance_m: float, cell_radius_m: float):
        if kind not in MOBILITY:
            raise _bad("mobility.kind", kind, ", ".join(MOBILITY))
        if speed_mps < 0 or not math.isfinite(speed_mps):
            raise _bad("mobility.speed_mps", speed_mps, "a finite number >= 0")
        if not 0 < min_distance_m < cell_radius_m:
            raise _bad("mobility.min_distance_m", min_distance_m, f"0 < value < cell_radius_m={cell_radius_m}")
        self.kind, self.d0, self.speed = kind, float(d0), float(speed_mps)
        self.rmin, self.rmax = float(min_distance_m), float(cell_radius_m)
        rng = _rng(seed, name, 1)
        self._direction = 1.0 if rng.random() < 0.5 else -1.0  # linear: towards or away from the edge
        if kind == "random_waypoint":
            angle = rng.uniform(0, 2 * math.pi)
            self._rng = rng
            self._points = [np.array([d0 * math.cos(angle), d0 * math.sin(angle)])]
            self._times = [0.0]

    def _waypoint(self) -> np.ndarray:
        # Uniform over the annulus rmin..rmax (area-uniform radius).
        r = math.sqrt(self._rng.uniform(self.rmin ** 2, self.rmax ** 2))
        a = self._rng.uniform(0, 2 * math.pi)
        return np.array([r * math.cos(a), r * math.sin(a)])

    def distance_m(self, t_s: float) -> float:
        if self.kind == "none" or self.speed == 0.0:
            return self.d0
        if self.kind == "linear":
            # Radial motion at constant speed, bouncing between rmin and rmax (a triangle wave).
            span = self.rmax - self.rmin
            x = (self.d0 - self.rmin) + self._direction * self.speed * t_s
            x = x % (2 * span)
            return self.rmin + (x if x <= span else 2 * span - x)
        while self._times[-1] <= t_s:  # extend the waypoint path lazily (deterministic for a seed)
            nxt = self._waypoint()
            leg = float(np.linalg.norm(nxt - self._points[-1]))
            self._times.append(self._times[-1] + max(leg, 1e-9) / self.speed)
            self._points.append(nxt)
        i = bisect_right(self._times, t_s) - 1
        t0, t1 = self._times[i], self._times[i + 1]
        frac = (t_s - t0) / (t1 - t0)
        pos = self._points[i] + frac * (self._points[i + 1] - self._points[i])
        # A straight leg between two waypoints may cut through the inner disc: floor at min_distance_m.
        return max(self.rmin, float(np.linalg.norm(pos)))


class ModelSource:
    def __init__(self, cfg: dict, devices: list[dict]):
        self.seed = int(cfg.get("seed", 0))
        self.law = cfg.get("path_loss_law", "3gpp_macro")
        radio.path_loss_db(100.0, self.law)  # validates the law name
        self.sigma = float(cfg.get("shadowing_sigma_db", 0.0))
        if self.sigma < 0 or not math.isfinite(self.sigma):
            raise _bad("shadowing_sigma_db", self.sigma, "a finite number >= 0")
        self.fading = cfg.get("fading", "rayleigh")
        if self.fading not in FADING:
            raise _bad("fading", self.fading, ", ".join(FADING))
        mob = dict(cfg.get("mobility") or {})
        kind = mob.get("kind", "none")
        radius = float(mob.get("cell_radius_m", cfg.get("cell_radius_m", 500.0)))
        self.mobility: dict[str, Mobility] = {}
        self.shadow_db: dict[str, float] = {}
        for dev in devices:
            name = dev["name"]
            d0 = dev.get("distance_m")
            if d0 is None or not (float(d0) > 0):
                raise _bad(f"devices[{name}].distance_m", d0, "a distance in metres > 0 (source 'model')")
            self.mobility[name] = Mobility(kind, float(d0), self.seed, name, float(mob.get("speed_mps", 1.0)),
                                           float(mob.get("min_distance_m", 10.0)), radius)
            self.shadow_db[name] = float(_rng(self.seed, name, 2).normal(0.0, self.sigma)) if self.sigma else 0.0

    def distance_m(self, name: str, t_s: float) -> float:
        return self.mobility[name].distance_m(t_s)

    def gain_db(self, name: str, round_index: int, t_s: float) -> float:
        g = -radio.path_loss_db(self.distance_m(name, t_s), self.law) + self.shadow_db[name]
        if self.fading == "rayleigh":
            # Rayleigh amplitude -> exponential(1) power gain, one block per round.
            h = _rng(self.seed, name, 3, int(round_index)).exponential(1.0)
            g += 10.0 * math.log10(max(h, 1e-12))
        return g


def load_snr_trace(path: str | Path) -> dict[str, list[tuple[float, float]]]:
    """Read ``time_s,device,snr_db`` (header required; ``time`` accepted for ``time_s``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"channel config: trace.path={str(path)!r} is not a readable file")
    out: dict[str, list[tuple[float, float]]] = {}
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or [])
        tcol = "time_s" if "time_s" in cols else "time"
        if not {tcol, "device", "snr_db"} <= cols:
            raise ValueError(f"SNR trace {path}: columns {sorted(cols)}; required: time_s (or time), device, snr_db")
        for lineno, row in enumerate(reader, start=2):
            try:
                t, snr = float(row[tcol]), float(row["snr_db"])
            except (TypeError, ValueError):
                raise ValueError(f"SNR trace {path}:{lineno}: time/snr_db not numbers: {row}") from None
            if not (math.isfinite(t) and math.isfinite(snr)):
                raise ValueError(f"SNR trace {path}:{lineno}: non-finite value: {row}")
            out.setdefault(row["device"], []).append((t, snr))
    for samples in out.values():
        samples.sort()
    return out


class TraceSource:
    def __init__(self, cfg: dict, devices: list[dict]):
        tcfg = cfg.get("trace") or {}
        if "path" not in tcfg:
            raise _bad("trace.path", None, "a CSV file with columns time_s,device,snr_db")
        self.index = tcfg.get("index", "time")
        if self.index not in TRACE_INDEX:
            raise _bad("trace.index", self.index, ", ".join(TRACE_INDEX))
        self.samples = load_snr_trace(tcfg["path"])
        missing = [d["name"] for d in devices if d["name"] not in self.samples]
        if missing:
            raise ValueError(f"SNR trace {tcfg['path']}: no samples for devices {missing}; "
                             f"it has {sorted(self.samples)}")
        self._times = {k: [t for t, _ in v] for k, v in self.samples.items()}

    def snr_db(self, name: str, round_index: int, t_s: float) -> float:
        samples = self.samples[name]
        if self.index == "round":
            return samples[min(int(round_index), len(samples) - 1)][1]  # past the end: hold the last
        i = bisect_right(self._times[name], t_s) - 1
        if i < 0:
            raise ValueError(f"SNR trace: t_s={t_s} is before the first sample of {name!r} "
                             f"(t={samples[0][0]}); allowed: t_s >= that")
        return samples[i][1]


class ProcNetWirelessReader:
    """Live SNR of a Linux wireless interface from /proc/net/wireless (signal level minus noise, dB)."""

    def __init__(self, interface: str | None = None, path: str = "/proc/net/wireless",
                 noise_floor_dbm: float = -95.0):
        self.interface, self.path, self.noise_floor_dbm = interface, Path(path), noise_floor_dbm

    def read_snr_db(self) -> float:
        if not self.path.exists():
            raise RuntimeError(f"{self.path} does not exist on this host: no wireless interface or driver; "
                               "use channel source 'trace' or report SNR with ChannelState.report_live")
        # Format: 2 header lines, then 'iface: status link level noise ...' ('.' marks updated values).
        for line in self.path.read_text().splitlines()[2:]:
            iface, _, rest = line.partition(":")
            if self.interface and iface.strip() != self.interface:
                continue
            fields = rest.split()
            level = float(fields[2].rstrip("."))
            noise = float(fields[3].rstrip("."))
            if noise in (0.0, -256.0):  # driver does not report noise
                noise = self.noise_floor_dbm
            return level - noise
        which = repr(self.interface) if self.interface else "at all"
        raise RuntimeError(f"{self.path}: no wireless interface {which} listed")


class ChannelState:
    """Per-round channel gains in dB for every device."""

    def __init__(self, source: str, devices: list[dict], impl, noise_w_hz: float,
                 snr_ref: dict[str, tuple[float, float]], fallback: ModelSource | None = None):
        self.source, self.devices, self._impl = source, [d["name"] for d in devices], impl
        self.noise_w_hz, self._snr_ref, self._fallback = noise_w_hz, snr_ref, fallback
        self._live: dict[str, float] = {}

    @classmethod
    def from_config(cls, cfg: dict, devices: list[dict]) -> ChannelState:
        cfg = dict(cfg or {})
        source = cfg.get("source", "model")
        if source not in SOURCES:
            raise _bad("source", source, ", ".join(SOURCES))
        names = [d.get("name") for d in devices]
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise _bad("devices[].name", names, "unique non-empty strings")
        noise = radio.noise_psd_w_per_hz(float(cfg.get("noise_psd_dbm_hz", -174.0)),
                                         float(cfg.get("noise_figure_db", 0.0)))
        ref = cfg.get("snr_reference") or {}
        snr_ref = {}
        for d in devices:
            # The device's max UL power and UL bandwidth (keys of the scenario's devices accepted too).
            if d.get("max_power_w"):
                p_dbm = radio.w_to_dbm(float(d["max_power_w"]))
            else:
                p_dbm = float(d.get("max_power_dbm", ref.get("power_dbm", 23.0)))
            bw = float(d.get("ul_bandwidth_hz") or d.get("uplink_bandwidth_hz") or ref.get("bandwidth_hz", 1e6))
            if not bw > 0:
                raise _bad(f"devices[{d['name']}].ul_bandwidth_hz", bw, "a bandwidth in Hz > 0")
            snr_ref[d["name"]] = (p_dbm, bw)
        fallback = None
        if source == "model":
            impl = ModelSource(cfg, devices)
        elif source == "trace":
            impl = TraceSource(cfg, devices)
        else:
            impl = None
            if all(d.get("distance_m") for d in devices):
                fallback = ModelSource({**cfg, "fading": "none", "shadowing_sigma_db": 0.0}, devices)
        return cls(source, devices, impl, noise, snr_ref, fallback)

    def snr_to_gain_db(self, name: str, snr_db: float) -> float:
        # snr = p g / (N0 B)  =>  g_dB = snr_dB - p_dBW + 10 log10(N0 B)
        p_dbm, bw = self._snr_ref[name]
        return snr_db - (p_dbm - 30.0) + radio.linear_to_db(self.noise_w_hz * bw)

    def gain_to_snr_db(self, name: str, gain_db: float) -> float:
        p_dbm, bw = self._snr_ref[name]
        return gain_db + (p_dbm - 30.0) - radio.linear_to_db(self.noise_w_hz * bw)

    def report_live(self, name: str, snr_db: float) -> None:
        if name not in self._snr_ref:
            raise ValueError(f"report_live: device {name!r} unknown; allowed: {self.devices}")
        if not math.isfinite(float(snr_db)):
            raise ValueError(f"report_live: snr_db={snr_db!r} for {name!r}; allowed: a finite number")
        self._live[name] = float(snr_db)

    def gains_db(self, round_index: int, t_s: float) -> dict[str, float]:
        out = {}
        for name in self.devices:
            if self.source == "model":
                out[name] = self._impl.gain_db(name, round_index, t_s)
            elif self.source == "trace":
                out[name] = self.snr_to_gain_db(name, self._impl.snr_db(name, round_index, t_s))
            elif name in self._live:
                out[name] = self.snr_to_gain_db(name, self._live[name])
            elif self._fallback is not None:
                out[name] = self._fallback.gain_db(name, round_index, t_s)  # path loss until a reading comes
            else:
                raise ValueError(f"live channel: no SNR reported yet for {name!r} and no distance_m to fall back on")
        return out
