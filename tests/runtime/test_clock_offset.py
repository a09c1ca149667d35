"""The NTP-style offset: exact when the delays are symmetric, within half the round trip whatever their split,
the shortest round trip's sample kept, and flagged when the offset exceeds that bound (seed fixed)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.runtime.clock_offset import ClockOffset, ClockSample, best, sample, summarize


def exchange(true_offset: float, up: float, down: float, hold: float, t0: float = 1000.0) -> ClockSample:
    """One exchange between a device clock and an edge clock `true_offset` ahead (edge = device + offset)."""
    t1 = t0 + up + true_offset  # edge clock
    t2 = t1 + hold
    t3 = t2 - true_offset + down  # device clock
    return sample(t0, t1, t2, t3)


def test_symmetric_delays_give_the_offset_exactly():
    s = exchange(2.5, 0.004, 0.004, 0.001)
    assert s.offset_s == pytest.approx(2.5) and s.rtt_s == pytest.approx(0.008)


def test_any_split_of_the_delays_stays_within_half_the_round_trip():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        true = rng.uniform(-5, 5)
        up, down, hold = rng.exponential(0.01, 3)
        s = exchange(true, up, down, hold)
        assert s.rtt_s == pytest.approx(up + down)
        assert abs(s.offset_s - true) <= s.uncertainty_s + 1e-9


def test_the_shortest_round_trip_is_kept_and_a_stepped_clock_is_dropped():
    samples = [exchange(1.0, 0.02, 0.001, 0.0), exchange(1.0, 0.001, 0.001, 0.0), exchange(1.0, 0.0, 0.03, 0.0)]
    assert best(samples) is samples[1]
    stepped = ClockSample(0.5, -0.2)  # t3 before t0: a clock stepped mid-exchange
    result = summarize([*samples, stepped])
    assert result.exchanges == 3 and result.offset_s == pytest.approx(1.0) and result.rtt_s == pytest.approx(0.002)
    assert summarize([stepped]) is None and summarize([]) is None


def test_an_offset_beyond_its_uncertainty_is_flagged():
    assert ClockOffset(-2.0, 0.004, 5).to_record() == {"offset_s": -2.0, "rtt_s": 0.004, "uncertainty_s": 0.002,
                                                      "exchanges": 5, "offset_exceeds_uncertainty": True}
    assert not ClockOffset(0.001, 0.004, 5).significant  # within +-2 ms: cannot be told from 0
