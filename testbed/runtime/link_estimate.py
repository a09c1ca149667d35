"""Online rate estimates of a real link from what the edge measures (`channel.measure_links`).

Without an emulator (``channel.mode: passthrough``) nothing annotates air time, and device and edge clocks
are not synchronized. The edge only compares instants of its own clock, with durations the device measured
on its own:

- uplink: schedule sent (edge) -> draft arrived (edge), minus the device's drafting time ``draft_s``
  = the schedule's one-way trip + the device's send overhead + the draft's one-way trip;
- downlink: verdict sent (edge) -> report arrived (edge), minus the device's ``correction_s``
  = the verdict's one-way trip + the report's one-way trip.

Each is ``a + 8 x bytes / r``: a constant (latencies, small messages, scheduling) plus the transfer of the
message whose size varies (the draft: megabytes in UL mode, hundreds of bytes in DL mode; the verdict: a
distribution or a token). `DirectionEstimate` fits that line over recent rounds (`fit_line`), robustly:

- messages are grouped by size (10% bins) and each group is the latest GROUP_RECENT of its messages (so that
  a link whose rate changes is followed); a group's time is its fastest message's (the delays a shared host,
  a busy edge or the network add are one-sided), and a group of one message counts not at all: one delayed
  message never sets a point of the line (before, a lone delayed small verdict set the downlink's intercept
  for the rest of a run: +5% to +43%);
- the slope is Theil-Sen's (the median of the slopes between every two groups) and the intercept the
  median of the groups' residuals: with three sizes or more, one bad group cannot tilt the line either;
- a token bucket (a shaper, tc tbf) lets its first `burst` bytes through at line rate, so a message larger
  than it takes a + 8 (bytes - burst) / r: a line through small and large messages would overstate the rate
  by about burst / size (+5% for tbf's 15 kB at 30 Mbit/s next to 304 kB). The line goes through the large
  messages alone (>= LARGE_FRACTION of the largest) when they spread by LARGE_SPREAD; else, when a probe
  sweep measured the burst (`burst_of`, `LinkEstimator.set_probe`), against the bytes past the burst.

A fit counts only from 4 messages on, when the sizes spread (largest >= 2 x smallest) and the transfer at
the largest size stands out of the residual scatter; else the link is too fast for these sizes to tell and
no rate is claimed. A direction whose messages all have one size (DL mode at one draft length: every
measured verdict a distribution) takes as its intercept the faster of the other direction's small messages
and its own latest sweep's small probes (`LinkEstimator.small_anchor`).

A direction the current mode does not load with large messages (a DL-mode device uploads small drafts, a
UL-mode device gets small verdicts) is measured by probe sweeps instead (`edge_node.probing`): their fits
are kept apart (`set_probe`; a probe round trip has another intercept), and `choose` plans with the more
recent of the two and says which ("rounds", "probe", or "model" when neither exists).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass

from testbed.core.vocabulary import DIRECTIONS

# Messages whose sizes differ by less than 10% share a group: a group's minimum is then taken over more
# messages (small ones differ by a few header bytes), and draft lengths L and L + 1 still differ by more.
SIZE_BIN = 0.10
MIN_GROUPS = 2        # a slope needs two sizes
MIN_SAMPLES = 4       # ... and a few messages: one late message must not set the rate on its own
# A size group is its latest this many messages (`group_time`): at 4, runs of 4 delayed 304 kB uploads in a
# row on a loaded host (+7 ms each) read a 30 Mbit/s uplink -8%; a rate that drops is followed within this many.
GROUP_RECENT = 8
GROUP_MIN_N = 2       # ... and counts from this many on: a lone (delayed) message sets no point
MIN_SPREAD = 2.0      # largest / smallest size of the groups
MIN_SIGNIFICANCE = 3.0  # transfer time at the largest size / residual RMS
LARGE_FRACTION = 0.25  # "large" messages: at least this fraction of the largest one ...
LARGE_SPREAD = 1.5     # ... and a line through them alone when they spread this much
# The other direction's small message stands for the intercept only next to messages this many times larger:
# the two paths' intercepts differ by milliseconds (the device's send overhead), which only a long transfer
# makes negligible (a 344-byte draft next to a 72-byte verdict would give a rate of noise).
ANCHOR_RATIO = 100


@dataclass(frozen=True)
class LinkFit:
    """time = intercept_s + 8 (bytes - burst_bytes) / rate_bps over `n` messages (through `groups` size
    groups); `burst_bytes`: the token bucket's burst the line accounted for (0: none; a probe sweep's fit:
    the burst it measured, `burst_of`); `small_bytes`, `small_s`: a probe sweep's small probes' size and time
    (below the burst; 0 and None when it had none)."""

    rate_bps: float
    intercept_s: float
    n: int
    groups: int
    resid_rms_s: float
    burst_bytes: float = 0.0
    small_bytes: int = 0
    small_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class DirectionEstimate:
    """One direction of one device's link: the recent (bytes, seconds) samples and their fit."""

    def __init__(self, window: int = 40, recent: int = GROUP_RECENT):
        self.recent = recent  # as `group_points` takes it
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.times: deque[float | None] = deque(maxlen=window)  # the edge clock of each sample (None: not given)
        self.fit: LinkFit | None = None
        self.fresh_t: float | None = None  # when the fit's large messages were last measured (see `_fresh`)

    def add(self, nbytes: int, seconds: float, anchor: tuple[int, float] | None = None,
            t: float | None = None, burst_bytes: float = 0.0) -> LinkFit | None:
        """Add one message's size and time (`t`: when, on the edge clock); returns the refitted line (None
        while it cannot tell). `anchor`, `burst_bytes`: as `fit_line` takes them."""
        if nbytes > 0 and math.isfinite(seconds):
            self.samples.append((int(nbytes), float(seconds)))
            self.times.append(t)
            self.fit = fit_line(list(self.samples), anchor, burst_bytes, self.recent)
            self.fresh_t = self._fresh()
        return self.fit

    def _fresh(self) -> float | None:
        """The latest time a large message (>= LARGE_FRACTION of the largest in the window) was measured: a
        fit is as fresh as its slope, which small messages alone do not renew (a DL-mode device's uploads)."""
        if self.fit is None:
            return None
        top = max(b for b, _ in self.samples)
        times = [t for (b, _), t in zip(self.samples, self.times) if b >= LARGE_FRACTION * top and t is not None]
        return max(times, default=None)


