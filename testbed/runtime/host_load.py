"""How busy this host is: the delay of a thread's wake-up and the CPU time other processes take (Linux /proc).

A timing measurement on a host shared with other work (CI runners, other users, a VM's neighbours) misses its
tolerance when the scheduler wakes its threads late; `multispin channel validate` measures both figures before
and during a validation and, when cells miss, says whether the host was too busy for their tolerance
(`busy_hint`). Standard library only."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from statistics import median

WAKEUP_SAMPLES = 200
WAKEUP_SLEEP_S = 0.001


@dataclass(frozen=True)
class Wakeups:
    """How late `time.sleep(sleep_s)` returned: the median and 95th percentile over `samples` sleeps."""

    median_s: float
    p95_s: float
    samples: int

    def to_dict(self) -> dict:
        return {"median_s": self.median_s, "p95_s": self.p95_s, "samples": self.samples}


def wakeup_delays(samples: int = WAKEUP_SAMPLES, sleep_s: float = WAKEUP_SLEEP_S) -> Wakeups:
    """Sleep `samples` times for `sleep_s` and measure how much longer each took (the scheduler's wake-up delay
    plus the timer's slack): on an idle core tens of microseconds, on a busy one milliseconds."""
    late = []
    for _ in range(samples):
        t0 = time.perf_counter()
        time.sleep(sleep_s)
        late.append(max(0.0, time.perf_counter() - t0 - sleep_s))
    late.sort()
    return Wakeups(median(late), late[min(len(late) - 1, int(0.95 * len(late)))], samples)


@dataclass(frozen=True)
class CpuSnapshot:
    """The host's busy CPU seconds (all processes, /proc/stat) and this process's own (itself and its waited
    children) at one instant."""

    wall_s: float
    host_busy_s: float | None  # None: no /proc/stat (not Linux)
    own_s: float


def _host_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_snapshot() -> CpuSnapshot:
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return CpuSnapshot(time.monotonic(), _host_busy_s(), own)


def others_share(before: CpuSnapshot, after: CpuSnapshot, extra_own_s: float = 0.0) -> float | None:
    """The share of the host's CPUs (0..1) that other processes than this one (and its waited children, and
    `extra_own_s` more: a child still running) kept busy between the two snapshots; None without /proc/stat."""
    if before.host_busy_s is None or after.host_busy_s is None or after.wall_s <= before.wall_s:
        return None
    others = (after.host_busy_s - before.host_busy_s) - (after.own_s - before.own_s) - extra_own_s
    return min(1.0, max(0.0, others / ((after.wall_s - before.wall_s) * (os.cpu_count() or 1))))


def busy_hint(tolerances_s: list[float], before: Wakeups, during_share: float | None,
              after: Wakeups | None = None) -> str | None:
    """Why cells that missed their tolerances (`tolerances_s`: the error each was allowed, in seconds) may say
    more about this host than about the emulator: a wake-up delay (median, before or after the run) above
    the smallest tolerance, or other processes holding more than half of the CPUs during it. None when the
    host looked quiet enough: the misses are the emulator's."""
    if not tolerances_s:
        return None
    tightest = min(tolerances_s)
    worst = max([before] + ([after] if after is not None else []), key=lambda w: w.median_s)
    late = worst.median_s > tightest
    crowded = during_share is not None and during_share > 0.5
    if not (late or crowded):
        return None
    said = [f"a 1 ms sleep woke up {1e6 * worst.median_s:.0f} us late (median; p95 {1e6 * worst.p95_s:.0f} us)"]
    if during_share is not None:
        said.append(f"other processes kept {100 * during_share:.0f}% of its {os.cpu_count()} CPUs busy during the "
                    "validation")
    return (f"this host is too busy for the tolerance of the missed cells (their error allowed: "
            f"{1e6 * tightest:.0f} us at the tightest): " + "; ".join(said)
            + ". Run it on an idle host (or with fewer other jobs), or validate longer air times (larger --sizes, "
              "lower --rates), whose tolerance is wider than these delays")
