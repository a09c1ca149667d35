"""Verification: ONE batched forward over every device's drafts, then each device's accept/reject.

Accept/reject runs here for every device (the shared sampling code): UL-mode corrections are sampled here,
DL-mode devices get p_j and correct themselves. Both round loops verify through `Verification.verify_batch`,
and close a device's part through `take_report`."""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from edge_node.controller import DeviceOutcome
from edge_node.round_state import RoundInFlight, schedule_fields
from edge_node.sessions import Session
from edge_node.virtual_clock import ThreadClock
from testbed.core.sampling import (
    RoundRandomness,
    Verdict,
    exact_from_wire,
    to_probs,
    to_wire_precision,
    verify_draft,
)
from testbed.core.vocabulary import DOWNLINK, UPLINK
from testbed.runtime import timeline
from testbed.wire import messages as M
from testbed.wire import protocol as P

log = logging.getLogger("multispin.edge")


def extra_positions(verifier, session_ids: list[str]) -> int:
    """Positions a verification of these sessions computes beyond sum(L_k + 1) (prompts to prefill); 0 for a
    plug-in verifier that does not say (`BatchedVerifier.extra_positions`)."""
    count = getattr(verifier, "extra_positions", None)
    return sum(count(sid) for sid in session_ids) if count is not None else 0


class DrawsAhead(RoundRandomness):
    """A device's draws of a round with the verification's (`draft_len` acceptance uniforms, the final draw)
    made at once: the same numbers as `RoundRandomness` gives later (a shorter request gets their prefix)."""

    def __init__(self, seed: int, device: str, round_index: int, draft_len: int) -> None:
        super().__init__(seed, device, round_index)
        self._uniforms = super().acceptance_uniforms(draft_len)
        self._final = super().final_uniform()

    def acceptance_uniforms(self, n: int) -> np.ndarray:
        if isinstance(n, int) and 0 <= n <= len(self._uniforms):
            return self._uniforms[:n].copy()
        return super().acceptance_uniforms(n)

    def final_uniform(self) -> float:
        return self._final


