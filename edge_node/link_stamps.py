"""How the edge's clock stamped each device's latest draft and report, for the link estimates
(`channel.measure_links`, `testbed.runtime.link_estimate`).

A link sample is an interval on the edge's clock (schedule sent -> draft here, verdict sent -> report here), so
its end must be the arrival, not the moment the edge got round to reading it:

- "idle": read as it arrived (the edge was waiting on the socket): the stamp is the arrival;
- "queued": it arrived while the edge was busy (planning the next round while the devices draft: the heartbeat
  thread, which then looks at the socket every `transport.STAMP_TICK_S`, took it in), but within
  MAX_QUEUED_WIDTH_S before its stamp (the socket was seen empty then, `EdgeSocket.stamp_width_s`): the stamp
  is late by that at most, a one-sided delay like the network's, which the fit's group times leave out
  (`link_estimate.group_time`); it counts;
- "late": it may have waited longer (the socket was not seen empty for longer): its stamp is only an upper
  bound, and it is left out of the fit (it stays in the record, marked).

Before this, every message that arrived during a long call counted as late: on a DL-mode device, whose small
drafts come back while the edge plans, every draft but the first was left out, and that first one (delayed)
anchored the downlink's fit for the rest of the run."""

from __future__ import annotations

from collections import Counter

MAX_QUEUED_WIDTH_S = 0.004  # a message read late but stamped within this of its arrival counts


class LinkStamps:
    def __init__(self):
        self._latest: dict[tuple[str, str], tuple[int, str]] = {}  # (name, kind) -> (round, how)
        self.counts: Counter[str] = Counter()  # how -> samples taken for the link estimates

    def note(self, name: str, kind: str, round_index: int, waited: bool, width_s: float | None) -> None:
        """A device's draft or report (`kind`) of `round_index` arrived: `waited` whether the edge read it late,
        `width_s` how long before its stamp it may have arrived (None: not known)."""
        if not waited:
            how = "idle"
        elif width_s is not None and width_s <= MAX_QUEUED_WIDTH_S:
            how = "queued"
        else:
            how = "late"
        self._latest[(name, kind)] = (round_index, how)

    def take(self, name: str, kind: str, round_index: int) -> str:
        """How the message of that round was stamped ("late" when not known)."""
        got = self._latest.pop((name, kind), None)
        how = "late" if got is None or got[0] != round_index else got[1]
        self.counts[how] += 1
        return how
