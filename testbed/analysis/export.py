"""A flat table of a run's round records: one row per device per round (`multispin report RUN --csv`).

rounds.jsonl is nested (round -> devices -> predicted / measured); analysis tools want one flat row per
device and round. Columns, in this order: `run` (only when several runs are exported together), the run's
own `policy`, `seed`, `tags` (';'-joined), `status` (complete, degraded, ...), `fallback_rounds` (the run's
rounds not planned as the profile says) and, for a campaign's run, `sweep_key` and `sweep_value`, then `round`,
`fallback` (why this round fell back: the kinds, ';'-joined, e.g. plugin_error; empty: it did not), `device`,
the device's schedule (`mode`, `draft_len`, powers), its outcome (`missed`, `n_accepted`, ...),
`estimate_*`, `predicted_*` and `measured_*` (the device's, same names as in the record), the emulator's
annotations `ul_channel_*` / `dl_channel_*`, then the round's own fields as `round_*` (`round_time_base`,
`round_predicted_goodput_tps`, `round_measured_round_s`, ...). Names and units: docs/system-model.md, section 10.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from testbed.analysis.report import fallback_kinds, summarize_fallbacks
from testbed.runtime.errors import TestbedError

# Columns of the device entry, in this order after `round, device`: its own values, then these prefixes.
_DEVICE_PREFIXES = ("estimate_", "predicted_", "measured_", "ul_channel_", "dl_channel_")


def _flat(prefix: str, obj: Any, out: dict) -> None:
    """Nested dicts as prefix_key columns; lists as ';'-joined text (e.g. the round's missed devices)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}_{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        out[prefix] = ";".join(str(x) for x in obj)
    else:
        out[prefix] = obj


def run_context(meta: dict, records: list[dict] | None = None) -> dict:
    """The run's own columns of every row, from its meta.json: `policy`, `seed`, `tags` (';'-joined), `status`,
    with its `records` `fallback_rounds` (as summary.json's `fallbacks.rounds`), and for a campaign's run
    `sweep_key` and `sweep_value` (the point)."""
    prof = meta.get("profile") if isinstance(meta.get("profile"), dict) else {}
    tags = meta.get("tags") if isinstance(meta.get("tags"), list) else []
    out = {"policy": prof.get("policy"), "seed": prof.get("seed", meta.get("seed")),
           "tags": ";".join(str(t) for t in tags), "status": meta.get("status")}
    if records is not None:
        out["fallback_rounds"] = summarize_fallbacks(records)["rounds"]
    sweep = meta.get("sweep")
    if isinstance(sweep, dict):
        out["sweep_key"], out["sweep_value"] = sweep.get("key"), sweep.get("value")
    return out


def device_rows(records: list[dict], run: str | None = None, context: dict | None = None) -> list[dict]:
    """One flat row per device per round (a device that missed the round has no measured_* values), after
    `run` (several runs) and the run's `context` columns (`run_context`). The round's own fields follow as
    round_* (round_predicted_goodput_tps, round_time_base, ...)."""
    rows = []
    for rec in records:
        round_part: dict = {}
        for k, v in rec.items():
            if k not in ("round", "devices"):
                _flat(f"round_{k}", v, round_part)
        for name, dev in (rec.get("devices") or {}).items():
            row: dict = {"run": run} if run is not None else {}
            row.update(context or {})
            row["round"] = rec.get("round")
            row["fallback"] = ";".join(fallback_kinds(rec))
            row["device"] = name
            _flat("", dev, row)
            row.update(round_part)
            rows.append(row)
    return rows


_LEADING = ("run", "policy", "seed", "tags", "status", "fallback_rounds", "sweep_key", "sweep_value", "round",
            "fallback", "device")


def _rank(col: str) -> int:
    if col in _LEADING:
        return _LEADING.index(col)
    if col.startswith("round_"):
        return 30 if col.startswith("round_predicted_") else 31 if col.startswith("round_measured_") else 29
    for g, prefix in enumerate(_DEVICE_PREFIXES):
        if col.startswith(prefix):
            return 21 + g
    return 20  # the device's own values: mode, draft_len, powers, missed, n_accepted, ...


def columns(rows: list[dict]) -> list[str]:
    """Every column of `rows`, grouped as in the module's docstring, first-seen order within a group."""
    seen: dict[str, int] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, len(seen))
    return sorted(seen, key=lambda c: (_rank(c), seen[c]))


def write_csv(rows: list[dict], path: str | Path) -> int:
    """CSV with a header row (None as an empty cell); `path` '-' is stdout. Returns the number of rows."""
    cols = columns(rows)
    if str(path) == "-":
        w = csv.DictWriter(sys.stdout, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        sys.stdout.flush()
        return len(rows)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    except OSError as exc:
        raise TestbedError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return len(rows)


PARQUET_MISSING = ("--parquet needs pyarrow: pip install 'multispin-testbed[parquet]' (or pip install pyarrow); "
                   "--csv writes the same table")


def _arrow_column(pa, values: list):
    """One column as an Arrow array: its own type where the values share one (None as null), else text
    (a column mixing, say, numbers and words keeps every value, as the CSV does)."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], type=pa.string())


def write_parquet(rows: list[dict], path: str | Path) -> int:
    """The same table as write_csv's (same columns in the same order, one row per device per round) as
    Parquet, with pyarrow (the `parquet` extra); a clear error without it. Returns the number of rows."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise TestbedError(PARQUET_MISSING) from None
    cols = columns(rows)
    table = pa.table({c: _arrow_column(pa, [r.get(c) for r in rows]) for c in cols})
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, str(path))
    except OSError as exc:
        raise TestbedError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return len(rows)