class Verification:
    def __init__(self, srv):
        self.srv, self.cfg = srv, srv.config

    def verify_batch(self, rounds: dict[str, RoundInFlight], before_verdicts=None, after_verdicts=None
                     ) -> tuple[dict[str, DeviceOutcome], float, float, float]:
        """ONE batched forward over the drafts of `rounds` (device -> its round in flight; asynchronous rounds
        mix cycles), `before_verdicts()` if given, then each device's verdict as it is decided; with
        `after_verdicts(outcomes)` (it returns the next round in flight, or None) every verdict is decided first
        and goes out with that round's schedule (`_send_verdict`). Then what the devices need not wait for: the
        sessions' commits and the estimates (the verification time's too). A draft that cannot be verified costs
        its device the session, not the others their round. Returns the outcomes, the verification time, when it
        started, and of the time after it the part this thread did not run (`ThreadClock`)."""
        names, sessions = list(rounds), self.srv.sessions
        items = [(sessions[n].sid, list(sessions[n].pending), rounds[n].drafts[n].draft.tokens.tolist())
                 for n in names]
        extra = extra_positions(self.srv.verifier, [sessions[n].sid for n in names])
        tv = time.monotonic()
        timeline.stamp("edge: verification starts", tv)
        with self.srv.socket.lent():  # the target's forward may outlast the liveness window: heartbeats go on
            logits = self.srv.verifier.verify(items)
        verify_s = time.monotonic() - tv
        timeline.stamp("edge: verification done")
        replying = ThreadClock()
        if before_verdicts is not None:
            before_verdicts()
        outcomes, verdicts = self._reply(rounds, names, logits, after_verdicts)
        for name, verdict in verdicts.items():
            cur = rounds[name]
            try:
                self._commit(sessions[name], cur.index, verdict, cur.drafts[name].draft.tokens.tolist(),
                             cur.schedule[name].draft_len)
            except Exception as exc:
                outcomes.pop(name)
                self._unverifiable(cur, name, exc)
        self.srv.controller.observe_verify(sum(rounds[n].schedule[n].draft_len + 1 for n in names), verify_s,
                                           prefill_positions=extra)
        for name, o in outcomes.items():
            self._observe(rounds[name], name, o)
        return outcomes, verify_s, tv, replying.descheduled_s()

    def _reply(self, rounds: dict[str, RoundInFlight], names: list[str], logits, after_verdicts
               ) -> tuple[dict[str, DeviceOutcome], dict[str, Verdict]]:
        """Each device's verdict decided and sent (with `after_verdicts`, all decided first); one device's data
        must not cost the others their round."""
        outcomes, verdicts, replies = {}, {}, {}

        def unverifiable(name, exc):
            outcomes.pop(name, None)
            verdicts.pop(name, None)
            self._unverifiable(rounds[name], name, exc)

        for name, lg in zip(names, logits):
            try:
                outcomes[name], verdicts[name], replies[name] = self._decide(rounds[name], name, lg)
                if after_verdicts is None:
                    self._send_verdict(name, outcomes[name], replies[name])
            except Exception as exc:
                unverifiable(name, exc)
        if after_verdicts is not None:
            # The next round's schedules with the verdicts, before the commits: the devices draft on meanwhile.
            nxt = after_verdicts(outcomes)
            for name in list(outcomes):
                try:
                    self._send_verdict(name, outcomes[name], replies[name], nxt)
                except Exception as exc:
                    unverifiable(name, exc)
        return outcomes, verdicts

    def _unverifiable(self, cur: RoundInFlight, name: str, exc: Exception) -> None:
        log.warning("%s: its draft of round %d could not be verified (%s: %s)", name, cur.index,
                    type(exc).__name__, P.show(str(exc), 200))
        self.srv.roster.drop(name, "its draft could not be verified")

    def _decide(self, cur: RoundInFlight, name: str, logits: np.ndarray) -> tuple[DeviceOutcome, Verdict, dict]:
        """Accept/reject for one device: its outcome, the verdict and the reply to send (`_send_verdict`): the
        token (bonus, or a UL-mode correction made here), or on a DL-mode rejection p_j for the device to
        correct with its own q_j. The session takes the verdict later (`_commit`)."""
        slot, arrived, bits = cur.schedule[name], cur.drafts[name], self.srv.bits
        d = arrived.draft
        # p is used as exact_from_wire of its wire rows, in both modes: a DL device rebuilds the identical
        # p_j from the row it downloads, so UL and DL give identical tokens.
        p_wire = to_wire_precision(to_probs(np.asarray(logits, dtype=np.float32), self.cfg.sampling), bits)
        rr = cur.draws.get(name) or RoundRandomness(self.cfg.seed, name, cur.index)
        verdict = verify_draft(exact_from_wire(p_wire), d.q_at, d.q_rows, d.tokens, slot.mode, rr)
        n = verdict.n_accepted
        reply = {"round_index": cur.index, "n_accepted": n, "token": verdict.token}
        if verdict.token is None:
            reply.update(p_row=p_wire[n], bits_per_prob=bits, on_air_vocab=self.cfg.on_air_vocab_size)
        return DeviceOutcome(n_accepted=n, tokens=n + 1, dl_payload="p" if verdict.token is None else "token",
                             ul_channel=d.channel, ul_bytes=arrived.nbytes, dl_bytes=0,
                             up_phase_s=arrived.t_arrival - cur.t0, t_verdict=0.0,
                             timings=_finite_values(d.timings), q_bytes=d.q_bytes), verdict, reply

    def _send_verdict(self, name: str, o: DeviceOutcome, reply: dict, nxt: RoundInFlight | None = None) -> None:
        """Send a decided verdict (`reply`: `messages.verdict`'s arguments) and, when the next round `nxt` goes
        out now, its schedule: inside the verdict (`verdict.next`, one message instead of two) to a device that
        listed `schedule_in_verdict`, else right behind it. The outcome takes the verdict's time and bytes
        (a schedule inside not counted: schedules are not charged)."""
        sock = self.srv.socket
        scheduled = nxt is not None and name in nxt.schedule
        inside = scheduled and M.SCHEDULE_IN_VERDICT in self.srv.sessions[name].features
        fields = schedule_fields(nxt, name, self.cfg.deadline_s) if scheduled else None
        frames = M.verdict(**reply, next_schedule=fields if inside else None)
        o.t_verdict = time.monotonic()
        timeline.stamp("edge: verdict encoded", o.t_verdict)
        if self.cfg.tx_marker and self.srv.channel is not None:
            sock.send(name, [P.tx_start_marker(DOWNLINK)])  # the emulator starts the air time at the marker
        sock.send(name, frames)  # the device's part of the round goes on while the edge commits
        timeline.stamp("edge: verdict sent")
        if scheduled and not inside:
            sock.send(name, M.schedule_of(fields))
        o.dl_bytes = sum(len(f) for f in frames) - (M.next_bytes(fields) if inside else 0)

    def _commit(self, s: Session, r: int, verdict: Verdict, drafts: list[int], draft_len: int) -> None:
        """The verdict's effect on a session: the verifier's cache, the committed tokens, the counters."""
        n, token = verdict.n_accepted, verdict.token
        self.srv.verifier.commit(s.sid, n)
        s.pending = None
        s.expected_token, s.last_n, s.last_drafts, s.report_round = token, n, drafts, r
        if token is None:
            s.awaiting_report = r  # the device samples the correction; the next round needs its report
        else:
            # The edge knows the token: the next round can go ahead even if this report is late (it is
            # checked when it comes; the record credits the round's tokens only with the report in time).
            s.output_ids.extend(drafts[:n] + [token])
            s.pending = [token]
            s.unconfirmed = n + 1
        s.rounds += 1
        s.accepted += n
        s.drafted += draft_len

    def _observe(self, cur: RoundInFlight, name: str, o: DeviceOutcome) -> None:
        """Feed the controller's estimates: acceptance, drafting time and (when charged) the header size."""
        slot, ctl, links = cur.schedule[name], self.srv.controller, self.srv.links
        ctl.observe_acceptance(name, o.n_accepted, slot.draft_len, topk=cur.plan.topk)
        ctl.observe_draft_time(name, o.timings.get("draft_s") or 0.0, slot.draft_len)
        charged = (o.ul_channel or {}).get("bytes")
        if charged:
            ctl.observe_upload(charged, slot.ul_bits, cur.plan.scenario.header_bits, mode=slot.mode)
        arrived = cur.drafts[name]
        if links is not None:
            # schedule sent -> draft here, minus the device's drafting: the one-way trips (+ the upload)
            how = self.srv.inbox.link_stamps.take(name, "draft", cur.index)
            seconds = arrived.t_arrival - cur.t0 - (o.timings.get("draft_s") or 0.0)
            o.link = {"ul": link_sample(links, name, UPLINK, arrived.nbytes, seconds, arrived.t_arrival, how)}
            self.srv.publish_link_rates([name])

    def take_report(self, cur: RoundInFlight, name: str, o: DeviceOutcome) -> float:
        """A device's report into its outcome (correction time, DL annotation, report time) and, on a measured
        link, the DL sample it gives; returns when the report arrived."""
        t_report, rep = cur.reports[name]
        o.dl_channel, o.correction_s = rep.dl_channel, rep.timings.get("correction_s")
        o.report_s = t_report - o.t_verdict
        links = self.srv.links
        if links is not None:
            # verdict sent -> report here, minus the device's correction: the one-way trips (+ the verdict)
            how = self.srv.inbox.link_stamps.take(name, "report", cur.index)
            seconds = o.report_s - (o.correction_s or 0.0)
            o.link = {**(o.link or {}), "dl": link_sample(links, name, DOWNLINK, o.dl_bytes, seconds, t_report, how)}
            self.srv.publish_link_rates([name])
        return t_report


def link_sample(links, name: str, direction: str, nbytes: int, seconds: float, t: float, how: str) -> dict:
    """One message's link sample into the estimate, unless it was read late (`edge_node.link_stamps`); its
    entry for the record, `stamp` saying how it was stamped (a late one's `raw_s` is an upper bound)."""
    if how == "late":
        fit = links.fit(name, direction)
        return {"bytes": int(nbytes), "raw_s": seconds, "s": None, "fit": None if fit is None else fit.to_dict(),
                "stamp": how}
    return {**links.observe(name, direction, nbytes, seconds, t=t), "stamp": how}


def _finite_values(timings: dict) -> dict:
    """A device's timings with non-finite values left out (the wire layer refuses them; this keeps the
    controller and the record safe should a message reach here some other way)."""
    return {k: v for k, v in timings.items() if isinstance(v, (int, float)) and math.isfinite(v)}
