"""Trace files for the channel state: per device and direction, a rate (bit/s) or an SNR (dB) over time.

A trace reduces to a `Series`: samples (t_i, v_i) held until the next sample (sample and hold), replayed by
wall time (the value of the sample at or before t) or by round index (the i-th sample), looped or held at
its last value past the end. A rate series fixes a link's rate whatever the transmit power; an SNR series
gives the gain under the power the optimizer chooses (see `testbed/channel/state.py`).

Formats (``format`` of a trace entry; guessed from the file when left out, see `detect_format`):

- ``snr_csv``: ``time_s,device,snr_db`` (header required; ``time`` accepted for ``time_s``); times as given.
- ``throughput_csv``: ``time_s,mbps`` with a header (``time`` for ``time_s``; the rate column may instead
  be ``bps``, ``kbps`` or ``mbit_s``), or two header-less numeric columns ``time_s mbps`` separated by a
  comma or white space (the Pensieve / FCC / Norway "cooked" traces). Times as given.
- ``mahimahi``: one line per 1500-byte delivery opportunity, an integer timestamp in ms; a timestamp
  repeated n times is n packets in that millisecond; the file wraps around at its last timestamp (as
  ``mm-link`` does). Binned into ``bin_s`` (default 0.1 s) windows: rate = opportunities x 12000 bit /
  bin_s. Round r replays bin r.
- ``ucc``: the UCC 4G/5G datasets (Raca et al., "Beyond Throughput", MMSys 2018 and 2020; logged with
  G-NetTrack Pro). Columns used: ``Timestamp`` (``YYYY.MM.DD_HH.MM.SS``, local time, one row per second;
  rows of the same second are averaged), ``DL_bitrate`` and ``UL_bitrate`` (kbit/s, the rate the phone
  measured: capacity only while it transfers, so rows whose ``State`` is not ``D`` are skipped for these
  two columns unless ``state: any``), ``SNR`` (dB). ``-`` or an empty field is a missing sample (skipped).
  Defaults: ``ul`` <- ``UL_bitrate``, ``dl`` <- ``DL_bitrate``, ``snr`` <- ``SNR``. Note: in a download
  session ``UL_bitrate`` carries only acknowledgements; it is not the uplink capacity.
- ``lumos5g``: Lumos5G 1.0 (Narayanan et al., IMC 2020). One row per second; ``run_num`` selects a run
  (``run``; default the first in the file), ``seq_num`` is the per-second timeline (t = seq_num - first),
  optional filters ``mobility_mode`` and ``trajectory_direction``. ``Throughput`` is the iPerf TCP
  *downlink* throughput in Mbit/s (the dataset's README gives no unit; the paper reports Mbit/s);
  ``nr_ssSinr`` (dB, 5G NR) and ``lte_rssnr`` (dB, LTE) are SNR columns. Defaults: ``dl`` <- ``Throughput``,
  ``snr`` <- ``nr_ssSinr``; there is no uplink column (name ``column: Throughput`` explicitly to use the
  downlink throughput for the uplink). Empty, ``NaN`` or ``-`` values are missing samples (skipped).

Looping: ``loop: true`` wraps every trace at the end of one pass, ``false`` holds its last value; left out,
Mahimahi traces wrap (as ``mm-link`` replays them) and the others hold.

Every format: a value that is neither a number nor a missing marker raises `TraceError` naming the file
and the line. Rates must be >= 0; SNRs any finite number. Replay by time starts at the trace's first sample
(``ucc`` and ``lumos5g`` are shifted so that the first sample is t = 0; the CSV formats keep their times and
hold the first value before it; mahimahi starts at 0 ms).
"""

from __future__ import annotations

import csv
import math
from bisect import bisect_right
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

FORMATS = ("snr_csv", "throughput_csv", "mahimahi", "ucc", "lumos5g")
KINDS = ("rate_bps", "snr_db")
MAHIMAHI_PACKET_BITS = 1500 * 8
MISSING = {"", "-", "nan", "na", "n/a", "null", "none"}

