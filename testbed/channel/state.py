"""Channel state: the power gain g_k (dB) of every device per round, modeled, replayed or measured.

Sources (``cfg["source"]``), each an implementation of `testbed.channel.source.ChannelSource` (per round,
one `LinkState` per device: a gain, an SNR, fixed rates); a plug-in source is named by ``module:Class`` or a
``multispin.channels`` entry point and resolved by the caller (``from_config(..., resolve=...)``, see
`testbed.runtime.plugins`):
- ``model``: path loss (``testbed.core.radio.path_loss_db``) + log-normal shadowing (sigma dB, one draw per
  device) + Rayleigh block fading (exponential power gain, redrawn per round) + mobility (distance over
  time). Every draw is seeded by (seed, device name[, round]) so results do not depend on query order.
- ``trace``: replayed files (formats in `testbed.channel.traces`). ``trace.path``: one SNR CSV
  ``time_s,device,snr_db`` for every device; ``trace.devices``: per device (or ``'*'`` for the others) an
  ``snr`` trace and/or ``ul`` and ``dl`` rate traces (a path, or ``{path, format, column, ...}``).
  ``trace.index``: ``time`` (the sample at or before the round's wall time) or ``round`` (the round-th
  sample); ``trace.loop``: wrap at the end, or hold the last value (default: Mahimahi wraps, others
  hold). An SNR trace gives the gain, so the rate follows the planned power; a rate trace fixes the
  rate (`rate_override_bps`, `fixed_rates`): power control then has no effect on that link. A device
  with a UL rate trace and no SNR trace gets the gain whose Shannon UL rate at its reference power is
  the trace's rate (`rate_to_gain_db`).
- ``live``: the latest SNR a device reported (`report_live`; device side: ``device_node.link_probe``).
  ``live.max_age_s`` (default null: never stale) and ``live.fallback`` for a device with no fresh reading:
  ``model`` (default: the mean path loss from ``distance_m``), ``last`` (the last reading, however old),
  ``drop`` (left out of this round's gains). `live_used` records, per round, which value was used.

SNR <-> gain: snr = p g / (N0 B), i.e. g_dB = snr_dB - p_dBW + 10 log10(N0 B), with p the device's
transmit power the SNR refers to and B its UL bandwidth: per device ``max_power_w`` (or
``max_power_dbm``) and ``ul_bandwidth_hz`` (or ``uplink_bandwidth_hz``), else
``cfg["snr_reference"] = {"power_dbm": 23, "bandwidth_hz": 1e6}``; N0 from ``noise_psd_dbm_hz`` (-174) and
``noise_figure_db`` (0) in cfg. A run, `plan` and `simulate` fill in the noise, and each device's power
and bandwidth, from the scenario (`testbed.runtime.plugins.channel_state_from_config`) unless the state names its
own (noise, ``snr_reference``). A live reading with ``signal_dbm`` and ``noise_dbm`` but no ``snr_db`` uses
snr_dB = signal_dBm - noise_dBm. The model then predicts the measured SNR at that power and
bandwidth, and scales it with the power the optimizer picks.
"""
from __future__ import annotations

import math
import zlib
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from testbed import PROFILES_DIR
from testbed.channel.source import ChannelSource, LinkState
from testbed.channel.traces import Series, TraceError, detect_format, load_entry, load_snr_csv
from testbed.core import radio
from testbed.core.vocabulary import DIRECTIONS

# The built-in sources (name -> what it is); any other name is a plug-in's (`from_config`'s `resolve`).
SOURCES = {
    "model": "path loss + log-normal shadowing + Rayleigh block fading + mobility",
    "trace": "replayed SNR or rate traces per device (snr_csv, throughput_csv, Mahimahi, UCC, Lumos5G)",
    "live": "the latest SNR each device's link probe reported, with a staleness fallback",
}
FADING = ("rayleigh", "none")
MOBILITY = ("none", "linear", "random_waypoint")
TRACE_INDEX = ("time", "round")
TRACE_KEYS = {"path", "index", "loop", "devices", "base_dir", "min_rate_bps"}
ROLES = ("snr", "ul", "dl")
LIVE_FALLBACK = ("model", "last", "drop")


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

    def link_states(self, round_index: int, t_s: float) -> dict[str, LinkState]:
        return {n: LinkState(gain_db=self.gain_db(n, round_index, t_s)) for n in self.mobility}


