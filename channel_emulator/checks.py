"""Validation of the emulator's control requests: finite numbers in range, the DL access schemes (no dependencies)."""

from __future__ import annotations

import math
from typing import Any

DL_ACCESS = ("fdma_equal_split", "fdma_fixed_split", "tdma")


def finite_number(field: str, value: Any, *, allowed: str, low: float = 0.0, low_inclusive: bool = False,
                  high: float = math.inf, error: type[Exception] = ValueError) -> float:
    """`value` as a float in (low, high) (or [low, high)); else `error` naming the field, value and range."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    above = x >= low if low_inclusive else x > low
    if not (math.isfinite(x) and above and x < high):
        raise error(f"{field}={value!r} is invalid; allowed: {allowed}")
    return x
