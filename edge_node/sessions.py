"""The edge's sessions: registration, liveness, leaving and rejoining.

Names: ZeroMQ ignores a second connection under a connected name (no ROUTER_HANDOVER); a registration under a
name whose session is alive is refused ("name in use"; with CURVE keys, a second connection presenting the key
gets that refusal and nothing of the holder's, `EdgeSocket.route`); once that session is silent (its device
crashed), a new registration takes it over. A session silent for the liveness window is ended and its KV cache freed; a
device that misses `max_misses` rounds in a row is dropped. Devices may register at any time; they take part
from the next round."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

from edge_node.transport import Refusal
from testbed.runtime.clock_offset import ClockOffset
from testbed.runtime.heartbeat import PeerTimes
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

log = logging.getLogger("multispin.edge")


@dataclass
class Session:
    name: str
    sid: str
    prompt_ids: list[int]
    hardware: dict
    output_ids: list[int] = field(default_factory=list)
    pending: list[int] | None = None       # committed tokens the verifier has not seen yet; None = unknown
    misses: int = 0
    rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    done: bool = False
    awaiting_report: int | None = None      # round whose report (the DL-mode correction) the next round needs
    expected_token: int | None = None       # the token the edge sampled for that round (None: DL correction)
    last_n: int = 0
    last_drafts: list[int] = field(default_factory=list)
    report_round: int | None = None         # the round whose report is still to come (needed or not)
    unconfirmed: int = 0                    # output tokens committed here whose report has not come yet
    peer: PeerTimes = field(default_factory=PeerTimes)  # edge clock: our latest message to it, its latest to us
    features: frozenset[str] = frozenset()  # what its device understands (`register.features`)
    idle: bool = False  # serving requests (`edge_node.requests`): none in service, no rounds, heartbeats go on
    clock: dict | None = None  # `ClockOffset.to_record()` of its device's clock (`clock.result`); None: not sent


class Sessions:
    """Every device's session (`by_name`, the dict `EdgeServer.sessions`), and those that ended (outputs only)."""

    def __init__(self, srv, known: set[str], prompts: list[list[int]]):
        self.srv, self.cfg = srv, srv.config
        self.known, self.prompts = known, prompts
        self.by_name: dict[str, Session] = {}
        self.finished: dict[str, Session] = {}  # sessions that ended: outputs only (no KV cache, no drafts)
        self.device_errors: dict[str, str] = {}  # name -> why the device said it cannot take part
        self._sid = itertools.count()

    # -- joining ---------------------------------------------------------------------------------
    def register(self, name: str, header: dict) -> None:
        reg = M.parse_register(header)
        if reg.name != name:
            raise ProtocolError(f"register.name: {reg.name!r} differs from the sender's name {P.show(name)} (its "
                                "routing identity; with CURVE keys, the name its key is bound to)")
        if name not in self.known:
            # The valid names are not listed: they would tell a stranger which names to try.
            raise Refusal("unknown_device", f"register.name: {name!r} is not a device of this profile")
        if reg.vocab_size != self.cfg.vocab_size:
            raise ProtocolError(f"register.vocab_size: {reg.vocab_size} is not allowed; "
                                f"the target has {self.cfg.vocab_size}")
        old = self.by_name.get(name)
        if old is not None and self.alive(old):
            # Not "register.*": a restarted device retries (its old session ends once silent), it does not quit.
            raise Refusal("name_in_use", f"name in use: {name!r} has a live session; register again once it has "
                                         f"been silent for {self.cfg.window_s:g} s (a restarted device takes it over)")
        # Accepted: with CURVE keys, the replies to the name move to this connection (`EdgeSocket.take_route`);
        # a refused one leaves them with the live holder.
        self.srv.socket.take_route(name)
        if old is not None:
            log.info("%s: re-registered; closing its old session %s", name, old.sid)
            self.end(name, "re-registered", notify=False)
        self.srv.controller.calibrate_draft_time(name, reg.draft_time_s)  # its own timing, if it sent one
        self.open(name, reg.hardware, reg.features)

    def alive(self, s: Session) -> bool:
        """A session whose device was heard within the liveness window and that the edge has not ended."""
        return not s.done and not self.srv.socket.heartbeat.expired(s.peer, time.monotonic())

    def open(self, name: str, hardware: dict, features: frozenset[str] = frozenset()) -> None:
        srv = self.srv
        idx = sorted(self.known).index(name) % len(self.prompts)
        sid = f"{name}#{next(self._sid)}"
        prompt = list(self.prompts[idx])
        srv.verifier.open(sid, prompt)
        now = time.monotonic()
        self.by_name[name] = Session(name, sid, prompt, hardware, pending=[], peer=PeerTimes(0.0, now),
                                     features=features)
        srv.controller.observe_hardware(name, hardware)  # its energy constants, for the records
        self.send_registered(name, sid, prompt)
        log.info("%s: registered (session %s, hardware %s)", name, sid, hardware.get("name"))
        if srv.requests is not None:  # serving requests: idle until one starts on it
            srv.requests.on_open(name, self.by_name[name])
        if srv.prober is not None:
            srv.prober.on_register(name, sid)  # its links are swept before its first round

    def restart(self, name: str, prompt: list[int]) -> str:
        """A new request on a registered device (`edge_node.requests`): a new session with a fresh verifier
        context, and a `registered` with the request's prompt (the device resets its drafter). Returns its id."""
        srv, old = self.srv, self.by_name[name]
        srv.verifier.close(old.sid)
        sid = f"{name}#{next(self._sid)}"
        srv.verifier.open(sid, list(prompt))
        self.by_name[name] = Session(name, sid, list(prompt), old.hardware, pending=[], peer=old.peer,
                                     features=old.features, clock=old.clock)
        self.send_registered(name, sid, list(prompt))
        return sid

    def send_registered(self, name: str, sid: str, prompt: list[int]) -> None:
        srv, cfg = self.srv, self.cfg
        srv.socket.send(name, M.registered(
            sid, prompt, seed=cfg.seed, sampling=dataclasses.asdict(cfg.sampling), bits_per_prob=srv.bits,
            on_air_vocab_size=cfg.on_air_vocab_size, max_draft_len=srv.scenario.max_draft_len,
            tx_marker=cfg.tx_marker and cfg.channel_mode != "passthrough", heartbeat_s=cfg.heartbeat_s,
            liveness=cfg.liveness, clock=True))

    # -- leaving ---------------------------------------------------------------------------------
    def drop(self, name: str, reason: str, *, notify: bool = True) -> None:
        """End a session with a log line; `notify`: tell its device (`bye`: it exits)."""
        if name in self.by_name:
            log.warning("%s: left the session: %s", name, reason)
            self.end(name, reason, notify=notify)

    def end(self, name: str, reason: str, *, notify: bool) -> None:
        """Close a session: free its KV cache, keep its outputs only, take it out of the round in flight."""
        s = self.by_name.pop(name, None)
        if s is None:
            return
        self.srv.verifier.close(s.sid)
        if s.unconfirmed:
            # Tokens whose verdict the device never confirmed: it may never have had them.
            del s.output_ids[-s.unconfirmed:]
            s.unconfirmed = 0
        s.pending, s.last_drafts = None, []
        self.finished[name] = s
        for cur in self.srv.inflight.holding(name):
            if cur.sids.get(name) == s.sid:
                cur.given_up.setdefault(name, reason)
                cur.reports_given_up.add(name)
        if notify:
            self.srv.socket.send_quietly(name, M.done(reason))

    def end_silent(self, now: float) -> None:
        """End the sessions whose device was silent past the liveness window (after handling what arrived
        during a long call: it may be their sign of life)."""
        self.srv.take_held()
        beat = self.srv.socket.heartbeat
        for name, s in list(self.by_name.items()):
            cur = self.srv.inflight.of(name)
            if not beat.expired(s.peer, now):
                continue
            if cur is not None and cur.awaits_draft(name) and cur.sids.get(name) == s.sid:
                continue  # a device busy drafting cannot beat; the round's deadline governs it
            if s.done:
                self.end(name, "done and silent", notify=False)
            else:
                # No bye: the device is presumed dead, and its name may already belong to its restarted
                # process. Should it be alive after all, its next message gets "not registered".
                self.drop(name, f"silent for {beat.silent_s(s.peer, now):.1f} s "
                                f"(liveness window {beat.window_s:g} s)", notify=False)

    def missed(self, r: int, name: str, reason: str) -> None:
        """The device is out of round `r`: it gets a `dropped` verdict (it redrafts next round)."""
        s = self.by_name[name]
        s.misses += 1
        log.warning("%s: out of round %d (%d misses in a row): %s", name, r, s.misses, reason)
        self.srv.socket.send(name, M.dropped(r, reason))
        if s.misses >= self.cfg.max_misses:
            # No bye: a device that is only slow or paused finds itself unregistered at its next message and
            # registers again, and a restarted process that took this name must not get the old session's bye.
            self.drop(name, f"missed {s.misses} consecutive rounds", notify=False)

    def sit_out_missing_reports(self) -> None:
        """A device whose DL-mode correction (its report) never came cannot draft: it sits this round out."""
        for name, s in list(self.by_name.items()):
            if s.awaiting_report is None or s.done:
                continue
            s.misses += 1
            log.warning("%s: no report for round %d yet (%d misses)", name, s.awaiting_report, s.misses)
            if s.misses >= self.cfg.max_misses:
                self.drop(name, f"no report for round {s.awaiting_report}", notify=False)  # as in `missed`

    def on_device_error(self, name: str, header: dict) -> None:
        """A device says why it cannot take part (e.g. its model does not load): keep and print the reason;
        a fatal one ends its session. A non-fatal one naming the round in flight (e.g. a schedule refused over
        an unverified draft) ends the device's part of that round at once. Not answered."""
        err = M.parse_error(header)
        if name not in self.known:
            raise Refusal("unknown_device", "error from a device that is not part of this run")
        s, cur = self.by_name.get(name), self.srv.inflight.of(name)
        if (not err.fatal and err.round is not None and s is not None and cur is not None
                and err.round == cur.index and cur.sids.get(name) == s.sid):
            log.warning("%s: round %d: %s", name, cur.index, err.message)
            if cur.awaits_draft(name):
                cur.given_up[name] = f"the device refused the round: {P.show(err.message, 200)}"
            return
        self.device_errors[name] = err.message
        log.error("%s: cannot take part: %s", name, err.message)
        if err.fatal and name in self.by_name:
            self.drop(name, f"the device reported: {err.message}", notify=False)

    # -- finishing -------------------------------------------------------------------------------
    def has_all_tokens(self, s: Session, uncommitted: int = 0) -> bool:
        n = self.cfg.max_new_tokens if self.srv.requests is None else self.srv.requests.limit(s.name)
        return bool(n) and len(s.output_ids) + uncommitted >= n

    def finish_if_done(self, name: str) -> None:
        """A session that has its max_new_tokens drafts no more: free its KV cache now (its outputs are
        kept) and tell the device."""
        s = self.by_name.get(name)
        if s is not None and self.srv.requests is not None and self.has_all_tokens(s) and not s.idle:
            s.idle = True  # the request is complete; the device waits for its next one
            self.srv.verifier.close(s.sid)
            self.srv.requests.complete(name)
        elif s is not None and self.has_all_tokens(s) and not s.done:
            s.done = True
            self.srv.verifier.close(s.sid)
            self.srv.socket.send(name, M.done(f"generated {len(s.output_ids)} tokens"))

    def active_names(self) -> list[str]:
        return sorted(n for n, s in self.by_name.items() if not s.done and not s.idle and s.awaiting_report is None)

    def finish(self, reason: str) -> dict[str, Session]:
        """Tell every device the run is over; return every session, ended ones included (their outputs)."""
        out = {}
        for name, s in list(self.by_name.items()):
            if not s.done:
                self.srv.socket.send_quietly(name, M.done(reason))
            out[name] = s
        for name, s in self.finished.items():
            out.setdefault(name, s)
        return out


def clock_record(name: str, clock: dict | None) -> dict | None:
    """The record of a device's measured clock offset (`clock.result`); a warning when the offset exceeds its
    uncertainty, since timestamps taken on that device then disagree with the edge's."""
    if clock is None:
        return None
    rec = ClockOffset(clock["offset_s"], clock["rtt_s"], clock["exchanges"]).to_record()
    if rec["offset_exceeds_uncertainty"]:
        log.warning("%s: its clock is %+.3f s off the edge's (+- %.3f s, %d exchanges): timestamps taken on it "
                    "are off by as much", name, -rec["offset_s"], rec["uncertainty_s"], rec["exchanges"])
    else:
        log.info("%s: clock offset %+.4f s +- %.4f s (round trip %.4f s)", name, rec["offset_s"],
                 rec["uncertainty_s"], rec["rtt_s"])
    return rec
