"""The virtual clock: a round's measured times rebuilt as if the edge had read every message the moment it
arrived (`controller.virtual_round`), from the edge-clock stamps of one round. With a virtual channel the
record's measured times are on this clock (measured compute + the emulator's annotated air time)."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from edge_node.controller import Arrival, DeviceOutcome, air_time, virtual_round
from edge_node.round_state import RoundInFlight

# A message read within this of the edge becoming free was already queued while the edge was busy, so its
# arrival stamp is late (the virtual clock then estimates the arrival).
WAITED_S = 0.0005


class ThreadClock:
    """This thread's wall and CPU clocks from when it was made: of the span since, how long the thread did not
    run (a host shared with emulated devices gave them the cores). The virtual clock counts only the rest."""

    def __init__(self):
        self.wall0, self.cpu0 = time.monotonic(), time.thread_time()

    def descheduled_s(self) -> float:
        return max(0.0, (time.monotonic() - self.wall0) - (time.thread_time() - self.cpu0))


class VirtualClock:
    """The measured transport outside the air time (arrival - its lower bound), per message kind and mode, from
    messages read while the edge was idle; it places the ones that had to wait. For devices sharing a process:
    each round's least, per kind, of the last 20 rounds (`arrival`)."""

    def __init__(self):
        self._transport: dict[tuple[str, str], deque[float]] = {}
        self._hosted_least: dict[tuple[str, str], deque[float]] = {}

    def round(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome], t_end: float) -> dict:
        """The round on the virtual clock from this round's edge-clock stamps. A message that had to wait while
        the edge was busy is placed at its lower bound (the device's drafting time; the verdict plus the
        device's correction) plus the transport measured on messages that did not wait; those feed the
        transport estimate."""
        t0 = cur.t0
        drafts, reports = {}, {}
        least: dict[tuple, float] = {}  # this round's least transport of hosted devices, per kind
        for name, o in outcomes.items():
            arrived, mode = cur.drafts.get(name), cur.schedule[name].mode
            if arrived is None:
                continue
            low = o.timings.get("draft_s") or 0.0
            drafts[name] = self.arrival(("draft", mode), arrived.t_arrival - t0, arrived.waited, low,
                                        air_time(o.ul_channel) or 0.0, o.timings.get("host_wait_s"),
                                        arrived.handled_s, least)
            if name in cur.reports:
                t_report, rep = cur.reports[name]
                low = o.t_verdict - t0 + (o.correction_s or 0.0)
                reports[name] = self.arrival(("report", mode), t_report - t0, name in cur.reports_waited, low,
                                             air_time(o.dl_channel) or 0.0, rep.timings.get("host_wait_s"),
                                             least=least)
        self.remember_least(least)
        return virtual_round(drafts, reports, drafts_from_s=cur.t_drafts_from - t0 - cur.plan_descheduled_s,
                             drafts_closed_s=cur.t_drafts_closed - t0,
                             reports_from_s=None if cur.t_reports_from is None
                             else cur.t_reports_from - t0 - cur.reply_descheduled_s,
                             end_s=t_end - t0, all_drafts=len(drafts) == len(cur.schedule),
                             all_reports=bool(outcomes) and len(reports) == len(outcomes))

    def remember_least(self, least: dict[tuple, float]) -> None:
        """A round's least transport of hosted devices per kind, kept for the next 20 rounds."""
        for kind, t in least.items():
            self._hosted_least.setdefault(kind, deque(maxlen=20)).append(t)

    def arrival(self, kind: tuple[str, str], at_s: float, waited: bool, low_s: float, air_s: float,
                host_wait_s: float | None = None, handled_s: float = 0.0, least: dict | None = None) -> Arrival:
        """kind: (message, mode). The transport is estimated per kind from the last 20 messages that did not
        wait (their median). `host_wait_s` None: a device with a process of its own. A device that shares one
        (it reports its wait for the others) shares the machine with the other hosts too: the system runs
        its thread when it can, which no device measures, so its stamp is an upper bound, and the estimate
        (its own time plus the least transport of any hosted device in the last 20 rounds, `least` holding
        this round's so far) is used where lower."""
        hosted = host_wait_s is not None
        # A device's claim of its host's wait never puts its message before its own lower bound.
        host_wait_s = min(host_wait_s or 0.0, max(0.0, at_s - low_s))
        seen = None if waited or at_s - host_wait_s < low_s else at_s - host_wait_s - low_s
        if hosted:
            least = {} if least is None else least
            if seen is not None:
                least[kind] = min(least.get(kind, seen), seen)
            transport = min([*self._hosted_least.get(kind, ()), *([least[kind]] if kind in least else [])],
                            default=0.0)
        else:
            obs = self._transport.setdefault(kind, deque(maxlen=20))
            if seen is not None:
                obs.append(seen)
            transport = float(np.median(obs)) if obs else 0.0
        return Arrival(at_s=at_s, waited=waited or hosted, earliest_s=low_s + transport, air_s=air_s,
                       host_wait_s=host_wait_s, handled_s=handled_s)
