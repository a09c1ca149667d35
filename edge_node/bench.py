"""The straggler bench of synchronous rounds (`straggler_misses`).

A device that misses its draft deadline `straggler_misses` rounds in a row goes to the bench: it stays
registered (heartbeats, liveness, its KV cache) and is still scheduled every round, but the round no longer
waits for its draft: the drafting phase closes as soon as every device off the bench drafted. A benched
device's draft that comes before that close is served like any other, and the device is back in the round
(it answered in time); one that comes later gets its `dropped` verdict, and counts no miss (the bench is what
stops `max_misses` from ending a slow device's session). When every scheduled device is benched, the round
waits for them as usual. The bench is per session: a device that registers again starts off it."""

from __future__ import annotations

import logging

log = logging.getLogger("multispin.edge")


class Bench:
    def __init__(self, misses: int):
        self.misses = misses          # 0: no bench
        self.sids: dict[str, str] = {}  # name -> the session id that went to the bench
        self.moved = 0                # bench events: devices moved to the bench
        self.rejoined = 0             # devices back from it

    @property
    def enabled(self) -> bool:
        return self.misses > 0

    def holds(self, name: str, sid: str) -> bool:
        return self.sids.get(name) == sid

    def of_round(self, schedule_sids: dict[str, str]) -> set[str]:
        """The devices of a round the round does not wait for: those on the bench, unless all are."""
        benched = {n for n, sid in schedule_sids.items() if self.holds(n, sid)}
        return benched if len(benched) < len(schedule_sids) else set()

    def answered(self, name: str, sid: str, r: int) -> bool:
        """Its draft came in time: off the bench. Returns whether it was on it."""
        if not self.holds(name, sid):
            return False
        del self.sids[name]
        self.rejoined += 1
        log.info("%s: drafted in time in round %d; back in the synchronous round", name, r)
        return True

    def after_miss(self, name: str, sid: str, misses: int, r: int) -> bool:
        """A device off the bench missed a round (`misses` in a row): to the bench at `misses`. Returns whether
        it went."""
        if not self.enabled or misses < self.misses or self.holds(name, sid):
            return False
        self.sids[name] = sid
        self.moved += 1
        log.warning("%s: missed %d rounds in a row; benched at round %d (rounds no longer wait for its draft; "
                    "it rejoins once it drafts in time)", name, misses, r)
        return True