# Which column a role reads by default, per dataset format.
UCC_COLUMNS = {"DL_bitrate": ("rate_bps", 1e3), "UL_bitrate": ("rate_bps", 1e3), "SNR": ("snr_db", 1.0)}
UCC_DEFAULT = {"ul": "UL_bitrate", "dl": "DL_bitrate", "snr": "SNR"}
LUMOS_COLUMNS = {"Throughput": ("rate_bps", 1e6), "nr_ssSinr": ("snr_db", 1.0), "lte_rssnr": ("snr_db", 1.0)}
LUMOS_DEFAULT = {"dl": "Throughput", "snr": "nr_ssSinr"}
RATE_COLUMNS = {"mbps": 1e6, "mbit_s": 1e6, "kbps": 1e3, "bps": 1.0}


class TraceError(ValueError):
    """A trace file or trace setting that cannot be used; the message names the file (and line)."""


@dataclass(frozen=True)
class Series:
    """Samples held until the next one. ``kind`` is ``rate_bps`` or ``snr_db``; ``period_s`` is one pass
    (the loop length); ``origin`` names the file for messages."""

    kind: str
    times_s: np.ndarray
    values: np.ndarray
    period_s: float
    origin: str
    strict_start: bool = False  # True: a time before the first sample is an error (the legacy SNR trace)
    wraps: bool = False  # replayed looped unless the profile says otherwise (Mahimahi wraps, as mm-link does)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TraceError(f"{self.origin}: kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        if len(self.times_s) == 0 or len(self.times_s) != len(self.values):
            raise TraceError(f"{self.origin}: no samples")
        if not (self.period_s > 0 and math.isfinite(self.period_s)):
            raise TraceError(f"{self.origin}: period {self.period_s!r} s; a trace must last > 0 s")

    def __len__(self) -> int:
        return len(self.values)

    def at_time(self, t_s: float, loop: bool = False) -> float:
        """The value at time t_s (the last sample at or before it)."""
        t0 = float(self.times_s[0])
        if t_s < t0:
            if self.strict_start:
                raise TraceError(f"{self.origin}: t_s={t_s} is before the first sample (t={t0}); "
                                 "allowed: t_s >= that")
            return float(self.values[0])
        if loop:
            t_s = t0 + math.fmod(t_s - t0, self.period_s)
        i = bisect_right(self.times_s, t_s) - 1
        return float(self.values[i])

    def at_index(self, index: int, loop: bool = False) -> float:
        """The index-th sample; past the end: wrap (loop) or hold the last."""
        n = len(self.values)
        i = int(index) % n if loop else min(max(int(index), 0), n - 1)
        return float(self.values[i])


def _origin(path: Path, lineno: int | None = None) -> str:
    return f"{path}:{lineno}" if lineno is not None else str(path)


def _number(text: str, path: Path, lineno: int, what: str, *, allow_missing: bool = False) -> float | None:
    """A finite float; None for a missing marker when allowed; else a TraceError naming file and line."""
    s = (text or "").strip()
    if allow_missing and s.lower() in MISSING:
        return None
    try:
        x = float(s)
    except ValueError:
        raise TraceError(f"{_origin(path, lineno)}: {what}={text!r} is not a number") from None
    if not math.isfinite(x):
        if allow_missing:
            return None
        raise TraceError(f"{_origin(path, lineno)}: {what}={text!r} is not finite")
    return x


def _read_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {str(p)!r} does not exist or is not a file")
    return p


def _period(times: np.ndarray) -> float:
    # One pass lasts until the last sample ends: the last gap repeated (1 s for a single sample).
    if len(times) == 1:
        return 1.0
    return float(times[-1] - times[0] + (times[-1] - times[-2] or 1.0))


def _series(kind: str, samples: list[tuple[float, float]], path: Path, *, shift: bool = False,
            strict_start: bool = False, what: str = "") -> Series:
    if not samples:
        raise TraceError(f"{path}: no usable samples{what}")
    samples.sort(key=lambda s: s[0])  # stable: of equal times the later line wins (bisect picks the last)
    t = np.array([s[0] for s in samples], dtype=float)
    v = np.array([s[1] for s in samples], dtype=float)
    if shift:
        t = t - t[0]
    return Series(kind, t, v, _period(t), f"{path}{what}", strict_start)


def _check_rate(x: float, path: Path, lineno: int) -> float:
    if x < 0:
        raise TraceError(f"{_origin(path, lineno)}: rate {x!r} < 0; allowed: a rate >= 0")
    return x


# --- the formats -----------------------------------------------------------------------------------------

