"""What the edge holds of a round in flight: its plan, each device's schedule, and what came back so far."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ahead: bool = False  # scheduled with the previous round's verdicts (`EdgeServer._schedule_ahead`)

    def awaits_draft(self, name: str) -> bool:
        return (not self.closed and name in self.schedule and name not in self.drafts
                and name not in self.given_up)

    def drafting_done(self) -> bool:
        return all(n in self.drafts or n in self.given_up for n in self.schedule)
