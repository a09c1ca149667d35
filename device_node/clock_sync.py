"""A device's clock exchanges with the edge right after it registers (`testbed.runtime.clock_offset`).

The edge announces that it answers them (`registered.clock`); the device then sends `EXCHANGES` requests one
after the other, each when the previous reply came, and reports the shortest round trip's offset to the edge
(`clock.result`), which keeps it in the run's records. Rounds go on meanwhile: the replies are handled as they
come, like any other message."""

from __future__ import annotations

import logging
import time

from testbed.runtime.clock_offset import EXCHANGES, ClockOffset, ClockSample, sample, summarize
from testbed.wire import messages as M

log = logging.getLogger("multispin.device")


class ClockExchanges:
    """One session's exchanges: `start` sends the first request; `on_reply` takes each reply (with the wall
    time it was received) and returns the next message to send: a request, the result, or None when done."""

    def __init__(self, name: str, exchanges: int = EXCHANGES, wall=time.time):
        self.name, self.exchanges, self.wall = name, exchanges, wall  # wall: this device's clock
        self.samples: list[ClockSample] = []
        self.pending: float | None = None  # t0 of the request in flight
        self.result: ClockOffset | None = None

    def start(self) -> list:
        self.pending = self.wall()
        return M.clock_request(self.pending)

    def on_reply(self, header: dict, t3: float) -> list | None:
        t0, t1, t2 = M.parse_clock(header, reply=True)
        if self.pending is None or t0 != self.pending:  # a reply to an earlier session's request: not ours
            return None
        self.samples.append(sample(t0, t1, t2, t3))
        if len(self.samples) < self.exchanges:
            return self.start()
        self.pending = None
        self.result = summarize(self.samples)
        if self.result is None:
            log.warning("%s: no usable clock sample (the clock stepped during the exchanges)", self.name)
            return None
        log.info("%s: clock offset to the edge %+.4f s +- %.4f s (%d exchanges)", self.name, self.result.offset_s,
                 self.result.uncertainty_s, self.result.exchanges)
        return M.clock_result(self.result.offset_s, self.result.rtt_s, self.result.exchanges)
