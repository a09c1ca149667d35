"""Opt-in stamps of a round's steps in the edge and the device processes, on the host's one monotonic clock.

With ``MULTISPIN_TIMELINE=DIR`` in the environment (or `enable(DIR)`, which also sets it for the processes
started afterwards), `stamp` records (tag, time.monotonic()) and each process writes ``DIR/<pid>.json`` at
exit; `take` hands this process's stamps over instead. Without it `stamp` does nothing. Stdlib only: a
device process imports this. `tools/bench_overhead.py --timeline` reads the files and prints where a
pass-through round's time goes between the two processes (`critical_path`).
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import time
from pathlib import Path

ENV = "MULTISPIN_TIMELINE"
_events: list[tuple[str, float]] = []


def stamp(tag: str, at: float | None = None) -> None:
    """Record `tag` now (or at the monotonic time `at`); a no-op unless the timeline is on."""


def _stamp(tag: str, at: float | None = None) -> None:
    _events.append((tag, time.monotonic() if at is None else at))


def _dump() -> None:
    folder = os.environ.get(ENV)
    if folder and _events:
        (Path(folder) / f"{os.getpid()}.json").write_text(json.dumps(_events))


def enable(folder: str | Path) -> None:
    """Turn stamps on in this process and in the processes it starts from now on."""
    global stamp
    os.environ[ENV] = str(folder)
    if stamp is not _stamp:
        stamp = _stamp
        atexit.register(_dump)


def take() -> list[tuple[str, float]]:
    """This process's stamps so far (then forgotten)."""
    out = list(_events)
    _events.clear()
    return out


def load(folder: str | Path) -> list[tuple[str, float]]:
    """Every stamp the processes wrote into `folder`."""
    events: list[tuple[str, float]] = []
    for path in Path(folder).glob("*.json"):
        events.extend((tag, t) for tag, t in json.loads(path.read_text()))
    return events


def critical_path(events: list[tuple[str, float]], start: str, end: str, skip: int = 2) -> list[tuple[str, float, int]]:
    """The steps of the cycles from each `start` stamp to the next `end` stamp, in time order: (tag, the median
    of its time after `start` in ms, the cycles it occurred in). Only a tag's first stamp in a cycle counts;
    the first `skip` cycles (warm-up) are left out."""
    events = sorted(events, key=lambda e: e[1])
    offsets: dict[str, list[float]] = {}
    cycle_start = None
    cycles = 0
    seen: set[str] = set()
    for tag, t in events:
        if tag == start:
            cycle_start, seen = t, set()
            cycles += 1
        if cycle_start is None or cycles <= skip or tag in seen:
            continue
        seen.add(tag)
        offsets.setdefault(tag, []).append(1000 * (t - cycle_start))
        if tag == end:
            cycle_start = None
    rows = [(tag, statistics.median(v), len(v)) for tag, v in offsets.items()]
    return sorted(rows, key=lambda r: r[1])


if os.environ.get(ENV):
    enable(os.environ[ENV])
