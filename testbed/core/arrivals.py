"""When requests arrive at a device: closed loop, Poisson, or a timestamp trace (pure functions, no I/O).

Times are seconds from the start of serving. A closed-loop request has no arrival time of its own: it arrives
when the device's previous request completes (None here; the edge fills it in), so a device always has exactly
one request in service and none waiting.
"""

from __future__ import annotations

import zlib

import numpy as np

ARRIVALS = ("closed", "poisson", "trace")


def device_rng(seed: int, device: str, stream: int = 0) -> np.random.Generator:
    """A generator of its own per (seed, device, stream): one device's arrivals do not change with the others',
    nor with its prompt draws (another stream)."""
    return np.random.default_rng([int(seed), zlib.crc32(device.encode()), int(stream)])


def poisson_arrivals(rate_per_s: float, count: int, rng: np.random.Generator) -> list[float]:
    """`count` arrival times of a Poisson process of `rate_per_s`: cumulative exponential gaps of mean
    1/rate, the first gap counted from 0."""
    if not rate_per_s > 0 or not np.isfinite(rate_per_s):
        raise ValueError(f"rate_per_s: {rate_per_s!r} must be a finite number > 0")
    if count < 0:
        raise ValueError(f"count: {count!r} must be >= 0")
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate_per_s, size=int(count)))]


def closed_arrivals(count: int) -> list[None]:
    """`count` closed-loop requests: each arrives as the previous one completes."""
    if count < 0:
        raise ValueError(f"count: {count!r} must be >= 0")
    return [None] * int(count)


def trace_arrivals(times: list[float]) -> list[float]:
    """A trace's arrival times, sorted; each finite and >= 0 (the error names the first bad one)."""
    out = []
    for i, t in enumerate(times):
        if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            raise ValueError(f"arrival {i}: {t!r} is not a finite time >= 0 (seconds from the start)")
        out.append(float(t))
    return sorted(out)