def load_snr_csv(path: str | Path) -> dict[str, Series]:
    """``time_s,device,snr_db`` -> one SNR series per device (times as given; before the first sample is
    an error, as the original SNR trace has always behaved)."""
    p = _read_file(path)
    out: dict[str, list[tuple[float, float]]] = {}
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or [])
        tcol = "time_s" if "time_s" in cols else "time"
        if not {tcol, "device", "snr_db"} <= cols:
            raise TraceError(f"SNR trace {p}: columns {sorted(cols)}; required: time_s (or time), device, snr_db")
        for row in reader:
            lineno = reader.line_num
            t = _number(row[tcol], p, lineno, tcol)
            snr = _number(row["snr_db"], p, lineno, "snr_db")
            out.setdefault(row["device"], []).append((t, snr))
    return {dev: _series("snr_db", s, p, strict_start=True, what=f" (device {dev})") for dev, s in out.items()}


def load_throughput_csv(path: str | Path) -> Series:
    """``time_s,mbps`` (header) or two header-less numeric columns -> a rate series in bit/s."""
    p = _read_file(path)
    lines = p.read_text().splitlines()
    body = [(i, ln) for i, ln in enumerate(lines, start=1) if ln.strip() and not ln.lstrip().startswith("#")]
    if not body:
        raise TraceError(f"throughput trace {p}: empty")

    def split(line: str) -> list[str]:
        return [c.strip() for c in (line.split(",") if "," in line else line.split())]

    first_no, first = body[0]
    head = split(first)
    try:
        float(head[0])
        has_header = False
    except ValueError:
        has_header = True
    if has_header:
        names = [h.lower() for h in head]
        tcol = next((names.index(c) for c in ("time_s", "time") if c in names), None)
        rcol = next(((names.index(c), RATE_COLUMNS[c]) for c in RATE_COLUMNS if c in names), None)
        if tcol is None or rcol is None:
            raise TraceError(f"throughput trace {p}:{first_no}: columns {head}; required: time_s (or time) and "
                             f"one of {', '.join(RATE_COLUMNS)}")
        rows = body[1:]
        (ridx, scale) = rcol
    else:
        tcol, ridx, scale, rows = 0, 1, 1e6, body
    samples = []
    for lineno, line in rows:
        cells = split(line)
        if len(cells) <= max(tcol, ridx):
            raise TraceError(f"{_origin(p, lineno)}: {len(cells)} fields in {line!r}; expected time_s and a rate")
        t = _number(cells[tcol], p, lineno, "time_s")
        r = _check_rate(_number(cells[ridx], p, lineno, "rate"), p, lineno)
        samples.append((t, r * scale))
    return _series("rate_bps", samples, p)


def load_mahimahi(path: str | Path, bin_s: float = 0.1) -> Series:
    """A Mahimahi trace -> rate per ``bin_s`` window; the loop length is the last timestamp (mm-link's
    wrap-around), at least one bin."""
    if not (bin_s > 0 and math.isfinite(bin_s)):
        raise TraceError(f"mahimahi bin_s={bin_s!r}; allowed: a duration in s > 0")
    p = _read_file(path)
    stamps: list[int] = []
    prev = 0
    with p.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            s = line.strip()
            if not s:
                continue
            if not s.isdigit():
                raise TraceError(f"{_origin(p, lineno)}: {s!r} is not a timestamp in ms (a non-negative integer)")
            ms = int(s)
            if ms < prev:
                raise TraceError(f"{_origin(p, lineno)}: timestamp {ms} ms is before the previous one ({prev} ms); "
                                 "a Mahimahi trace is non-decreasing")
            stamps.append(ms)
            prev = ms
    if not stamps:
        raise TraceError(f"mahimahi trace {p}: no timestamps")
    if stamps[-1] <= 0:
        raise TraceError(f"mahimahi trace {p}: the last timestamp is 0 ms; the trace must last > 0 ms")
    period_s = max(stamps[-1] / 1000.0, bin_s)
    n_bins = max(1, math.ceil(period_s / bin_s - 1e-9))
    # Every line is one opportunity per pass; one at exactly the period (the last line) counts in the last bin.
    idx = np.minimum((np.asarray(stamps, dtype=float) / 1000.0 / bin_s).astype(int), n_bins - 1)
    counts = np.bincount(idx, minlength=n_bins)
    width = np.full(n_bins, bin_s)
    width[-1] = period_s - bin_s * (n_bins - 1)  # the last bin may be shorter than bin_s
    rates = counts * MAHIMAHI_PACKET_BITS / width
    return Series("rate_bps", np.arange(n_bins) * bin_s, rates, period_s, f"{p} (mahimahi, {bin_s:g} s bins)",
                  wraps=True)