def load_snr_trace(path: str | Path) -> dict[str, list[tuple[float, float]]]:
    """Read ``time_s,device,snr_db`` (header required; ``time`` accepted for ``time_s``)."""
    if not Path(path).is_file():
        raise ValueError(f"channel config: trace.path={str(path)!r} is not a readable file")
    return {dev: list(zip(s.times_s.tolist(), s.values.tolist())) for dev, s in load_snr_csv(path).items()}


def _resolve(path: str, base_dir: str | None, field: str) -> str:
    """A trace path as given, else relative to ``trace.base_dir``, else to the shipped profiles folder (so
    ``traces/example-ar1-6mbps.up`` names a packaged example)."""
    p = Path(path)
    if p.is_absolute():
        return str(p)
    looked = ([Path(base_dir) / p] if base_dir else []) + [p, PROFILES_DIR / p]
    for cand in looked:
        if cand.is_file():
            return str(cand)
    raise TraceError(f"channel config: {field}={path!r} not found; looked in {[str(c) for c in looked]}")


class TraceSource:
    """Replayed traces: per device an SNR series (-> gain) and/or UL and DL rate series (-> fixed rates)."""

    def __init__(self, cfg: dict, devices: list[dict]):
        tcfg = dict(cfg.get("trace") or {})
        unknown = sorted(set(tcfg) - TRACE_KEYS)
        if unknown:
            raise _bad("trace", sorted(tcfg), f"keys among {sorted(TRACE_KEYS)} (unknown: {unknown})")
        if "path" not in tcfg and not tcfg.get("devices"):
            raise _bad("trace.path", None, "a CSV file with columns time_s,device,snr_db, or trace.devices "
                                           "with per-device ul / dl / snr traces")
        self.index = tcfg.get("index", "time")
        if self.index not in TRACE_INDEX:
            raise _bad("trace.index", self.index, ", ".join(TRACE_INDEX))
        self.loop = tcfg.get("loop")  # None: each trace's own default (Mahimahi wraps, the others hold)
        if self.loop is not None and not isinstance(self.loop, bool):
            raise _bad("trace.loop", self.loop, "true, false, or left out (Mahimahi wraps, others hold)")
        base = tcfg.get("base_dir")
        names = [d["name"] for d in devices]
        self.series: dict[str, dict[str, Series]] = {n: {} for n in names}
        if "path" in tcfg:
            path = _resolve(str(tcfg["path"]), base, "trace.path")
            per_dev = load_snr_csv(path)
            if not tcfg.get("devices"):  # the original form: one SNR file that must cover every device
                missing = [n for n in names if n not in per_dev]
                if missing:
                    raise ValueError(f"SNR trace {tcfg['path']}: no samples for devices {missing}; "
                                     f"it has {sorted(per_dev)}")
            for n in names:
                if n in per_dev:
                    self.series[n]["snr"] = per_dev[n]
        dcfg = tcfg.get("devices") or {}
        if not isinstance(dcfg, dict):
            raise _bad("trace.devices", dcfg, "a mapping device name (or '*') -> {ul, dl, snr}")
        strangers = sorted(set(dcfg) - set(names) - {"*"})
        if strangers:
            raise _bad("trace.devices", strangers, f"names of devices ({names}) or '*' for every other device")
        cache: dict[str, Series] = {}
        for n in names:
            key = n if n in dcfg else "*"
            entries = dcfg.get(key) or {}
            if not isinstance(entries, dict) or set(entries) - set(ROLES):
                raise _bad(f"trace.devices[{key}]", entries, "a mapping with keys among ul, dl, snr")
            for role, entry in entries.items():
                field = f"trace.devices[{key}].{role}"
                spec = {"path": entry} if isinstance(entry, str) else dict(entry or {})
                if "path" in spec:
                    spec["path"] = _resolve(str(spec["path"]), base, f"{field}.path")
                    spec.setdefault("format", detect_format(spec["path"]))
                # An SNR CSV holds every device's rows: without 'device' each device reads its own.
                per_device = spec.get("format") == "snr_csv" and "device" not in spec
                memo = repr((role, sorted(spec.items()), n if per_device else None))
                if memo not in cache:  # '*' entries are read once, not once per device
                    cache[memo] = load_entry(spec, role, n, field)
                self.series[n][role] = cache[memo]

    def _value(self, s: Series, round_index: int, t_s: float) -> float:
        loop = s.wraps if self.loop is None else self.loop
        return s.at_index(round_index, loop) if self.index == "round" else s.at_time(t_s, loop)

    def snr_db(self, name: str, round_index: int, t_s: float) -> float | None:
        s = self.series[name].get("snr")
        return None if s is None else self._value(s, round_index, t_s)

    def rate_bps(self, name: str, direction: str, round_index: int, t_s: float) -> float | None:
        s = self.series[name].get(direction)
        return None if s is None else self._value(s, round_index, t_s)

    def link_states(self, round_index: int, t_s: float) -> dict[str, LinkState]:
        return {n: LinkState(snr_db=self.snr_db(n, round_index, t_s),
                             ul_rate_bps=self.rate_bps(n, "ul", round_index, t_s),
                             dl_rate_bps=self.rate_bps(n, "dl", round_index, t_s)) for n in self.series}

    @property
    def fixed_rates(self) -> dict[str, dict[str, bool]]:
        return {n: {d: d in self.series[n] for d in DIRECTIONS} for n in self.series}


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