def next_sweep_size(size: int, rtt_s: float, target_s: float, max_bytes: int) -> int | None:
    """A size sweep's growth (`multispin channel probe`, the edge's `edge_node.probing`): the size after `size`
    took `rtt_s`, or None when the growth is over (`target_s` or `max_bytes` reached)."""
    if rtt_s >= target_s or size >= max_bytes:
        return None
    # Jump by the shortfall (x2..x16): few steps from tiny sizes, little overshoot near the target.
    return min(max_bytes, int(size * min(16.0, max(2.0, 0.8 * target_s / max(rtt_s, 1e-6)))))


def group_time(times: list[float]) -> float | None:
    """A size group's time: its fastest message's, from GROUP_MIN_N messages on (None before). The delays a
    shared host or network adds are one-sided, so the fast end is the link's, and one delayed message cannot
    move it. (The second fastest, robust to a message timed too fast as well, read a 30 Mbit/s downlink -11%
    on a loaded host, where most verdicts were delayed.)"""
    return min(times) if len(times) >= GROUP_MIN_N else None


def group_points(samples: list[tuple[int, float]], recent: int = GROUP_RECENT) -> list[tuple[int, float]]:
    """(bytes, time) per size group of at least GROUP_MIN_N messages, over each group's latest `recent` (a
    link whose rate changed, a tbf limit lowered mid-run, is followed within that many), by size."""
    groups: dict[int, list[tuple[int, float]]] = {}
    for nbytes, t in samples:
        groups.setdefault(round(math.log(nbytes) / math.log1p(SIZE_BIN)), []).append((nbytes, t))
    points = []
    for group in groups.values():
        group = group[-recent:]
        t = group_time([x for _, x in group])
        if t is not None:
            points.append((sorted(b for b, _ in group)[len(group) // 2], t))
    return sorted(points)


def theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(slope, intercept): the median of the slopes between every two points of different x, and the median
    of the residuals y - slope x; None without two distinct x."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(len(xs)) if xs[j] > xs[i]]
    if not slopes:
        return None
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys))


def fit_line(samples: list[tuple[int, float]], anchor: tuple[int, float] | None = None,
             burst_bytes: float = 0.0, recent: int = GROUP_RECENT) -> LinkFit | None:
    """The robust line through the size groups' times (see the module); None when it cannot tell. `anchor`:
    a small message's (bytes, time) that stands for the intercept when every sample has one size (see
    `LinkEstimator.small_anchor`); `burst_bytes`: a token bucket's burst, measured by a probe sweep, for a
    line that has to go through small and large messages (0: unknown); `recent`: as `group_points` takes it."""
    if len(samples) < MIN_SAMPLES:
        return None
    points = group_points(samples, recent)
    if len(points) == 1 and anchor is not None and anchor[0] * ANCHOR_RATIO <= points[0][0]:
        points = [anchor, *points]
    if len(points) < MIN_GROUPS:
        return None
    # The large messages alone, when they spread: a shaper's burst then shifts the intercept, not the slope.
    large = [(b, t) for b, t in points if b >= LARGE_FRACTION * points[-1][0]]
    burst = 0.0
    if len(large) >= MIN_GROUPS and large[-1][0] >= LARGE_SPREAD * large[0][0]:
        points = large
    elif points[-1][0] < MIN_SPREAD * points[0][0]:
        return None
    else:
        burst = max(0.0, min(burst_bytes, LARGE_FRACTION * points[-1][0]))  # a line through small and large
    xs = [max(0.0, b - burst) for b, _ in points]
    ys = [t for _, t in points]
    line = theil_sen(xs, ys)
    if line is None or not line[0] > 0:
        return None
    slope, intercept = line
    resid = math.sqrt(sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / len(xs))
    if slope * max(xs) < MIN_SIGNIFICANCE * resid:
        return None
    return LinkFit(rate_bps=8.0 / slope, intercept_s=intercept, n=len(samples), groups=len(points),
                   resid_rms_s=resid, burst_bytes=burst)


def small_point(samples: list[tuple[int, float]], fit: LinkFit) -> tuple[int, float | None]:
    """A sweep's small size and its time (its fastest of two or more), when that size is left out of the line
    (below LARGE_FRACTION of the largest); else (0, None)."""
    points = group_points(samples, recent=len(samples))
    if not points or fit.burst_bytes or points[0][0] >= LARGE_FRACTION * points[-1][0]:
        return 0, None
    return points[0]


def burst_of(samples: list[tuple[int, float]], fit: LinkFit) -> float:
    """The token bucket's burst (bytes) that a sweep's samples show: a message below the burst passes at line
    rate and takes the intercept a, one above it a + 8 (bytes - burst) / r, i.e. the line through the large
    messages meets the small one's time at burst = (t_small - intercept) r / 8. 0 without a small size left
    out of the line (one below LARGE_FRACTION of the largest), or when it shows none."""
    points = group_points(samples, recent=len(samples))
    if not points or fit.burst_bytes or points[0][0] >= LARGE_FRACTION * points[-1][0]:
        return 0.0
    small_bytes, small_t = points[0]
    burst = (small_t - fit.intercept_s) * fit.rate_bps / 8.0
    return max(0.0, min(burst, LARGE_FRACTION * points[-1][0])) if burst > small_bytes else 0.0


class LinkEstimator:
    """Per device, the uplink and downlink estimates; `rates` is what the controller plans with."""

    def __init__(self, window: int = 40):
        self.window = window
        self.links: dict[str, dict[str, DirectionEstimate]] = {}
        self.probes: dict[str, dict[str, tuple[LinkFit, float]]] = {}  # name -> direction -> (fit, ended at)

    def _dir(self, name: str, direction: str) -> DirectionEstimate:
        per = self.links.setdefault(name, {"ul": DirectionEstimate(self.window), "dl": DirectionEstimate(self.window)})
        return per[direction]

    def fit(self, name: str, direction: str) -> LinkFit | None:
        return self._dir(name, direction).fit

    def small_anchor(self, name: str, direction: str) -> tuple[int, float] | None:
        """A small message's (bytes, time) for a direction whose messages all have one size (DL mode at one
        draft length: every verdict a distribution): the other direction's smallest size group, or this
        direction's latest probe sweep's small probes, whichever is faster. Each is one small message each way
        (schedule + draft, verdict + report, probe + echo), so its time is this direction's intercept too, up
        to the device's handling (0.4 ms apart, measured); on a loaded host the rounds' small messages were
        delayed by ms for many rounds in a row, the sweep's fastest less."""
        other = self._dir(name, "dl" if direction == "ul" else "ul")
        points = group_points(list(other.samples))  # groups of two messages or more: one late one sets nothing
        probe = self.probe_fit(name, direction)
        if probe is not None and probe[0].small_s is not None:
            points.append((probe[0].small_bytes, probe[0].small_s))
        return min(points, key=lambda p: p[1], default=None)

    def burst(self, name: str, direction: str) -> float:
        """The token bucket's burst (bytes) the latest probe sweep of `direction` measured (0: none)."""
        probe = self.probe_fit(name, direction)
        return 0.0 if probe is None else probe[0].burst_bytes

    def observe(self, name: str, direction: str, nbytes: int, seconds: float, t: float | None = None) -> dict:
        """Add one message (`t`: when, on the edge clock) and return its entry for the round record: the
        time as measured (``raw_s``), the transfer time by the fit made before it (``s``: raw minus that
        intercept; None before a fit), and the fit after it."""
        est = self._dir(name, direction)
        before = est.fit
        after = est.add(nbytes, seconds, anchor=self.small_anchor(name, direction), t=t,
                        burst_bytes=self.burst(name, direction))
        return {"bytes": int(nbytes), "raw_s": seconds,
                "s": None if before is None else max(0.0, seconds - before.intercept_s),
                "fit": None if after is None else after.to_dict()}

    def rates(self, name: str) -> dict[str, float | None]:
        """{"ul": bit/s or None, "dl": bit/s or None}: the rates fitted to the rounds' messages (None: not
        measurable yet). `plan_rates` combines them with the probes'."""
        return {d: (None if (f := self.fit(name, d)) is None else f.rate_bps) for d in DIRECTIONS}

    # -- probe sweeps (`edge_node.probing`) ----------------------------------------------------------
    def set_probe(self, name: str, direction: str, fit: LinkFit | None, t: float) -> None:
        """A probe sweep of `direction` ended at `t` (edge clock) with `fit` (None: it could not tell). A
        sweep is one measurement: its fit replaces the previous sweep's; a sweep without a fit keeps it.
        Probe round trips have their own intercept (a probe and its echo, not a schedule and a draft), so
        their fits are kept apart from the rounds' and only their rates are compared."""
        if fit is not None:
            self.probes.setdefault(name, {})[direction] = (fit, t)

    def probe_fit(self, name: str, direction: str) -> tuple[LinkFit, float] | None:
        """(the latest probe sweep's fit, when it ended), or None."""
        return self.probes.get(name, {}).get(direction)

    def choose(self, name: str, direction: str) -> tuple[float | None, str]:
        """The rate to plan `direction` with and its source: the most recent measurement, "rounds" (the fit
        to the rounds' messages, dated by its latest large message) or "probe" (the latest sweep's fit; a
        tie goes to the rounds), else (None, "model"): the model's rate. Sweeps run when the rounds do not
        measure a direction (`edge_node.probing`), so a direction the rounds load is planned with their fit,
        and one they stopped loading with the sweep made since."""
        est = self._dir(name, direction)
        rounds, probe = est.fit, self.probe_fit(name, direction)
        t_rounds = -math.inf if est.fresh_t is None else est.fresh_t
        if rounds is not None and (probe is None or t_rounds >= probe[1]):
            return rounds.rate_bps, "rounds"
        if probe is not None:
            return probe[0].rate_bps, "probe"
        return None, "model"

    def plan_rates(self, name: str) -> tuple[dict[str, float | None], dict[str, str]]:
        """({"ul", "dl"}: bit/s or None, {"ul", "dl"}: "rounds" | "probe" | "model"), by `choose`."""
        chosen = {d: self.choose(name, d) for d in DIRECTIONS}
        return {d: c[0] for d, c in chosen.items()}, {d: c[1] for d, c in chosen.items()}

    def last_measured(self, name: str, direction: str) -> float | None:
        """When `direction`'s rate was last measured (edge clock): the rounds fit's freshness or the latest
        probe sweep, whichever is later; None if never."""
        fresh = self._dir(name, direction).fresh_t
        probe = self.probe_fit(name, direction)
        times = [t for t in (fresh, None if probe is None else probe[1]) if t is not None]
        return max(times, default=None)
