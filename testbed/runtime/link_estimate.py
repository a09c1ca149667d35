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
distribution or a token). `DirectionEstimate` fits that line over recent rounds: messages are grouped by
size (10% bins), the minimum time of each group's latest few messages is kept (the delays a shared host or
network adds are one-sided; the latest, so that a link whose rate changes is followed),
and a least-squares line through the group minima gives the slope 1/r and the intercept a (as
`channel_emulator.link_probe.fit_sweep` does for a size sweep); through the large messages only when they
alone spread in size (a shaper's burst, see `fit_line`). A fit counts only from 4 messages on, when the
sizes spread (largest >= 2 x smallest) and the transfer at the largest size stands out of the residual
scatter; else the link is too fast for these sizes to tell and no rate is claimed. With only one large
size and small ones, the line goes through both: a burst then shows as a higher rate, and the plan's air
time of that large message is still right (it is what the line was fitted to). A direction whose messages
all have one size (DL mode at one draft length: every measured verdict a distribution) takes the other
direction's small messages as its intercept (`LinkEstimator.small_anchor`).

A direction the current mode does not load with large messages (a DL-mode device uploads small drafts, a
UL-mode device gets small verdicts) is measured by probe sweeps instead (`edge_node.probing`): their fits
are kept apart (`set_probe`; a probe round trip has another intercept), and `choose` plans with the more
recent of the two and says which ("rounds", "probe", or "model" when neither exists).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from testbed.core.vocabulary import DIRECTIONS

# Messages whose sizes differ by less than 10% share a group: a group's minimum is then taken over more
# messages (small ones differ by a few header bytes), and draft lengths L and L + 1 still differ by more.
SIZE_BIN = 0.10
MIN_GROUPS = 2        # a slope needs two sizes
MIN_SAMPLES = 4       # ... and a few messages: one late message must not set the rate on its own
GROUP_RECENT = 4      # a size group's time: the minimum over its latest this many messages
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
    """time = intercept_s + 8 bytes / rate_bps over `n` messages (through `groups` size groups)."""

    rate_bps: float
    intercept_s: float
    n: int
    groups: int
    resid_rms_s: float

    def to_dict(self) -> dict:
        return asdict(self)


class DirectionEstimate:
    """One direction of one device's link: the recent (bytes, seconds) samples and their fit."""

    def __init__(self, window: int = 40):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.times: deque[float | None] = deque(maxlen=window)  # the edge clock of each sample (None: not given)
        self.fit: LinkFit | None = None
        self.fresh_t: float | None = None  # when the fit's large messages were last measured (see `_fresh`)

    def add(self, nbytes: int, seconds: float, anchor: tuple[int, float] | None = None,
            t: float | None = None) -> LinkFit | None:
        """Add one message's size and time (`t`: when, on the edge clock); returns the refitted line (None
        while it cannot tell)."""
        if nbytes > 0 and math.isfinite(seconds):
            self.samples.append((int(nbytes), float(seconds)))
            self.times.append(t)
            self.fit = fit_line(list(self.samples), anchor)
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


def _group_minima(samples: list[tuple[int, float]]) -> dict[int, tuple[int, float]]:
    """Size group -> its fastest message among the group's latest GROUP_RECENT: robust to one late message,
    and it follows a link whose rate changed (a tbf limit lowered mid-run) within that many messages."""
    recent: dict[int, list[tuple[int, float]]] = {}
    for nbytes, t in samples:
        recent.setdefault(round(math.log(nbytes) / math.log1p(SIZE_BIN)), []).append((nbytes, t))
    return {k: min(v[-GROUP_RECENT:], key=lambda s: s[1]) for k, v in recent.items()}


def fit_line(samples: list[tuple[int, float]], anchor: tuple[int, float] | None = None) -> LinkFit | None:
    """The line through the per-size-group minimum times (see the module); None when it cannot tell.
    `anchor`: a small message's (bytes, time) that stands for the intercept when every sample has one size
    (see `LinkEstimator.small_anchor`)."""
    if len(samples) < MIN_SAMPLES:
        return None
    groups = _group_minima(samples)
    if len(groups) == 1 and anchor is not None and anchor[0] * ANCHOR_RATIO <= min(b for b, _ in samples):
        groups[-1] = anchor
    if len(groups) < MIN_GROUPS:
        return None
    points = sorted(groups.values())
    # A token bucket (a shaper, tc tbf) lets its burst through at line rate: a message larger than the burst
    # takes a + (bytes - burst) / r, a line of the same slope as the rate's but a lower intercept than the
    # small messages'. A line through small and large messages then overstates the rate (seen: +21% with
    # a 10 kB burst and 64 kB uploads), so when the large messages alone spread, the line goes through them.
    large = [(b, t) for b, t in points if b >= LARGE_FRACTION * points[-1][0]]
    if len(large) >= MIN_GROUPS and large[-1][0] >= LARGE_SPREAD * large[0][0]:
        points = large
    xs = [float(b) for b, _ in points]
    ys = [t for _, t in points]
    if max(xs) < MIN_SPREAD * min(xs) and points is not large:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if not slope > 0:
        return None
    intercept = my - slope * mx
    resid = math.sqrt(sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys)) / len(xs))
    if slope * max(xs) < MIN_SIGNIFICANCE * resid:
        return None
    return LinkFit(rate_bps=8.0 / slope, intercept_s=intercept, n=len(samples), groups=len(points),
                   resid_rms_s=resid)


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
        """The other direction's smallest size group, (bytes, time), for a direction whose messages all have
        one size (DL mode at one draft length: every verdict a distribution). Both measurements are one small
        message each way plus the message whose size varies (schedule + draft, verdict + report), so a small
        message's time there is this direction's intercept too."""
        other = self._dir(name, "dl" if direction == "ul" else "ul")
        if not other.samples:
            return None
        return min(_group_minima(list(other.samples)).values())

    def observe(self, name: str, direction: str, nbytes: int, seconds: float, t: float | None = None) -> dict:
        """Add one message (`t`: when, on the edge clock) and return its entry for the round record: the
        time as measured (``raw_s``), the transfer time by the fit made before it (``s``: raw minus that
        intercept; None before a fit), and the fit after it."""
        est = self._dir(name, direction)
        before = est.fit
        after = est.add(nbytes, seconds, anchor=self.small_anchor(name, direction), t=t)
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
