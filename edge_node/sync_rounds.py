"""Synchronous rounds: every device of a round drafts, ONE verification serves them all, then the next round.

Per round: the controller plans (estimates -> optimizer), the channel emulator gets the plan's rates, each
device gets its schedule; drafts are collected until every scheduled device drafted or gave up, or the
deadline; one batched verification scores every device's drafts and each verdict goes out; each device reports
back; the round record (predicted next to measured, per phase and device) is written as the round ends. With
`schedule_ahead` (no channel to account for) round r+1's schedules go out with round r's verdicts, and round
r's reports and record overlap the next drafting. A peer of `edge_node.async_rounds` on the `EdgeServer`'s
public interface."""

from __future__ import annotations

import logging
import time

from edge_node.bench import Bench
from edge_node.controller import DeviceOutcome, RoundPlan, channel_links, round_record
from edge_node.round_state import RoundInFlight, missed_reasons, schedule_fields
from edge_node.verification import DrawsAhead
from edge_node.virtual_clock import ThreadClock, VirtualClock
from testbed.runtime import timeline
from testbed.wire import messages as M

log = logging.getLogger("multispin.edge")


class SyncRounds:
    def __init__(self, srv, schedule_ahead: bool):
        self.srv, self.cfg = srv, srv.config
        self.schedule_ahead = schedule_ahead
        self.clock = VirtualClock()
        self.next_plan: tuple[RoundPlan, float] | None = None  # (plan, seconds it took) made one round ahead
        self.ahead: RoundInFlight | None = None  # the next round, scheduled with this round's verdicts
        self.rounds_end = 0  # `run`'s last round + 1: nothing is scheduled ahead past it
        self.last_round_end: float | None = None  # edge clock: when the latest round ended (`edge_phases`)
        self.bench = Bench(self.cfg.straggler_misses)  # stragglers the rounds do not wait for

    def run(self, rounds: int, *, on_round=None, join_wait_s: float = 0.0, keep_records: bool = True,
            start_round: int = 0) -> list[dict] | None:
        """Rounds `start_round`..`rounds`-1, fewer if every session finishes (see `EdgeServer.run`)."""
        srv, records = self.srv, [] if keep_records else None
        self.rounds_end = rounds
        for r in range(start_round, rounds):
            # Serve registrations that arrived between rounds (joins and rejoins); check the emulator.
            srv.poll(time.monotonic() + join_wait_s)
            if srv.requests is not None and not srv.requests.ready(srv):
                break  # serving requests: every one served (or every device left)
            self.probe_links()
            rec = self.run_round(r)
            if rec is None:
                if srv.requests is None and not any(not s.done for s in srv.sessions.values()):
                    break
                # Everyone is waiting on a late report: give them time instead of burning rounds.
                srv.poll(time.monotonic() + self.cfg.deadline_s, stop=lambda: bool(srv.roster.active_names())
                         or (srv.requests is not None and srv.requests.due(srv)))
                continue
            if records is not None:
                records.append(rec)
            if on_round is not None:
                on_round(rec)
        return records

    def probe_links(self) -> None:
        """Between rounds: the probe sweeps due (`edge_node.probing.Prober.between_rounds`); the plan made
        ahead is dropped after one, so that the next round plans with what it measured."""
        if self.srv.prober is not None and self.srv.prober.between_rounds():
            self.next_plan = None

    # -- one round -------------------------------------------------------------------------------
    def run_round(self, r: int) -> dict | None:
        """One synchronous round; returns its record (already written), or None when no device can take part.
        A round scheduled ahead (with the previous round's verdicts) starts at collecting its drafts."""
        cur, names = self.take_ahead(r)
        if cur is None:
            names = self.housekeep()
            if not names:
                return None
            rp, plan_s = self.plan(r, names)
            if not rp.devices:
                return self.sit_out(r, rp)
            cur = self.schedule(r, rp, plan_s)
        self.srv.inflight.in_round = True
        try:
            self.prepare_while_drafting(cur, names)
            present = self.collect_drafts(cur)
            outcomes, verify_s = self.verify_and_reply(cur, present)  # and perhaps the next round's schedules
            t_end = self.collect_reports(cur, outcomes)
            return self.close_round(cur, outcomes, verify_s, t_end)
        finally:
            self.srv.inflight.in_round = False

    def take_ahead(self, r: int) -> tuple[RoundInFlight | None, list[str]]:
        """Round `r` if it was scheduled with the previous round's verdicts, and the devices of the sessions."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.index == r:
            return ahead, self.srv.roster.active_names()
        return None, []

    def housekeep(self) -> list[str]:
        """Devices whose report never came sit out, dead ones are not scheduled; returns those that can draft."""
        self.srv.roster.sit_out_missing_reports()
        self.srv.roster.end_silent(time.monotonic())
        return self.srv.roster.active_names()

    def sit_out(self, r: int, rp: RoundPlan) -> None:
        """Every device sat out (a live channel without fresh readings, `fallback: drop`): no round; wait a
        heartbeat period, on which idle devices send their readings."""
        log.warning("round %d: no device can be planned (%s)", r,
                    "; ".join(f"{n}: {why}" for n, why in rp.sat_out.items()))
        self.srv.poll(time.monotonic() + self.cfg.heartbeat_s)

    # plan
    def plan(self, r: int, names: list[str]) -> tuple[RoundPlan, float]:
        """The plan made during the previous round if it is for these devices; else a fresh one."""
        planned, self.next_plan = self.next_plan, None
        if planned is not None and planned[0].round == r and (planned[0].requested or planned[0].devices) == names:
            return planned
        return self.srv.plan_fresh(r, names)  # a device joined, left or is late: plan for those actually here

    # schedule
    def schedule(self, r: int, rp: RoundPlan, plan_s: float, send: bool = True) -> RoundInFlight:
        """Give the channel emulator the plan's rates (which also proves it answers), then send each
        device its schedule (with `send`; else they go out with the verdicts)."""
        srv = self.srv
        if srv.channel is not None:
            srv.watch.configure(r, channel_links(rp), rp.scenario.dl_access)
        cur = RoundInFlight(r, rp, plan_s, {n: rp.per_device[n] for n in rp.devices},
                            {n: srv.sessions[n].sid for n in rp.devices}, t0=time.monotonic())
        cur.benched = self.bench.of_round(cur.sids)
        srv.inflight.current = cur
        if send:
            for name in cur.schedule:
                srv.socket.send(name, M.schedule_of(schedule_fields(cur, name, self.cfg.deadline_s)))
            timeline.stamp("edge: schedules sent")
        return cur

    def prepare_while_drafting(self, cur: RoundInFlight, names: list[str]) -> None:
        """While the devices draft: plan the next round (its estimates then lag one round, which costs nothing
        measurable and keeps the optimizer off the critical path) and make the verification's random draws."""
        planning = ThreadClock()
        self.next_plan = self.srv.plan_fresh(cur.index + 1, names)
        cur.draws = {n: DrawsAhead(self.cfg.seed, n, cur.index, slot.draft_len) for n, slot in cur.schedule.items()}
        cur.plan_descheduled_s = planning.descheduled_s()
        timeline.stamp("edge: next round planned")

    # collect drafts
    def collect_drafts(self, cur: RoundInFlight) -> list[str]:
        """Serve messages until every scheduled device drafted or is out (refused, gone), or the deadline;
        returns the devices whose draft came."""
        srv = self.srv
        cur.t_drafts_from = time.monotonic()  # the edge planned the next round before this
        srv.poll(cur.t0 + self.cfg.deadline_s, stop=cur.drafting_done)
        cur.t_drafts_closed = time.monotonic()
        cur.closed = True
        present = []
        for name in cur.schedule:
            s = srv.sessions.get(name)
            if s is None or s.sid != cur.sids[name]:
                continue  # it left or rejoined during the round: nothing to count against the new session
            if name in cur.drafts:
                s.misses = 0
                present.append(name)
                if self.bench.answered(name, s.sid, cur.index):
                    cur.bench_events.setdefault("rejoined", []).append(name)
            elif name in cur.benched and name not in cur.given_up:
                # On the bench: what it can apply (a `dropped` verdict), no miss counted.
                srv.socket.send(name, M.dropped(cur.index, "benched: the round did not wait for its draft"))
            else:
                srv.roster.missed(cur.index, name,
                                  cur.given_up.get(name, f"no draft within {self.cfg.deadline_s} s"))
                s = srv.sessions.get(name)
                if s is not None and self.bench.after_miss(name, s.sid, s.misses, cur.index):
                    cur.bench_events.setdefault("benched", []).append(name)
        return present

    # verify and reply
    def verify_and_reply(self, cur: RoundInFlight, present: list[str]) -> tuple[dict[str, DeviceOutcome],
                                                                                  float | None]:
        """ONE batched forward over every device's drafts, then each device's verdict; returns the outcomes
        and the verification time (None when no draft came). Only where rounds can go ahead are all verdicts
        decided before the first goes out: through an emulator each goes out as decided, its air time
        overlapping the next device's decision."""
        if not present:
            return {}, None

        def after_verdicts(outcomes):
            self.ahead = self.schedule_next(cur, outcomes)
            return self.ahead

        outcomes, verify_s, _, cur.reply_descheduled_s = self.srv.verification.verify_batch(
            {n: cur for n in present}, after_verdicts=after_verdicts if self.schedule_ahead else None)
        return outcomes, verify_s

    def schedule_next(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome]) -> RoundInFlight | None:
        """Round r+1 scheduled with round r's verdicts when the edge already holds every token of round r (no
        DL-mode correction to wait for) and the plan made during the drafting is for exactly these devices: a
        device reads its verdict, reports and drafts on at once, and the report trip and the record of round r
        leave the critical path. Returns the round scheduled, or None."""
        if cur.index + 1 >= self.rounds_end or self.next_plan is None:
            return None
        rp, plan_s = self.next_plan
        names, roster = sorted(outcomes), self.srv.roster
        if (rp.round != cur.index + 1 or names != sorted(cur.schedule) or sorted(rp.devices) != names
                or any(o.dl_payload != "token" for o in outcomes.values())
                or any(roster.has_all_tokens(self.srv.sessions[n], outcomes[n].tokens) for n in names)):
            return None
        self.next_plan, self.srv.inflight.reporting = None, cur
        nxt = self.schedule(cur.index + 1, rp, plan_s, send=False)
        nxt.ahead = True
        return nxt

    # collect reports
    def collect_reports(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome]) -> float:
        """The round ends when every device holds its tokens, which only its report tells (tiny, not
        charged); the report also carries the verdict's measured DL air time. Returns the round's end: with a
        round scheduled ahead, when that one began (these reports overlap it)."""
        srv = self.srv
        cur.t_reports_from = time.monotonic()
        try:
            if outcomes:
                srv.poll(time.monotonic() + self.cfg.deadline_s,
                         stop=lambda: all(n in cur.reports or n in cur.reports_given_up for n in outcomes))
        finally:
            srv.inflight.reporting = None
        t_end = time.monotonic()
        for name, o in outcomes.items():
            if name not in cur.reports:
                o.report_late = True  # unconfirmed: the record credits none of its tokens
                continue
            srv.verification.take_report(cur, name, o)
        return self.ahead.t0 if self.ahead is not None else t_end

    # close and record
    def close_round(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome], verify_s: float | None,
                    t_end: float) -> dict:
        """Fit the round overhead (full rounds only), build the record and write it (a crash or Ctrl-C after
        this keeps the round), and finish the sessions that have all their tokens."""
        srv, rp = self.srv, cur.plan
        virtual = self.clock.round(cur, outcomes, t_end) if self.cfg.channel_mode == "virtual" else None
        rec = round_record(rp, policy=self.cfg.policy, outcomes=outcomes, verify_s=verify_s, round_s=t_end - cur.t0,
                           t_start_s=cur.t0 - srv.t_origin, virtual=virtual,
                           extra={"channel_mode": self.cfg.channel_mode, "plan_s": cur.plan_s,
                                  "scheduled_ahead": cur.ahead,
                                  "edge_phases_s": edge_phases(cur, verify_s, t_end, self.last_round_end),
                                  **({"link_probes": srv.prober.take_log()} if srv.prober is not None else {}),
                                  "joined": sorted(set(srv.sessions) - set(cur.schedule) - set(rp.sat_out))})
        missed_reasons(rec, cur)
        if self.bench.enabled:
            bench_fields(rec, cur)
        if t_end - cur.t0 > self.cfg.deadline_s:
            # Logged and recorded, never a reason for a device to leave: heartbeats went on meanwhile.
            rec["past_deadline"] = True
            log.warning("round %d took %.1f s, past the deadline of %g s (verification %.1f s); every device "
                        "stays", cur.index, t_end - cur.t0, self.cfg.deadline_s, verify_s or 0.0)
        # T_0 is fitted on full rounds, in the record's time base (with a virtual channel, the virtual round time).
        full = bool(outcomes) and len(outcomes) == len(cur.schedule)
        srv.keep_record(rec, fit_round=(rp.plan["round_time_s"], rp.scenario.round_overhead_s) if full else None)
        self.last_round_end = t_end
        cur.drafts = {}  # the round's q rows are no longer needed; late drafts are refused by `closed`
        for name in outcomes:
            srv.roster.finish_if_done(name)
        return rec


