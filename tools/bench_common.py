"""Shared by the tools/bench_*.py scripts: side-by-side timing under the same machine load."""

from __future__ import annotations

import statistics


def interleaved_medians(first, second, repeats: int) -> tuple[float, float]:
    """Median of `repeats` calls of each timing function, alternated so both see the same load."""
    a, b = [], []
    for _ in range(repeats):
        a.append(first())
        b.append(second())
    return statistics.median(a), statistics.median(b)