def _dict_rows(p: Path) -> tuple[list[str], list[tuple[int, dict]]]:
    """The header (stripped names) and every row with its line number."""
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        fields = [f.strip() for f in (reader.fieldnames or [])]
        reader.fieldnames = fields
        return fields, [(reader.line_num, row) for row in reader]


def _pick_column(fmt: str, role: str, column: str | None, table: dict, defaults: dict, p: Path) -> str:
    if column is None:
        if role not in defaults:
            raise TraceError(f"{p}: the {fmt} format has no default column for {role!r} (it has "
                             f"{', '.join(f'{k} <- {v}' for k, v in defaults.items())}); name one with 'column'")
        column = defaults[role]
    if column not in table:
        raise TraceError(f"{p}: column={column!r} is not usable for the {fmt} format; allowed: {', '.join(table)}")
    return column


def load_ucc(path: str | Path, role: str, column: str | None = None, state: str = "D") -> Series:
    """UCC 4G/5G CSV -> the series of one column (see the module docstring for the mapping)."""
    p = _read_file(path)
    column = _pick_column("ucc", role, column, UCC_COLUMNS, UCC_DEFAULT, p)
    kind, scale = UCC_COLUMNS[column]
    fields, rows = _dict_rows(p)
    missing = [c for c in ("Timestamp", column) if c not in fields]
    if missing:
        raise TraceError(f"UCC trace {p}: missing columns {missing}; it has {fields}")
    filter_state = kind == "rate_bps" and state != "any" and "State" in fields
    per_second: dict[float, list[float]] = {}
    for lineno, row in rows:
        stamp = (row.get("Timestamp") or "").strip()
        try:
            t = datetime.strptime(stamp, "%Y.%m.%d_%H.%M.%S").timestamp()
        except ValueError:
            raise TraceError(f"{_origin(p, lineno)}: Timestamp={stamp!r}; expected YYYY.MM.DD_HH.MM.SS") from None
        if filter_state and (row.get("State") or "").strip() != state:
            continue
        x = _number(row.get(column), p, lineno, column, allow_missing=True)
        if x is None:
            continue
        if kind == "rate_bps":
            _check_rate(x, p, lineno)
        per_second.setdefault(t, []).append(x * scale)
    samples = [(t, float(np.mean(v))) for t, v in per_second.items()]
    return _series(kind, samples, p, shift=True, what=f" (ucc, {column})")


def load_lumos5g(path: str | Path, role: str, column: str | None = None, run: int | None = None,
                 mobility_mode: str | None = None, trajectory_direction: str | None = None) -> Series:
    """Lumos5G 1.0 CSV -> the series of one column of one run (see the module docstring)."""
    p = _read_file(path)
    column = _pick_column("lumos5g", role, column, LUMOS_COLUMNS, LUMOS_DEFAULT, p)
    kind, scale = LUMOS_COLUMNS[column]
    fields, rows = _dict_rows(p)
    missing = [c for c in ("run_num", "seq_num", column) if c not in fields]
    if missing:
        raise TraceError(f"Lumos5G trace {p}: missing columns {missing}; it has {fields}")
    by_run: dict[int, list[tuple[float, float]]] = {}
    order: list[int] = []
    for lineno, row in rows:
        r = _number(row["run_num"], p, lineno, "run_num")
        seq = _number(row["seq_num"], p, lineno, "seq_num")
        if mobility_mode and (row.get("mobility_mode") or "").strip() != mobility_mode:
            continue
        if trajectory_direction and (row.get("trajectory_direction") or "").strip() != trajectory_direction:
            continue
        if int(r) not in by_run:
            by_run[int(r)] = []
            order.append(int(r))
        x = _number(row.get(column), p, lineno, column, allow_missing=True)
        if x is None:
            continue
        if kind == "rate_bps":
            _check_rate(x, p, lineno)
        by_run[int(r)].append((seq, x * scale))
    if not order:
        raise TraceError(f"Lumos5G trace {p}: no rows (after the filters mobility_mode={mobility_mode!r}, "
                         f"trajectory_direction={trajectory_direction!r})")
    chosen = order[0] if run is None else int(run)
    if chosen not in by_run:
        raise TraceError(f"Lumos5G trace {p}: run={run!r} not found; runs: {sorted(by_run)}")
    return _series(kind, by_run[chosen], p, shift=True, what=f" (lumos5g run {chosen}, {column})")


