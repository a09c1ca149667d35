"""`uplink.band_for_rate_hz`: the band for a rate, to rounding, in a handful of Newton steps; and the greedy
points `proposed` on a shared uplink reuses (`optimizer.fixed_greedy`)."""

import numpy as np

from testbed.core import uplink
from testbed.core.optimizer import FixedModes, Scorer, fixed_greedy, greedy
from testbed.core.scenario import DropSpec, Scenario
from testbed.core.simulate import draw_devices


def test_band_for_rate_solves_the_rate_to_rounding():
    rng = np.random.default_rng(0)
    # c = rho ln2 / a from 1e-12 up to within 1e-13 of 1 (a band near infinity)
    c = np.concatenate([10 ** rng.uniform(-12, 0, 20000), 1 - 10 ** rng.uniform(-13, -1, 20000)])
    a = 10 ** rng.uniform(3, 12, c.size)
    rho = c * a / uplink.LN2
    b = uplink.band_for_rate_hz(rho, a)
    assert np.all(np.isfinite(b)) and np.all(b > 0)
    got = uplink.rate_bps(b, a)
    assert np.max(np.abs(got - rho) / rho) < 2e-15
    assert list(uplink.band_for_rate_hz([0.0, 2e6], [1e6, 1e6])) == [0.0, np.inf]  # nothing; beyond a / ln 2


def test_band_for_rate_needs_few_newton_steps():
    rng = np.random.default_rng(1)
    c = np.concatenate([10 ** rng.uniform(-9, 0, 5000), 1 - 10 ** rng.uniform(-12, -1, 5000)])
    a = 10 ** rng.uniform(3, 12, c.size)
    rho = c * a / uplink.LN2
    exact = uplink.band_for_rate_hz(rho, a)
    assert np.array_equal(uplink.band_for_rate_hz(rho, a, iters=12), exact)  # it stopped within 12 steps


def test_fixed_greedy_is_greedy_once_per_scorer():
    sc = Scenario.from_dict(dict(ul_access="fdma_shared", devices=draw_devices(DropSpec(), 12, (3, 0))))
    s = Scorer(sc)
    for ul in (np.ones(12, bool), np.zeros(12, bool)):
        want = greedy(s, FixedModes(s, ul), fill=True)
        got = fixed_greedy(s, ul)
        assert np.array_equal(got, want)
        got[0] += 1  # a copy: the cached point stays as planned
        assert np.array_equal(fixed_greedy(s, ul), want)
    assert len(s.greedy_fixed) == 2


def test_band_for_rate_from_its_table_takes_two_newton_steps():
    """The tabulated start (`uplink._start_table`, within 2e-5 of the root for c = rho ln2 / a in (4e-17,
    1 - 5e-10)) leaves two Newton steps (the second within 1e-8: it lands on the root to rounding)."""
    rng = np.random.default_rng(2)
    c = np.concatenate([10 ** rng.uniform(-12, -1e-4, 5000), 1 - 10 ** rng.uniform(-8, -1, 5000)])
    a = 10 ** rng.uniform(3, 12, c.size)
    rho = c * a / uplink.LN2
    b = uplink.band_for_rate_hz(rho, a)
    assert np.array_equal(uplink.band_for_rate_hz(rho, a, iters=2), b)
    assert np.max(np.abs(uplink.rate_bps(b, a) - rho) / rho) < 2e-15
    x = np.exp(np.linspace(np.log(1e-8), np.log(1e17), 100_000))
    start, _ = uplink._root_start(np.log1p(x) / x)
    assert np.max(np.abs(start / x - 1)) < 2e-5