def edge_phases(cur: RoundInFlight, verify_s: float | None, t_end: float, last_end: float | None) -> dict:
    """Where a round's time went on the edge clock (s; None where a stamp is missing), for the record:
    `between_s` the previous round's end to this round's start (its record written and callbacks run, this
    round's housekeeping, plan and channel configured), `drafts_s` schedules sent to drafting closed (the next
    round planned meanwhile, the devices' drafting and uploads, the drafts decoded and checked), `reply_s`
    verification done to every verdict sent (accept/reject, the estimates updated), `reports_s` waiting for
    the reports."""
    closed = cur.t_drafts_closed or None
    replied = cur.t_reports_from
    return {"between_s": None if last_end is None else cur.t0 - last_end,
            "drafts_s": None if closed is None else closed - cur.t0,
            "reply_s": None if closed is None or replied is None else replied - closed - (verify_s or 0.0),
            "reports_s": None if replied is None else t_end - replied}


def bench_fields(rec: dict, cur: RoundInFlight) -> None:
    """Round record `rec`'s bench (`edge_node.bench`): `benched`, the devices the round did not wait for (each
    one's entry says `benched: true`), and `bench_events`, who went to the bench and who came back at this round."""
    rec["benched"] = sorted(cur.benched)
    for name in cur.benched:
        entry = rec.get("devices", {}).get(name)
        if entry is not None:
            entry["benched"] = True
    if cur.bench_events:
        rec["bench_events"] = {k: sorted(v) for k, v in cur.bench_events.items()}