@dataclass(frozen=True)
class LiveReading:
    """An SNR a device reported, stamped on the state's clock (the ``t_s`` of `ChannelState.gains_db`)."""

    snr_db: float
    t_s: float
    probe: str | None


def _field(m: Any, key: str) -> Any:
    return m.get(key) if isinstance(m, Mapping) else getattr(m, key, None)


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class LiveSource:
    """The SNR each device last reported (`report`), with a staleness rule: ``max_age_s`` (None: never stale)
    and ``fallback`` (``model``: the mean path loss; ``last``: the last reading however old; ``drop``: the
    device is left out of the round)."""

    def __init__(self, names: list[str], max_age_s: float | None, fallback: str, model: ModelSource | None,
                 gain_to_snr_db):
        self.names, self.max_age_s, self.fallback = list(names), max_age_s, fallback
        self._model, self._gain_to_snr_db = model, gain_to_snr_db
        self._live: dict[str, LiveReading] = {}
        self._errors: dict[str, str] = {}
        self._used: dict[str, dict] = {}
        self.last_t_s = 0.0

    def report(self, name: str, snr_db: float | None, t_s: float | None, probe: str | None = None,
               error: str | None = None) -> bool:
        """Store a reading (``t_s`` None: the last round's time); an SNR of None keeps the previous reading
        and records `error`."""
        if snr_db is None:
            self._errors[name] = error or "the measurement carries no SNR"
            return False
        self._live[name] = LiveReading(float(snr_db), self.last_t_s if t_s is None else float(t_s), probe)
        self._errors.pop(name, None)
        return True

    def used(self, name: str) -> dict | None:
        return self._used.get(name)

    def link_states(self, round_index: int, t_s: float) -> dict[str, LinkState]:
        self.last_t_s = float(t_s)
        out = {}
        for name in self.names:
            reading = self._live.get(name)
            age = None if reading is None else max(0.0, t_s - reading.t_s)
            fresh = reading is not None and (self.max_age_s is None or age <= self.max_age_s)
            used = {"round": int(round_index), "age_s": age, "probe": reading.probe if reading else None,
                    "error": self._errors.get(name)}
            if reading is not None and (fresh or self.fallback == "last"):
                used.update(value=reading.snr_db, source="live" if fresh else "last")
                out[name] = LinkState(snr_db=reading.snr_db)
            elif self.fallback == "drop":
                used.update(value=None, source="drop")  # left out of this round
            elif self._model is not None and name in self._model.mobility:
                gain = self._model.gain_db(name, round_index, t_s)  # path loss until a fresh reading comes
                used.update(value=self._gain_to_snr_db(name, gain), source="model")
                out[name] = LinkState(gain_db=gain)
            else:
                why = "no SNR reported yet" if reading is None else f"its reading is {age:.3g} s old"
                raise ValueError(f"live channel: {why} for {name!r} and no distance_m to fall back on")
            self._used[name] = used
        return out


