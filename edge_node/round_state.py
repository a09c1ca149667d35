"""What the edge holds of a round in flight: its plan, each device's schedule, and what came back so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from edge_node.controller import RoundPlan
from testbed.core.optimizer import DevicePlan
from testbed.core.sampling import RoundRandomness
from testbed.wire import messages as M

# Messages handled per `drain` within `poll` before the housekeeping and the deadline are looked at again: a peer
# that sends faster than the edge reads must not hold the edge in one drain (no heartbeats, no deadline).
DRAIN_BATCH = 1000


@dataclass
class ArrivedDraft:
    """A device's draft, accepted into the round's inbox."""

    t_arrival: float      # edge clock (monotonic)
    draft: M.Draft
    nbytes: int           # bytes of the message's frames: the record's ul_bytes when no emulator annotates it
    waited: bool = False  # it was queued while the edge was busy: t_arrival is late
    handled_s: float = 0.0  # the edge's handling of it (decode, checks: its thread's CPU time), for the virtual queue


@dataclass
class RoundInFlight:
    """The round the edge is serving: its plan, each device's schedule, and what came back so far."""

    index: int
    plan: RoundPlan
    plan_s: float                       # how long computing the plan took
    schedule: dict[str, DevicePlan]     # the devices of this round -> their plan entry (mode, draft_len, powers)
    sids: dict[str, str]                # the session each schedule went to (a rejoined device is a new one)
    t0: float                           # edge clock when the schedules went out
    drafts: dict[str, ArrivedDraft] = field(default_factory=dict)
    given_up: dict[str, str] = field(default_factory=dict)  # name -> why its draft will not come (refused, gone)
    reports: dict[str, tuple[float, M.Report]] = field(default_factory=dict)  # name -> (arrival time, report)
    reports_given_up: set[str] = field(default_factory=set)  # refused reports, sessions gone
    closed: bool = False                # past the drafting phase: later drafts are discarded
    # Edge clock instants for the virtual time base: waiting for drafts from / until, for reports from.
    t_drafts_from: float = 0.0
    t_drafts_closed: float = 0.0
    # Of the next round's planning during the drafting, the time this thread did not run (a shared host's
    # other processes did): no work of the edge's, so the virtual clock takes it out.
    plan_descheduled_s: float = 0.0
    reply_descheduled_s: float = 0.0  # the same of the verdicts' work, from verification done to reports awaited
    t_reports_from: float | None = None
    reports_waited: set[str] = field(default_factory=set)   # reports queued while the edge was busy
    draws: dict[str, RoundRandomness] = field(default_factory=dict)  # name -> its draws, made while it drafts
    ahead: bool = False  # scheduled with the previous round's verdicts (`SyncRounds.schedule_ahead`)
    benched: set[str] = field(default_factory=set)  # scheduled, not waited for (`edge_node.bench`)
    bench_events: dict[str, list[str]] = field(default_factory=dict)  # "benched"/"rejoined" -> names, this round

    def awaits_draft(self, name: str) -> bool:
        return (not self.closed and name in self.schedule and name not in self.drafts
                and name not in self.given_up)

    def drafting_done(self) -> bool:
        return all(n in self.drafts or n in self.given_up or n in self.benched for n in self.schedule)


class InFlight:
    """Which round each device's messages belong to: the synchronous round in flight (kept after it closes
    for its late reports), the one whose reports come in while the next drafts, or with asynchronous rounds
    each device's own cycle."""

    def __init__(self):
        self.current: RoundInFlight | None = None
        self.reporting: RoundInFlight | None = None  # the round whose reports come in while the next drafts
        self.cycles: dict[str, RoundInFlight] | None = None  # asynchronous rounds; None: synchronous
        self.in_round = False  # a round (or the cycle loop) is running: no emulator check between rounds

    def of(self, name: str) -> RoundInFlight | None:
        """The round a device's draft belongs to."""
        return self.current if self.cycles is None else self.cycles.get(name)

    def reports_of(self, name: str, report_round: int | None) -> RoundInFlight | None:
        """The round a device's report answers: the one collecting reports while the next drafts, else its round."""
        rep = self.reporting
        return rep if rep is not None and rep.index == report_round else self.of(name)

    def holding(self, name: str) -> list[RoundInFlight]:
        """Every round that may still wait on `name` (once each)."""
        return list({id(c): c for c in (self.reporting, self.of(name)) if c is not None}.values())


def schedule_fields(cur: RoundInFlight, name: str, deadline_s: float) -> dict:
    """`name`'s schedule of round `cur` (`messages.schedule_fields`)."""
    slot = cur.schedule[name]
    return M.schedule_fields(cur.index, slot.mode, slot.draft_len, slot.ul_power_w or 0.0, slot.dl_power_w or 0.0,
                             deadline_s, topk=cur.plan.topk)


def missed_reasons(rec: dict, cur: RoundInFlight) -> None:
    """Name in round record `rec` why each device that missed it was given up (`missed_reason`: its draft was
    refused, e.g. `draft refused: draft.q: contains NaN ...`, or its session ended); a device that simply sent
    nothing by the deadline has none."""
    for name, why in cur.given_up.items():
        entry = rec.get("devices", {}).get(name)
        if entry is not None and entry.get("missed"):
            entry["missed_reason"] = why


class Rounds(Protocol):
    """A round loop on the `EdgeServer`'s public interface: `SyncRounds` or `AsyncRounds` (`scenario.rounds`)."""

    def run(self, rounds: int, *, on_round=None, keep_records: bool = True, start_round: int = 0,
            join_wait_s: float = 0.0) -> list[dict] | None:
        ...