def detect_format(path: str | Path) -> str:
    """Guess a trace's format: ``.up``/``.down``/all-integer lines -> mahimahi; otherwise by the CSV header."""
    p = _read_file(path)
    if p.suffix in (".up", ".down"):
        return "mahimahi"
    with p.open() as fh:
        head = [ln.strip() for _, ln in zip(range(20), fh) if ln.strip() and not ln.lstrip().startswith("#")]
    if not head:
        raise TraceError(f"trace {p}: empty; cannot tell its format")
    if all(ln.isdigit() for ln in head):
        return "mahimahi"
    cols = {c.strip() for c in head[0].replace("\t", ",").split(",")}
    lower = {c.lower() for c in cols}
    if {"device", "snr_db"} <= lower:
        return "snr_csv"
    if "DL_bitrate" in cols or "UL_bitrate" in cols:
        return "ucc"
    if "run_num" in cols and "seq_num" in cols:
        return "lumos5g"
    if lower & set(RATE_COLUMNS) or head[0].replace(",", " ").split()[0].replace(".", "", 1).isdigit():
        return "throughput_csv"
    raise TraceError(f"trace {p}: cannot tell its format from the first line {head[0]!r}; "
                     f"set format to one of {', '.join(FORMATS)}")


ENTRY_KEYS = {"path", "format", "column", "bin_s", "state", "run", "mobility_mode", "trajectory_direction",
              "device", "scale"}


def load_entry(entry: str | dict, role: str, device: str, field: str) -> Series:
    """One trace entry of a profile (a path, or a dict with ``path`` and options) for one role:
    ``ul``/``dl`` (a rate series) or ``snr`` (an SNR series). ``field`` names the profile key in errors."""
    spec = {"path": entry} if isinstance(entry, (str, Path)) else dict(entry or {})
    unknown = sorted(set(spec) - ENTRY_KEYS)
    if unknown:
        raise TraceError(f"channel config: {field} has unknown keys {unknown}; allowed: {sorted(ENTRY_KEYS)}")
    if "path" not in spec:
        raise TraceError(f"channel config: {field}.path is missing; a trace entry needs a file")
    path = spec["path"]
    fmt = spec.get("format") or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"channel config: {field}.format={fmt!r} is invalid; allowed: {', '.join(FORMATS)}")
    if fmt == "snr_csv":
        per_dev = load_snr_csv(path)
        key = spec.get("device", device)
        if key not in per_dev:
            raise TraceError(f"SNR trace {path}: no samples for device {key!r}; it has {sorted(per_dev)}")
        series = per_dev[key]
    elif fmt == "throughput_csv":
        series = load_throughput_csv(path)
    elif fmt == "mahimahi":
        series = load_mahimahi(path, float(spec.get("bin_s", 0.1)))
    elif fmt == "ucc":
        series = load_ucc(path, role, spec.get("column"), str(spec.get("state", "D")))
    else:
        series = load_lumos5g(path, role, spec.get("column"), spec.get("run"), spec.get("mobility_mode"),
                              spec.get("trajectory_direction"))
    want = "snr_db" if role == "snr" else "rate_bps"
    if series.kind != want:
        raise TraceError(f"channel config: {field} reads {series.origin}, a {series.kind} trace; "
                         f"role {role!r} needs a {want} trace")
    scale = float(spec.get("scale", 1.0))
    if scale != 1.0:
        if want != "rate_bps" or not (scale > 0 and math.isfinite(scale)):
            raise TraceError(f"channel config: {field}.scale={spec['scale']!r}; allowed: a factor > 0 on a rate trace")
        series = Series(series.kind, series.times_s, series.values * scale, series.period_s,
                        f"{series.origin} x{scale:g}", series.strict_start, series.wraps)
    return series
