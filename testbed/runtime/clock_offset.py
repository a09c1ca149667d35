"""The offset between a device's clock and the edge's, measured NTP-style before a device registers.

One exchange: the device sends at t0 (its clock), the edge receives at t1 and answers at t2 (the edge's clock),
the device receives at t3 (its clock). Then

    offset = ((t1 - t0) + (t2 - t3)) / 2      (edge clock - device clock)
    rtt    = (t3 - t0) - (t2 - t1)

and the true offset lies within offset +- rtt/2 whatever the split of the delay between the two directions.
Of several exchanges the one with the shortest round trip is kept: its bound is the tightest (NTP's clock
filter). Wall clocks (`time.time()`) on both sides: they are what a record's timestamps would compare."""

from __future__ import annotations

import math
from dataclasses import dataclass

EXCHANGES = 5  # a device's exchanges before it registers


@dataclass(frozen=True)
class ClockSample:
    offset_s: float  # edge clock - device clock
    rtt_s: float

    @property
    def uncertainty_s(self) -> float:
        """Half the round trip: the offset's error bound."""
        return self.rtt_s / 2


def sample(t0: float, t1: float, t2: float, t3: float) -> ClockSample:
    """One exchange's offset and round trip (t0, t3 on the device's clock; t1, t2 on the edge's)."""
    return ClockSample(((t1 - t0) + (t2 - t3)) / 2, (t3 - t0) - (t2 - t1))


def best(samples: list[ClockSample]) -> ClockSample | None:
    """The shortest round trip's sample (None without samples)."""
    return min(samples, key=lambda s: s.rtt_s, default=None)


@dataclass(frozen=True)
class ClockOffset:
    """What a device reports at registration (`register.clock`) and the records keep."""

    offset_s: float
    rtt_s: float
    exchanges: int

    @property
    def uncertainty_s(self) -> float:
        return self.rtt_s / 2

    @property
    def significant(self) -> bool:
        """Whether the clocks differ by more than the measurement can tell apart from zero: timestamps taken on
        the device then disagree with the edge's by about `offset_s`."""
        return abs(self.offset_s) > self.uncertainty_s

    def to_record(self) -> dict:
        return {"offset_s": self.offset_s, "rtt_s": self.rtt_s, "uncertainty_s": self.uncertainty_s,
                "exchanges": self.exchanges, "offset_exceeds_uncertainty": self.significant}


def summarize(samples: list[ClockSample]) -> ClockOffset | None:
    """The min-RTT sample of `samples` as a `ClockOffset`; None without a usable one (a negative round trip
    means a clock stepped during the exchange)."""
    usable = [s for s in samples if math.isfinite(s.offset_s) and math.isfinite(s.rtt_s) and s.rtt_s >= 0]
    chosen = best(usable)
    return None if chosen is None else ClockOffset(chosen.offset_s, chosen.rtt_s, len(usable))
