"""Asynchronous rounds (`scenario.rounds: asynchronous`): each device cycles on its own.

A device's cycle: the controller plans the whole scenario and the device takes its entry (mode, L, powers);
its schedule goes out; its draft comes back; the verifier, whenever it is free, verifies every draft that
has arrived in ONE batch (continuous batching) and the verdicts go out at once; the device's report closes
its cycle (one record) and its next schedule follows. A slow device no longer holds back the others.

A peer of `edge_node.sync_rounds` on the `EdgeServer`'s public interface (its socket, sessions, verification,
channel watch and records); each cycle is a `RoundInFlight` of one device (`InFlight.cycles`), so drafts,
reports, verdicts, commits and the controller's observations go through the same code as synchronous rounds.
Lossless and reproducible: cycle c of a device uses the seeds of its round c (`RoundRandomness(seed, device,
c)`, on the edge and on the device), so a device's tokens are those of a synchronous run with the same draft
lengths.

The shared DL: a verdict is charged at the DL rate the model gives a device when the band and the edge's
power are split among the DL-mode verdicts in flight (those of the batch, and earlier ones whose report has
not come), each with the DL payload its plan provisioned (`shared_dl_rates`). Approximation: the rate is
fixed when the verdict goes out; a verdict on the air keeps it when others join or finish.

`rounds` of the profile is the number of cycles per device. Records: one line per device cycle (`round`: a
global counter in the order cycles end; `device`, `cycle`, `batch`, `wait_s`, predicted next to measured per
phase, with the cycle's time `round_s` against the model's T_k). Needs a channel that holds messages for
their air time (`real`) or a real link (`passthrough`): the virtual clock reconstructs synchronous rounds only.
See docs/asynchronous-rounds.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from edge_node.controller import DeviceOutcome, RoundPlan, channel_links, round_record
from edge_node.round_state import DRAIN_BATCH, RoundInFlight, missed_reasons
from testbed.core import model
from testbed.core.optimizer import DevicePlan
from testbed.core.vocabulary import DL, DOWNLINK
from testbed.runtime.errors import TestbedError
from testbed.wire import messages as M

log = logging.getLogger("multispin.edge.async")


@dataclass
class Cycle:
    """What the loop keeps of one device cycle beside its `RoundInFlight` (`InFlight.cycles[name]`)."""

    name: str
    index: int                  # the device's own cycle counter: its round index for every seed
    t_start: float              # edge clock: the previous cycle's end (or the first schedule's planning)
    outcome: DeviceOutcome | None = None
    verify_s: float | None = None
    batch: list[str] = field(default_factory=list)  # the devices verified in the same forward
    wait_s: float | None = None  # draft arrived -> its batch's verification started
    dl_shared: list[str] = field(default_factory=list)  # the DL-mode verdicts in flight the DL was split among


class AsyncRounds:
    def __init__(self, server):
        self.srv = server
        self.cycles_per_device = 0
        self.on_round = None
        self.records: list[dict] | None = None
        self.flying: dict[str, RoundInFlight] = {}  # name -> its cycle's round in flight (`InFlight.cycles`)
        self.open: dict[str, Cycle] = {}        # name -> its cycle in flight
        self.next_index: dict[str, int] = {}    # name -> its next cycle's index (= cycles done or missed)
        self.ended_at: dict[str, float] = {}    # name -> edge clock of its last cycle's end
        self.stalled: dict[str, float] = {}     # name -> until when its late report (a DL correction) may come
        self.retry_at: dict[str, float] = {}    # name -> when to plan again a device that sat out
        self.links: dict[str, dict] = {}        # the emulator's per-device rates, as last configured
        self.count = 0                          # cycles recorded: the records' `round`

    # -- the loop ------------------------------------------------------------------------------
    def run(self, rounds: int, *, on_round=None, keep_records: bool = True, start_round: int = 0,
            join_wait_s: float = 0.0) -> list[dict] | None:
        """Run `rounds` cycles per device (fewer for a device that finishes or leaves); records as
        `EdgeServer.run`. `join_wait_s` is for synchronous rounds: devices join a cycle loop whenever they come."""
        if start_round:
            raise TestbedError("asynchronous rounds cannot be resumed: start a new run")
        srv = self.srv
        if srv.config.channel_mode == "virtual":
            raise TestbedError("scenario.rounds: asynchronous needs channel.mode real or passthrough; the virtual "
                               "clock reconstructs synchronous rounds only")
        self.cycles_per_device, self.on_round = int(rounds), on_round
        self.records = [] if keep_records else None
        srv.inflight.cycles, srv.inflight.in_round = self.flying, True
        try:
            while True:
                now = time.monotonic()
                for name in self._ready(now):
                    self._start(name)
                if not self.open and not self._waiting():
                    break
                srv.poll(self._until(), stop=self._has_work)
                srv.inbox.mark_free()  # what the drain reads now was queued while the edge was busy
                # All queued now (a flood: a batch of it): the next batch holds every draft that has arrived.
                srv.drain(mark_free=False, limit=DRAIN_BATCH)
                self._expire(time.monotonic())
                self._verify_ready()
                self._close_reported()
        finally:
            srv.inflight.in_round = False
        return self.records

    def _ready(self, now: float) -> list[str]:
        """Devices that can start a cycle now: a live session, no cycle in flight, cycles left, no correction
        awaited."""
        return [n for n, s in sorted(self.srv.sessions.items())
                if not s.done and n not in self.open and self.next_index.get(n, 0) < self.cycles_per_device
                and s.awaiting_report is None and self.retry_at.get(n, 0.0) <= now]

    def _waiting(self) -> bool:
        """A device may still start a cycle later (a late report may come; a sat-out device plans again)."""
        live = [n for n, s in self.srv.sessions.items()
                if not s.done and self.next_index.get(n, 0) < self.cycles_per_device]
        return any(n in self.stalled or n in self.retry_at for n in live)

    def _until(self) -> float:
        """The next deadline: a draft's, a report's, a stalled device's, a retry; at most a heartbeat away."""
        srv = self.srv
        times = [time.monotonic() + srv.heartbeat_s, *self.stalled.values(), *self.retry_at.values()]
        for c in self.open.values():
            cur = self.flying[c.name]
            times.append((c.outcome.t_verdict if c.outcome else cur.t0) + srv.deadline_s)
        return min(times)

    def _has_work(self) -> bool:
        srv = self.srv
        for name, c in self.open.items():
            cur = self.flying[name]
            if c.outcome is None:
                if name in cur.drafts or name in cur.given_up:
                    return True
            elif name in cur.reports or name in cur.reports_given_up:
                return True
        if any(srv.sessions.get(n) is None or srv.sessions[n].awaiting_report is None for n in self.stalled):
            return True
        return bool(self._ready(time.monotonic()))

    # -- a cycle starts --------------------------------------------------------------------------
    def _plan_names(self, name: str) -> list[str]:
        """The devices the plan is for: every live session with cycles left (those in flight included)."""
        names = {n for n, s in self.srv.sessions.items()
                 if not s.done and self.next_index.get(n, 0) < self.cycles_per_device}
        return sorted(names | {name})

    def _start(self, name: str) -> None:
        srv = self.srv
        s = srv.sessions[name]
        index = self.next_index.get(name, 0)
        t_start = self.ended_at.pop(name, None) or time.monotonic()
        self.retry_at.pop(name, None)
        if srv.prober is not None:  # a device that just registered: its link is measured before its first cycle
            srv.prober.run_registration(name)
        rp, plan_s = srv.plan_fresh(index, self._plan_names(name))  # the synchronous rounds' planning
        if name not in rp.devices:  # a live channel without a fresh reading: try again a heartbeat later
            log.warning("%s: cycle %d not planned (%s)", name, index, rp.sat_out.get(name, "not in the plan"))
            self.retry_at[name] = time.monotonic() + srv.heartbeat_s
            return
        slot = rp.per_device[name]
        if srv.channel is not None:
            self.links[name] = channel_links(dataclasses.replace(rp, per_device={name: slot}))[name]
            self._configure(index)
        cur = RoundInFlight(index, rp, plan_s, {name: slot}, {name: s.sid}, t0=time.monotonic())
        cur.t_drafts_from = cur.t0
        self.flying[name] = cur
        self.open[name] = Cycle(name, index, t_start)
        srv.send(name, M.schedule(index, slot.mode, slot.draft_len, slot.ul_power_w or 0.0, slot.dl_power_w or 0.0,
                                   srv.deadline_s, topk=rp.topk))

    def _configure(self, round_index: int | None) -> None:
        self.srv.watch.configure(round_index, dict(self.links), self.srv.scenario.dl_access)

    # -- drafts in, one batch, verdicts out ----------------------------------------------------
    def _verify_ready(self) -> None:
        """ONE forward over every draft that has arrived; each verdict goes out at once."""
        srv = self.srv
        batch = []
        for name, c in self.open.items():
            cur, s = self.flying[name], srv.sessions.get(name)
            if c.outcome is None and not cur.closed and name in cur.drafts and s is not None \
                    and s.sid == cur.sids[name]:
                batch.append(name)
        if not batch:
            return
        for name in batch:
            self.flying[name].closed = True  # past its drafting phase: a second draft is discarded
            srv.sessions[name].misses = 0
        shared: list[str] = []  # the DL is split among the verdicts in flight before this batch's go out
        outcomes, verify_s, tv, _ = srv.verification.verify_batch({n: self.flying[n] for n in batch},
                                                     before_verdicts=lambda: shared.extend(self._share_dl(batch)))
        for name, o in outcomes.items():
            cur, c = self.flying[name], self.open[name]
            arrived = cur.drafts[name]
            c.outcome, c.verify_s, c.batch = o, verify_s, list(batch)
            c.wait_s, c.dl_shared = max(0.0, tv - arrived.t_arrival), shared
            cur.t_reports_from = time.monotonic()
            cur.drafts = {}  # the q rows are no longer needed

    def _share_dl(self, batch: list[str]) -> list[str]:
        """Configure the emulator's DL rates for the DL-mode verdicts in flight (this batch's and those whose
        report has not come) as the model splits the DL among them; returns their names."""
        srv = self.srv
        flying = {n: self.flying[n] for n, c in self.open.items()
                  if (n in batch or (c.outcome is not None and n not in self.flying[n].reports))
                  and self.flying[n].schedule[n].mode == DL}
        if srv.channel is None or not any(n in batch for n in flying):
            return sorted(flying)
        rates = shared_dl_rates({n: (cur.plan, cur.schedule[n]) for n, cur in flying.items()})
        for n in batch:
            if n in rates:
                self.links[n] = {**self.links.get(n, {}), "dl_rate_bps": rates[n]}
        self._configure(None)
        return sorted(flying)

    # -- missed drafts, late reports -------------------------------------------------------------
    def _expire(self, now: float) -> None:
        srv = self.srv
        for name, c in list(self.open.items()):
            cur, s = self.flying[name], srv.sessions.get(name)
            same = s is not None and s.sid == cur.sids[name]
            if c.outcome is not None:
                if now >= c.outcome.t_verdict + srv.deadline_s and name not in cur.reports:
                    self._close(name, late=True)
                continue
            if name in cur.drafts and same:
                continue  # verified in this iteration's batch
            if not same or name in cur.given_up or now >= cur.t0 + srv.deadline_s:
                cur.closed = True
                if same:
                    srv.roster.missed(c.index, name, cur.given_up.get(name, f"no draft within {srv.deadline_s} s"))
                self._close(name, late=False)
        for name, until in list(self.stalled.items()):
            s = srv.sessions.get(name)
            if s is None or s.awaiting_report is None:
                del self.stalled[name]
            elif now >= until:
                del self.stalled[name]
                srv.roster.drop(name, f"no report for cycle {s.awaiting_report}")

    def _close_reported(self) -> None:
        for name, c in list(self.open.items()):
            cur = self.flying[name]
            if c.outcome is not None and (name in cur.reports or name in cur.reports_given_up):
                self._close(name, late=name not in cur.reports)

    # -- a cycle ends ----------------------------------------------------------------------------
    def _close(self, name: str, *, late: bool) -> None:
        """Record the cycle (written at once; fsynced as it is written), feed the
        controller, and make way for the next one."""
        srv = self.srv
        c, cur = self.open.pop(name), self.flying[name]
        o = c.outcome
        t_end = time.monotonic()
        if o is not None:
            if late:
                o.report_late = True  # unconfirmed: the record credits none of its tokens
            else:
                t_end = srv.verification.take_report(cur, name, o)
        rec = self._record(c, cur, t_end)
        srv.keep_record(rec, fit_round=(rec["predicted"]["round_s"], cur.plan.scenario.round_overhead_s)
                        if o is not None and not late else None)
        if self.records is not None:
            self.records.append(rec)
        self.next_index[name] = c.index + 1
        self.ended_at[name] = t_end
        s = srv.sessions.get(name)
        if s is not None and s.sid == cur.sids[name]:
            if s.awaiting_report is not None:  # its DL correction is still to come: it cannot draft before
                self.stalled[name] = t_end + srv.deadline_s
            srv.roster.finish_if_done(name)
        if self.on_round is not None:
            self.on_round(rec)

    def _record(self, c: Cycle, cur, t_end: float) -> dict:
        """The cycle's record: `round_record` of a one-device plan, with the device's own prediction (the
        model's asynchronous T_k = tau_up,k + T_ver + downlink_k + T_0, its goodput E_k / T_k)."""
        srv, name = self.srv, c.name
        rp: RoundPlan = cur.plan
        one = dataclasses.replace(rp, devices=[name], per_device={name: rp.per_device[name]}, sat_out={})
        outcomes = {name: c.outcome} if c.outcome is not None else {}
        rec = round_record(one, policy=srv.config.policy, outcomes=outcomes, verify_s=c.verify_s,
                           round_s=t_end - c.t_start, t_start_s=c.t_start - srv.t_origin,
                           extra={"channel_mode": srv.config.channel_mode, "plan_s": cur.plan_s,
                                  # the sweeps since the previous record, as synchronous rounds list them
                                  **({"link_probes": srv.prober.take_log()} if srv.prober is not None else {})})
        missed_reasons(rec, cur)
        d = rp.per_device[name]
        verify = (rp.plan.get("phases_s") or {}).get("verify") or 0.0
        t_k = d.uplink_s + verify + d.downlink_s + rp.scenario.round_overhead_s
        rec["predicted"].update(uplink_phase_s=d.uplink_s, downlink_phase_s=d.downlink_s, round_s=t_k,
                                tokens=d.expected_tokens, goodput_tps=d.expected_tokens / t_k if t_k > 0 else None)
        rec.update({"round": self.count, "rounds": "asynchronous", "device": name, "cycle": c.index,
                    "batch": c.batch, "wait_s": c.wait_s, "dl_shared": c.dl_shared})
        self.count += 1
        return rec


