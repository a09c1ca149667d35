"""Clock offset and round-trip time between this machine and a host, NTP-style over the SSH channel.

Each exchange: t0 (local send), t1 (the host's time.time() when it answers), t3 (local receive). With one
timestamp on the host (NTP's t1 = t2) the offset is t1 - (t0 + t3) / 2 and the round trip t3 - t0. The
sample of least round trip is kept: its offset is off by at most half its round trip (the uncertainty)."""

from __future__ import annotations

import time
from dataclasses import dataclass

EXCHANGES = 8


@dataclass(frozen=True)
class ClockSample:
    offset_s: float       # host clock minus local clock
    rtt_s: float
    uncertainty_s: float  # |true offset - offset_s| <= this, whatever the path's asymmetry


def offset_of(t0: float, t1: float, t3: float) -> ClockSample:
    rtt = t3 - t0
    return ClockSample(t1 - (t0 + t3) / 2, rtt, rtt / 2)


def best(samples: list[ClockSample]) -> ClockSample:
    """The min-RTT sample: the one least spread by queueing on either path."""
    if not samples:
        raise ValueError("no clock exchange completed")
    return min(samples, key=lambda s: s.rtt_s)


async def measure(session, python: str, exchanges: int = EXCHANGES) -> ClockSample:
    """`exchanges` request/answer pairs with the host's `probe clock` loop; the best sample."""
    samples = []
    async with session.conn.create_process(session.probe_command(python, "clock")) as proc:
        for _ in range(exchanges):
            t0 = time.time()
            proc.stdin.write("\n")
            line = await proc.stdout.readline()
            t3 = time.time()
            if not line:
                raise RuntimeError(f"the clock probe on {session.host.name} stopped: "
                                   f"{(await proc.stderr.read())[-300:]}")
            samples.append(offset_of(t0, float(line), t3))
        proc.stdin.write_eof()
    return best(samples)
