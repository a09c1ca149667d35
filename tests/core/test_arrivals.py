"""Arrival processes of request serving (testbed.core.arrivals): Poisson inter-arrival statistics, seeding,
closed loop and traces."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from testbed.core.arrivals import closed_arrivals, device_rng, poisson_arrivals, trace_arrivals

ALPHA = 1e-3  # false-alarm rate of each statistical check below (fixed seeds: a failure is reproducible)


def test_poisson_inter_arrivals_are_exponential_at_the_rate():
    rate, n = 5.0, 4000
    times = np.asarray(poisson_arrivals(rate, n, device_rng(11, "dev0")))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps > 0) and len(times) == n
    # Mean gap 1/rate: z-test of the sample mean (sd of an exponential = its mean), two-sided at ALPHA.
    z = (gaps.mean() - 1 / rate) / ((1 / rate) / math.sqrt(n))
    assert abs(z) < stats.norm.ppf(1 - ALPHA / 2), z
    # The whole distribution: Kolmogorov-Smirnov against Exponential(scale 1/rate) at ALPHA.
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > ALPHA
    # Counts in unit windows are Poisson(rate): dispersion index test (sum (x - mean)^2 / mean ~ chi2(k - 1)).
    counts = np.bincount(times.astype(int))[: int(times[-1])]
    d = ((counts - counts.mean()) ** 2).sum() / counts.mean()
    k = len(counts)
    assert stats.chi2.ppf(ALPHA / 2, k - 1) < d < stats.chi2.ppf(1 - ALPHA / 2, k - 1)


def test_a_wrong_rate_is_detected():
    """The mean test has power: arrivals at rate 6 are told apart from rate 5 (so the test above can fail)."""
    n = 4000
    gaps = np.diff(np.concatenate([[0.0], poisson_arrivals(6.0, n, device_rng(11, "dev0"))]))
    z = (gaps.mean() - 1 / 5.0) / ((1 / 5.0) / math.sqrt(n))
    assert abs(z) > stats.norm.ppf(1 - ALPHA / 2)


def test_arrivals_are_seeded_per_device():
    a = poisson_arrivals(2.0, 20, device_rng(3, "dev0"))
    assert a == poisson_arrivals(2.0, 20, device_rng(3, "dev0"))
    assert a != poisson_arrivals(2.0, 20, device_rng(3, "dev1"))
    assert a != poisson_arrivals(2.0, 20, device_rng(4, "dev0"))
    assert a[:5] == poisson_arrivals(2.0, 5, device_rng(3, "dev0"))  # more requests: the first ones unchanged
    assert list(device_rng(3, "dev0", 1).random(3)) != list(device_rng(3, "dev0").random(3))  # another stream


def test_closed_loop_and_traces():
    assert closed_arrivals(3) == [None, None, None]
    assert trace_arrivals([2, 0.5, 1]) == [0.5, 1.0, 2.0]
    for bad in (-1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ValueError, match="arrival 1"):
            trace_arrivals([0.0, bad])
    with pytest.raises(ValueError, match="rate_per_s"):
        poisson_arrivals(0.0, 3, device_rng(0, "d"))