_STATE_FIELDS = ("gain_db", "snr_db", "ul_rate_bps", "dl_rate_bps")


class ChannelSourceError(ValueError):
    """A channel source raised inside ``link_states``: `source`, `round` and the message name it."""

    def __init__(self, source: str, round_index: int, message: str):
        self.source, self.round = source, int(round_index)
        super().__init__(message)


class ChannelState:
    """Per-round channel gains in dB for every device, and for rate-fixing sources (a rate trace, a plug-in
    giving rates) the fixed rates. `source` names the `ChannelSource` that gives the per-round states."""

    def __init__(self, source: str, devices: list[dict], impl, noise_w_hz: float,
                 snr_ref: dict[str, tuple[float, float]], fallback: ModelSource | None = None, *,
                 min_rate_bps: float = 1e4):
        self.source, self.devices, self._impl = source, [d["name"] for d in devices], impl
        self.noise_w_hz, self._snr_ref, self._fallback = noise_w_hz, snr_ref, fallback
        self.min_rate_bps = min_rate_bps
        self._cached: tuple[tuple[int, float], dict[str, LinkState]] | None = None

    @classmethod
    def from_config(cls, cfg: dict, devices: list[dict], resolve=None) -> ChannelState:
        """The state of ``cfg["source"]``: a built-in source (`SOURCES`), else ``resolve(name)`` gives the
        plug-in's class or factory, built as ``factory(cfg, devices)`` (`testbed.channel.source`)."""
        cfg = dict(cfg or {})
        source = cfg.get("source", "model")
        if not isinstance(source, str) or (source not in SOURCES and resolve is None):
            raise _bad("source", source, ", ".join(SOURCES) + " (a plug-in's module:Class or entry point name "
                                         "where plug-ins are loaded: multispin run, plan, simulate)")
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
        live = dict(cfg.get("live") or {})
        if set(live) - {"max_age_s", "fallback"}:
            raise _bad("live", sorted(live), "keys among max_age_s, fallback")
        max_age = live.get("max_age_s")
        if max_age is not None and not (_finite(max_age) is not None and float(max_age) > 0):
            raise _bad("live.max_age_s", max_age, "a duration in s > 0, or null (a reading never goes stale)")
        live_fallback = live.get("fallback", "model")
        if live_fallback not in LIVE_FALLBACK:
            raise _bad("live.fallback", live_fallback, ", ".join(LIVE_FALLBACK))
        min_rate = (cfg.get("trace") or {}).get("min_rate_bps", 1e4) if source == "trace" else 1e4
        if _finite(min_rate) is None or float(min_rate) <= 0:
            raise _bad("trace.min_rate_bps", min_rate, "a rate in bit/s > 0 (the floor of a replayed rate)")
        fallback = None
        placed = [d for d in devices if d.get("distance_m")]
        if placed and source != "model":
            # The mean path loss (no fading, no shadowing) stands in where no reading or trace gives a gain.
            fallback = ModelSource({**cfg, "fading": "none", "shadowing_sigma_db": 0.0}, placed)
        state = cls(source, devices, None, noise, snr_ref, fallback, min_rate_bps=float(min_rate))
        if source == "model":
            impl = ModelSource(cfg, devices)
        elif source == "trace":
            impl = TraceSource(cfg, devices)
            blind = [n for n in names if not {"snr", "ul"} & set(impl.series[n])
                     and not (fallback and n in fallback.mobility)]
            if blind:
                raise ValueError(f"trace channel: devices {blind} have neither an snr nor a ul trace, nor a "
                                 "distance_m to fall back on; give them a trace or a distance")
        elif source == "live":
            impl = LiveSource(names, None if max_age is None else float(max_age), live_fallback, fallback,
                              state.gain_to_snr_db)
        else:
            factory = resolve(source)
            try:
                impl = factory(cfg, [dict(d) for d in devices])
            except ValueError:
                raise  # the source's own message about its configuration
            except Exception as exc:
                raise ValueError(f"channel source {source!r}: building it with (cfg, devices) failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
            if not isinstance(impl, ChannelSource):
                raise ValueError(f"channel source {source!r}: {type(impl).__name__} does not satisfy the "
                                 "ChannelSource interface: no method link_states(round_index, t_s)")
        state._impl = impl
        return state

    def snr_to_gain_db(self, name: str, snr_db: float) -> float:
        # snr = p g / (N0 B)  =>  g_dB = snr_dB - p_dBW + 10 log10(N0 B)
        p_dbm, bw = self._snr_ref[name]
        return snr_db - (p_dbm - 30.0) + radio.linear_to_db(self.noise_w_hz * bw)

    def gain_to_snr_db(self, name: str, gain_db: float) -> float:
        p_dbm, bw = self._snr_ref[name]
        return gain_db + (p_dbm - 30.0) - radio.linear_to_db(self.noise_w_hz * bw)

    def rate_to_gain_db(self, name: str, rate_bps: float) -> float:
        """The gain whose Shannon UL rate at the reference power and bandwidth is ``rate_bps``:
        snr = 2^(r / B) - 1, then `snr_to_gain_db`."""
        _, bw = self._snr_ref[name]
        snr = math.expm1(min(rate_bps / bw, 1000.0) * math.log(2.0))  # capped: 2^1000 is far past any real link
        return self.snr_to_gain_db(name, radio.linear_to_db(max(snr, 1e-30)))

    # -- live readings -----------------------------------------------------------------------------
    def report_live(self, name: str, measurement: Any, t_s: float | None = None) -> bool:
        """Store a device's reading (``source: live``): an SNR in dB (a number), or a measurement with
        ``snr_db`` (or ``signal_dbm`` and ``noise_dbm``) and ``source`` fields (a mapping or an object such as
        ``device_node.link_probe.LinkMeasurement``). ``t_s``: when it was measured, on this state's clock
        (the edge converts the device's reported age); None = the latest ``t_s`` given to `gains_db`.

        A measurement without a usable SNR (a failed probe) is kept as an error and returns False; the
        previous reading stays. A bare number that is not finite raises ValueError, as does an unknown name
        or a source that takes no readings.
        """
        if name not in self._snr_ref:
            raise ValueError(f"report_live: device {name!r} unknown; allowed: {self.devices}")
        if not isinstance(self._impl, LiveSource):
            raise ValueError(f"report_live: channel source {self.source!r} takes no live readings (source: live does)")
        self._cached = None  # a new reading changes this round's states
        if isinstance(measurement, (int, float)) and not isinstance(measurement, bool):
            if not math.isfinite(float(measurement)):
                raise ValueError(f"report_live: snr_db={measurement!r} for {name!r}; allowed: a finite number")
            return self._impl.report(name, float(measurement), t_s)
        snr = _finite(_field(measurement, "snr_db"))
        if snr is None:
            sig, noise = _finite(_field(measurement, "signal_dbm")), _finite(_field(measurement, "noise_dbm"))
            snr = None if sig is None or noise is None else sig - noise
        return self._impl.report(name, snr, t_s, _field(measurement, "source"),
                                 None if snr is not None else str(_field(measurement, "error") or ""))

    def live_used(self, name: str) -> dict | None:
        """What the last `gains_db` call used for a device (live source): ``value`` (SNR dB, None when
        dropped), ``age_s`` of the reading (None without one), ``source`` (``live``: a fresh reading;
        ``last``: a stale one kept by ``fallback: last``; ``model``: path loss; ``drop``: left out),
        ``probe`` (the reading's probe), ``round`` and the last probe ``error`` if any."""
        return self._impl.used(name) if isinstance(self._impl, LiveSource) else None

    # -- per round ---------------------------------------------------------------------------------
    def link_states(self, round_index: int, t_s: float) -> dict[str, LinkState]:
        """The source's states of this round, checked (one call per round and time: `gains_db` and
        `rate_override_bps` of one plan see the same states)."""
        key = (int(round_index), float(t_s))
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        where = f"channel source {self.source!r}, round {round_index}"
        try:
            states = self._impl.link_states(round_index, t_s)
        except Exception as exc:  # the source's own failure, named (a plug-in's bug: docs/extending.md)
            if self.source in SOURCES and isinstance(exc, ValueError):
                raise  # a built-in source's own message (a live device without a reading, ...)
            raise ChannelSourceError(self.source, round_index,
                                     f"{where}: link_states raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(states, Mapping):
            raise ValueError(f"{where}: link_states returned {type(states).__name__}, not a mapping device -> "
                             "LinkState")
        strangers = sorted(set(states) - set(self.devices), key=str)
        if strangers:
            raise ValueError(f"{where}: devices {strangers} are not in the scenario ({self.devices})")
        for name, st in states.items():
            if not isinstance(st, LinkState):
                raise ValueError(f"{where}: the state of {name!r} is {type(st).__name__}, not a LinkState")
            for f in _STATE_FIELDS:
                v = getattr(st, f)
                if v is not None and (_finite(v) is None or isinstance(v, bool)):
                    raise ValueError(f"{where}: {name}.{f} = {v!r}; allowed: a finite number or None")
            for f in ("ul_rate_bps", "dl_rate_bps"):
                if getattr(st, f) is not None and getattr(st, f) < 0:
                    raise ValueError(f"{where}: {name}.{f} = {getattr(st, f)!r}; allowed: a rate in bit/s >= 0")
        missing = [n for n in self.devices if n not in states]
        if missing and self.source != "live":  # only the live source leaves devices out (fallback: drop)
            raise ValueError(f"{where}: no state for devices {missing}; a source gives every device a LinkState")
        self._cached = (key, dict(states))
        return self._cached[1]

    def gains_db(self, round_index: int, t_s: float) -> dict[str, float]:
        """Gain (dB) per device for this round. With ``source: live`` and ``fallback: drop``, a device
        without a fresh reading is left out of the result."""
        out = {}
        for name, st in self.link_states(round_index, t_s).items():
            if st.gain_db is not None:
                out[name] = float(st.gain_db)
            elif st.snr_db is not None:
                out[name] = self.snr_to_gain_db(name, float(st.snr_db))
            elif st.ul_rate_bps is not None:  # the gain that gives the fixed UL rate at the reference power
                out[name] = self.rate_to_gain_db(name, max(float(st.ul_rate_bps), self.min_rate_bps))
            elif self._fallback is not None and name in self._fallback.mobility:
                out[name] = self._fallback.gain_db(name, round_index, t_s)
            else:
                raise ValueError(f"channel source {self.source!r}, round {round_index}: {name!r} has neither a "
                                 "gain, an SNR nor a UL rate, and no distance_m to fall back on")
        return {n: out[n] for n in self.devices if n in out}

    @property
    def fixed_rates(self) -> dict[str, dict[str, bool]]:
        """Per device and direction: True where a rate trace fixes the rate (power control has no effect);
        a plug-in's rates are known only round by round (False here)."""
        known = getattr(self._impl, "fixed_rates", None) if self.source == "trace" else None
        return {n: dict((known or {}).get(n) or {"ul": False, "dl": False}) for n in self.devices}

    def rate_override_bps(self, round_index: int, t_s: float) -> dict[str, dict[str, float | None]]:
        """Per device ``{"ul": bit/s or None, "dl": bit/s or None}``: the rate where the source fixes it (a
        rate trace; floored at ``trace.min_rate_bps``, default 10 kbit/s, so that an outage is a long air
        time, not a division by zero), None where the rate follows from the gain and the planned power."""
        states = self.link_states(round_index, t_s)
        out: dict[str, dict[str, float | None]] = {}
        for n in self.devices:
            st = states.get(n) or LinkState()
            out[n] = {d: None if r is None else max(float(r), self.min_rate_bps)
                      for d, r in (("ul", st.ul_rate_bps), ("dl", st.dl_rate_bps))}
        return out