def shared_dl_rates(entries: dict[str, tuple[RoundPlan, DevicePlan]]) -> dict[str, float]:
    """DL rates (bit/s) of a set of DL-mode verdicts sharing the DL, as the model splits it among a DL set
    (`model.dl_schedule`: band per `dl_access`, the edge's power split for equal latencies): each verdict at the
    payload its plan provisioned and the gain (or fixed DL rate) its plan used. A rate that comes out
    unusable (no power left, say) falls back to the plan's own."""
    names = sorted(entries)
    if not names:
        return {}
    bits, gains, fixed = [], [], []
    for n in names:
        rp, d = entries[n]
        k = [x.name for x in rp.scenario.devices].index(n)
        bits.append(d.dl_bits)
        gains.append(float(rp.scenario.gains_linear()[k]))
        fixed.append(float(rp.scenario.fixed_rates_bps(DOWNLINK)[k]))
    sc = entries[names[0]][0].scenario  # band, power, access and noise are the run's, whichever plan holds them
    _, rates, _, _ = model.dl_schedule(sc, np.array(bits), np.array(gains), fixed=np.array(fixed))
    out = {}
    for n, r in zip(names, rates):
        r = float(r)
        out[n] = r if math.isfinite(r) and r > 0 else entries[n][1].dl_rate_bps
    return out
