"""The robust link fit (`testbed.runtime.link_estimate`): one delayed message and a token bucket's
burst do not move the estimate beyond a stated bound, where the fits it replaced (least squares through
every message, or through the per-size minima with a lone message as a size) move past it.

Statistical checks: seeded trials (fixed seeds, so no false alarms from run to run); each bound is stated
next to the worst error seen over the trials of the robust fit."""

from __future__ import annotations

import math
import random

import pytest

from testbed.runtime.link_estimate import GROUP_RECENT, SIZE_BIN, LinkEstimator, LinkFit, burst_of, fit_line, group_time

RATE = 28.7e6  # bit/s: the payload rate tbf leaves TCP at 30 Mbit/s
A = 0.0014     # s: the intercept (latencies, small messages)
BOUND = 0.015  # the robust fit's error bound in these trials (the target is 5% end to end)
BURST_BOUND = 0.025  # ... with a burst measured by a sweep: its error (+-25% here) adds up to 1.2% (15 / 304 kB)


def _least_squares(samples: list[tuple[int, float]]) -> float:
    """Rate (bit/s) of the plain least-squares line through every sample: the reference that moves."""
    xs, ys = [float(b) for b, _ in samples], [t for _, t in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 8.0 / slope


def _old_min_groups(samples: list[tuple[int, float]]) -> float:
    """Rate of the fit this module had before: least squares through each size group's minimum over its latest
    GROUP_RECENT messages, a group of one message included."""
    groups: dict[int, list[float]] = {}
    for b, t in samples:
        groups.setdefault(round(math.log(b) / math.log1p(SIZE_BIN)), []).append((b, t))
    return _least_squares([min(g[-GROUP_RECENT:], key=lambda s: s[1]) for g in groups.values()])


def _noisy(rng: random.Random, sizes, burst: float = 0.0) -> list[tuple[int, float]]:
    """Messages through a token bucket of `burst` bytes at RATE, with one-sided delays (0.3 ms mean)."""
    return [(s, A + 8 * max(0.0, s - burst) / RATE + rng.expovariate(1 / 3e-4)) for s in sizes]


def test_a_size_group_is_robust_to_one_delayed_message():
    assert group_time([0.010]) is None  # a lone message sets nothing
    assert group_time([0.090, 0.010]) == 0.010  # one delayed of two
    assert group_time([0.010, 0.011, 0.013, 0.050]) == 0.010


def test_one_delayed_small_message_does_not_move_the_estimate():
    """100 seeded trials: UL-mode uploads of three sizes and small ones, one small message delayed by 5-60 ms
    (a busy host, a late read). The robust fit stays within BOUND in every trial (worst seen: 0.5%); least
    squares through every message moves past it in 99 of 100."""
    errors, moved = [], 0
    for seed in range(100):
        rng = random.Random(seed)
        sizes = [400, 100_000, 200_000, 304_000] * 4
        samples = _noisy(rng, sizes)
        k = rng.choice([i for i, s in enumerate(sizes) if s == 400])
        samples[k] = (400, samples[k][1] + rng.uniform(0.005, 0.06))
        errors.append(abs(fit_line(samples).rate_bps / RATE - 1))
        moved += abs(_least_squares(samples) / RATE - 1) > BOUND
    assert max(errors) < BOUND, max(errors)
    assert moved >= 50, moved


def test_a_lone_delayed_message_sets_no_intercept_where_the_old_fit_took_it():
    """The issue's case: a DL-mode device's verdicts all have one size (304 kB), and one delayed small verdict
    (a UL-mode round's token) made the old fit's second point: the rate read +5% to +43%. Now a lone message
    is no point; the intercept comes from the other direction's small messages (two or more)."""
    rng = random.Random(7)
    est = LinkEstimator()
    est.observe("d", "dl", 72, A + 0.006)  # the lone small verdict, delayed by 6 ms
    for _ in range(6):
        est.observe("d", "dl", 304_004, A + 8 * 304_004 / RATE + rng.expovariate(1 / 3e-4))
    dl = [(72, A + 0.006)] + [(304_004, A + 8 * 304_004 / RATE)] * 6
    assert _old_min_groups(dl) / RATE - 1 > 0.05  # the old fit: +8%
    assert est.rates("d")["dl"] is None  # nothing to anchor it yet: no rate rather than a wrong one
    for _ in range(3):  # the device's small drafts (DL mode), one of them delayed too
        est.observe("d", "ul", 344, A + rng.expovariate(1 / 3e-4))
    est.observe("d", "ul", 344, A + 0.009)
    est.observe("d", "dl", 304_004, A + 8 * 304_004 / RATE + rng.expovariate(1 / 3e-4))
    assert est.rates("d")["dl"] == pytest.approx(RATE, rel=BOUND)


def test_the_burst_measured_by_a_sweep_keeps_a_line_through_small_and_large_messages_at_the_rate():
    """tbf at 30 Mbit/s lets 15 kB through at line rate. A probe sweep (a small size and three large ones)
    measures that burst; the rounds' line through small drafts and one size of verdict then accounts for it.
    Without it the line reads +5% (15 / 304 kB): least squares and the fit alike."""
    burst = 15_000
    rng = random.Random(3)
    sweep = _noisy(rng, [1024, 76_000, 190_000, 304_000] * 3, burst=burst)
    probe = fit_line(sweep)
    assert probe.rate_bps == pytest.approx(RATE, rel=0.005)  # the large sizes alone: no burst in the slope
    measured = burst_of(sweep, probe)
    assert measured == pytest.approx(burst, rel=0.15)
    rounds = _noisy(rng, [400, 304_000] * 6, burst=burst)
    assert fit_line(rounds).rate_bps / RATE - 1 > 0.04
    assert _least_squares(rounds) / RATE - 1 > 0.04
    assert fit_line(rounds, burst_bytes=measured).rate_bps == pytest.approx(RATE, rel=BURST_BOUND)
    # Through the estimator: the latest sweep's burst goes into the rounds' fit.
    est = LinkEstimator()
    est.set_probe("d", "dl", LinkFit(probe.rate_bps, probe.intercept_s, probe.n, probe.groups, probe.resid_rms_s,
                                     burst_bytes=measured), t=0.0)
    for b, t in rounds:
        est.observe("d", "dl", b, t, t=1.0)
    assert est.fit("d", "dl").burst_bytes == pytest.approx(measured)
    assert est.rates("d")["dl"] == pytest.approx(RATE, rel=BURST_BOUND)


def test_a_burst_and_one_delayed_message_together_stay_within_the_bound():
    """60 seeded trials of the two at once: one size of verdict with small ones, tbf's burst measured by a
    sweep, one small message delayed by 5-60 ms: within BURST_BOUND in every trial (worst seen: 1.1%); least
    squares moves past it in every trial (the burst alone is +5%)."""
    burst, errors = 15_000, []
    for seed in range(60):
        rng = random.Random(100 + seed)
        sweep = _noisy(rng, [1024, 76_000, 190_000, 304_000] * 3, burst=burst)
        probe = fit_line(sweep)
        rounds = _noisy(rng, [400, 304_000] * 5, burst=burst)
        rounds[rng.randrange(0, 10, 2)] = (400, rounds[0][1] + rng.uniform(0.005, 0.06))
        errors.append(abs(fit_line(rounds, burst_bytes=burst_of(sweep, probe)).rate_bps / RATE - 1))
        assert abs(_least_squares(rounds) / RATE - 1) > BURST_BOUND
    assert max(errors) < BURST_BOUND, max(errors)
