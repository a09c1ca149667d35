"""One message from a device, handled: decoded, checked, and put where its round (or session) takes it.

Any failure while handling one message (malformed, oversized, wrong sizes, NaN, unknown device, a bug) costs
that message only: an `error` reply (or a silent drop) and one log line; the others keep being served. A
scheduled device whose draft is refused is out of that round at once (the round does not wait for it)."""

from __future__ import annotations

import logging
import time

from edge_node.link_stamps import LinkStamps
from edge_node.round_state import ArrivedDraft
from edge_node.sessions import Session, clock_record
from edge_node.transport import Refusal
from edge_node.virtual_clock import WAITED_S, ThreadClock
from testbed.core.vocabulary import UPLINK
from testbed.runtime import timeline
from testbed.runtime.waiting import Rehearsal
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError
from testbed.wire.validate import InvalidPayload

log = logging.getLogger("multispin.edge")


class Inbox:
    def __init__(self, srv):
        self.srv, self.cfg = srv, srv.config
        self.free_since = 0.0  # edge clock: when the edge last became free to read a message
        self._clock = ThreadClock()  # restarted for each message (a draft's `handled_s`)
        self._frames_in: list = []  # the message being handled (a draft's are kept for `rehearsal`)
        self.rehearsal = Rehearsal(self.cfg.busy_poll)  # the last draft's decode and checks, rerun while busy-polling
        # name -> (session id, drafts in a row refused by testbed.wire.validate); `max_invalid_payloads` end it
        self.invalid_streak: dict[str, tuple[str, int]] = {}
        self.link_stamps = LinkStamps()  # how each draft and report was stamped, for the link estimates

    def mark_free(self) -> None:
        """The edge is free to read again: a message read within WAITED_S of this was queued while it was busy."""
        self.free_since = time.monotonic()

    def dispatch(self, frames: list, t_arr: float, waited: bool = False) -> None:
        """Handle one message; whatever fails costs this message only (an error reply, one log line). `waited`:
        it is known to have been queued while the edge was busy (taken in during a long call)."""
        sock = self.srv.socket
        self._clock, self._frames_in = ThreadClock(), frames
        ident = frames[0].bytes
        if not sock.admitted(ident, t_arr):
            return
        name, keyed = sock.sender(ident, frames)
        header: dict = {}
        try:
            sock.check_sender(frames)
            try:
                header, arrays = P.decode(frames[1:], max_array_bytes=self.cfg.max_array_bytes)
            except ProtocolError as exc:
                raise Refusal("malformed", f"malformed message: {exc}") from None
            timeline.stamp(f"edge: {header['type']} in", t_arr)
            timeline.stamp(f"edge: {header['type']} decoded")
            sock.route(name, ident, keyed, header)
            s = self.srv.sessions.get(name)
            if s is not None and header["type"] != P.REGISTER:
                s.peer.heard(t_arr)  # any message is a sign of life, but a register may come from a new process
            nbytes = sum(len(f) for f in frames[1:])  # bytes, as the emulator counts them (header + arrays)
            waited = waited or t_arr - self.free_since < WAITED_S
            self._handle(name, header, arrays, nbytes, sock.via_channel(frames), t_arr, waited)
        except Refusal as exc:
            sock.refuse(ident, exc.reason, str(exc), header.get("round"))
        except ProtocolError as exc:
            sock.refuse(ident, "invalid", str(exc), header.get("round"))
        except Exception as exc:  # a bug or an input nobody foresaw: this message is lost, not the edge
            log.debug("handling a message from %r failed", name, exc_info=True)
            kind = header.get("type") if header.get("type") in M.MESSAGE_TYPES else "message"
            sock.refuse(ident, "internal", f"{kind} could not be handled ({type(exc).__name__}); it was dropped",
                        header.get("round"))

    def _handle(self, name: str, header: dict, arrays: dict, nbytes: int, via_channel: bool, t_arr: float,
                waited: bool = False) -> None:
        kind, srv = header["type"], self.srv
        if kind == P.TX_START:
            return  # a marker that reached us directly (no emulator in between)
        if kind == P.HEARTBEAT:
            self._registered(name, kind, "; send register")
            # An idle device's link reading rides on its heartbeat: a device that sits rounds out for want of a
            # fresh reading (live `fallback: drop`) sends no report.
            self.take_link(name, M.parse_link(header), t_arr)
        elif kind == P.REGISTER:
            srv.roster.register(name, header)
        elif kind == P.CLOCK:
            self._on_clock(name, header, t_arr)
        elif kind == P.DRAFT:
            self._on_draft(name, header, arrays, nbytes, via_channel, t_arr, waited)
        elif kind == P.REPORT:
            self._on_report(name, header, via_channel, t_arr, waited)
        elif kind == P.ERROR:
            srv.roster.on_device_error(name, header)
        elif kind == P.PROBE_ECHO and srv.prober is not None:
            self._registered(name, kind)
            srv.prober.on_echo(name, header, arrays, t_arr)
        else:
            raise ProtocolError(f"type: {P.show(kind)} is not allowed from a device; allowed: register, draft, "
                                "report, heartbeat, error, clock" + (", probe_echo" if srv.prober is not None else ""))

    def _on_clock(self, name: str, header: dict, t_arr: float) -> None:
        """A clock exchange (`testbed.runtime.clock_offset`), answered at once, registered or not: t1 is the
        arrival (`t_arr`, monotonic) on the wall clock, t2 the reply's sending. A registered device's result
        (`clock.result`) is kept with its session, for the records."""
        got = M.parse_clock(header, reply=False)
        if isinstance(got, dict):
            self._registered(name, "clock result")
            self.srv.sessions[name].clock = clock_record(name, got)
            return
        (t0,) = got
        t1 = time.time() - (time.monotonic() - t_arr)
        self.srv.socket.send(name, M.clock_reply(t0, t1, time.time()))

    def _registered(self, name: str, kind: str, hint: str = "") -> None:
        if name not in self.srv.sessions:
            raise Refusal("not_registered", f"{kind} from {name!r}, which is not registered{hint}")

    # -- drafts ----------------------------------------------------------------------------------
    def _on_draft(self, name: str, header: dict, arrays: dict, nbytes: int, via_channel: bool,
                  t_arr: float, waited: bool = False) -> None:
        s = self.srv.sessions.get(name)
        if s is None:
            raise Refusal("not_registered", f"draft from {name!r}, which is not registered; send register first")
        cur, r = self.srv.inflight.of(name), header.get("round")
        if cur is not None and r == cur.index and name in cur.drafts:
            raise ProtocolError(f"draft.round: a second draft for round {r}")
        if cur is None or r != cur.index or cur.sids.get(name) != s.sid or not cur.awaits_draft(name):
            log.info("%s: discarding a draft for round %s (round in flight: %s)", name, P.show(r, 20),
                     None if cur is None else cur.index)
            return
        slot = cur.schedule[name]
        checks = dict(mode=slot.mode, draft_len=slot.draft_len, vocab_size=self.cfg.vocab_size,
                      bits_per_prob=self.srv.bits, on_air_vocab=self.cfg.on_air_vocab_size, topk=cur.plan.topk)
        try:
            d = self._parse_draft(s, header, arrays, checks, via_channel)
        except Exception as exc:
            # Its draft will not come: the round goes on without it at once instead of at the deadline.
            cur.given_up[name] = f"draft refused: {P.show(str(exc), 200)}"
            if isinstance(exc, InvalidPayload) and self._invalid_payload(name, s, exc, cur.index):
                return
            raise
        self.invalid_streak.pop(name, None)
        timeline.stamp("edge: draft checked")
        self.rehearsal.set(self._rehearse_draft, self._frames_in[1:], checks)
        s.unconfirmed = 0  # its last_token matched: the device holds every token committed so far
        handled_s = max(0.0, time.monotonic() - t_arr - self._clock.descheduled_s())
        cur.drafts[name] = ArrivedDraft(t_arr, d, nbytes, waited, handled_s=handled_s)
        self.link_stamps.note(name, "draft", cur.index, waited, self.srv.socket.stamp_width_s)

    def _invalid_payload(self, name: str, s: Session, exc: InvalidPayload, r: int) -> bool:
        """Count a draft whose distributions `testbed.wire.validate` refused; at `max_invalid_payloads` in a row,
        answer it (`error`) and end the device's session (`bye`). True when the session ended."""
        sid, n = self.invalid_streak.get(name, (s.sid, 0))
        n = n + 1 if sid == s.sid else 1
        self.invalid_streak[name] = (s.sid, n)
        if n < self.cfg.max_invalid_payloads:
            return False
        del self.invalid_streak[name]
        self.srv.socket.refuse(self._frames_in[0].bytes, "invalid", str(exc), r)
        limit = self.cfg.max_invalid_payloads
        self.srv.roster.drop(name, f"{n} invalid payloads in a row (max_invalid_payloads {limit}); the last: "
                                   f"{P.show(str(exc), 200)}")
        return True

    def _rehearse_draft(self, frames: list, checks: dict) -> None:
        """A draft's decode and checks on `frames` (one that passed them), its result dropped."""
        header, arrays = P.decode(frames, max_array_bytes=self.cfg.max_array_bytes)
        M.parse_draft(header, arrays, **checks)

    def _parse_draft(self, s: Session, header: dict, arrays: dict, checks: dict, via_channel: bool) -> M.Draft:
        d = M.parse_draft(header, arrays, **checks)
        expected_last = (s.output_ids or s.prompt_ids)[-1]
        if d.last_token != expected_last:
            raise ProtocolError(f"draft.last_token: {d.last_token} does not match the committed context "
                                f"(last token {expected_last}); the device is out of sync")
        if not via_channel:
            d.channel = None  # no emulator in between: an annotation would be the device's own claim
        elif header.get("air") != UPLINK:
            # Through the emulator a draft must be charged: one sent without "air" skips its air time.
            raise ProtocolError(f"draft.air: {P.show(header.get('air'))} is not allowed through the channel "
                                "emulator; must be 'ul'")
        return d

    # -- reports ---------------------------------------------------------------------------------
    def _on_report(self, name: str, header: dict, via_channel: bool, t_arr: float, waited: bool = False) -> None:
        s = self.srv.sessions.get(name)
        if s is None:
            raise Refusal("not_registered", f"report from {name!r}, which is not registered")
        cur = self.srv.inflight.reports_of(name, s.report_round)
        awaited = cur is not None and cur.sids.get(name) == s.sid and s.report_round == cur.index
        try:
            rep = self._check_report(s, header)
        except Exception:
            if awaited and header.get("round") == cur.index:
                # The awaited report came wrong: it will not come right, stop waiting for it. A refused report
                # naming another round (stale, or junk) leaves the wait on: the right one may still come.
                cur.reports_given_up.add(name)
            raise
        if not via_channel:
            rep.dl_channel = None
        s.report_round, s.unconfirmed = None, 0
        if s.awaiting_report == rep.round:
            # DL-mode correction sampled on the device: the verifier feeds it next round.
            s.output_ids.extend(s.last_drafts[: s.last_n] + [rep.token])
            s.pending = [rep.token]
            s.awaiting_report = None
        if awaited and rep.round == cur.index:
            cur.reports[name] = (t_arr, rep)
            if waited:
                cur.reports_waited.add(name)
            self.link_stamps.note(name, "report", cur.index, waited, self.srv.socket.stamp_width_s)
        self.take_link(name, rep.link, t_arr)

    def _check_report(self, s: Session, header: dict) -> M.Report:
        rep = M.parse_report(header, self.cfg.vocab_size)
        if s.report_round != rep.round:
            raise ProtocolError(f"report.round: {rep.round} is not awaited (awaiting {s.report_round})")
        if rep.n_accepted != s.last_n:
            raise ProtocolError(f"report.n_accepted: {rep.n_accepted} differs from the verdict's {s.last_n}")
        if s.expected_token is not None and rep.token != s.expected_token:
            raise ProtocolError(f"report.token: {rep.token} differs from the token {s.expected_token} sent")
        return rep

    def take_link(self, name: str, link: dict | None, t_arr: float) -> None:
        """A device's link reading (its report or heartbeat) to a live channel state, dated on the edge's
        clock of the plans (`t_origin`): its arrival minus the age the device measured on its own clock."""
        cs = self.srv.controller.channel_state
        if link is None or cs is None or getattr(cs, "source", None) != "live":
            return
        cs.report_live(name, link, t_s=t_arr - self.srv.t_origin - (link.get("age_s") or 0.0))
