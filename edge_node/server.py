"""The edge node: a ZeroMQ ROUTER serving many devices, synchronous rounds, one batched verification.

Per round: the controller plans (estimates -> optimizer), the channel emulator gets the plan's rates, each
device gets its schedule; drafts are collected until every scheduled device drafted or gave up, or the
deadline; ONE `verifier.verify` call scores every device's drafts; accept/reject runs here for every device
(shared sampling code); UL-mode corrections are sampled here, DL-mode devices get p_j and correct
themselves; each device reports back; the round record (predicted next to measured, per phase and device)
is written as the round ends (`testbed.runtime.records`: fsynced as it is written). With a virtual channel the
record's measured times are on the virtual clock (measured compute + the emulator's annotated air time;
`_virtual_round`).

Hardening (a LAN is shared; see docs/wire-protocol.md):
- Any failure while handling one message (malformed, oversized, wrong sizes, NaN, unknown device, a bug)
  costs that message only: an `error` reply (or a silent drop) and one log line; the others keep being
  served. `refused` counts them, `refusals` per reason.
- A scheduled device whose draft is refused is out of that round at once (the round does not wait for it).
  A device that misses the deadline is dropped from the round, and from the session after `max_misses`
  consecutive misses.
- Liveness (the ZeroMQ guide's Paranoid Pirate): the edge sends a `heartbeat` to a device it has sent
  nothing to for `heartbeat_s`, and drops a session it has heard nothing from for `liveness` x `heartbeat_s`
  (its KV cache is freed). Any message of the device counts as a sign of life.
- Names: ZeroMQ ignores a second connection under a connected name (no ROUTER_HANDOVER); a registration
  under a name whose session is alive is refused ("name in use"); once that session is silent (its device
  crashed), a new registration takes it over. With CURVE keys (`keys_dir`) only listed keys connect, and a
  message speaks for the name its key is bound to, whatever routing identity its connection chose (devices
  with keys let ZeroMQ pick one): a listed key that connects first under another device's name holds
  nothing of that device's (the channel emulator's key forwards for all). With an emulator in between
  (`channel_mode` not passthrough) only the emulator's key connects: no device skips its air time.
- Each identity may send `max_msgs_per_s` messages a second (a token bucket with a burst of one second's
  worth, `testbed.runtime.security.RateLimiter`, as at the emulator); the rest are dropped before decoding, unanswered
  (`refusals["rate_limited"]`), so one flooding peer costs the others little.
- Open files: the edge raises its soft limit to the hard one (one file per connection), and closes a
  connection that has not finished ZeroMQ's handshake within HANDSHAKE_S (a raw TCP peer, a refused key).
- A channel emulator that stops answering ends the run with a TestbedError (checked between rounds); one
  whose process exited (`channel_exited`, set by whoever started it) ends it within a tick, in rounds too.
Devices may register (join or rejoin) at any time; they take part from the next round. On a measured real
link (`measure_links`) each device's link is also probed at registration and between rounds
(`edge_node.probing`, `probe_links`).
With `scenario.rounds: asynchronous`, `run` hands over to `edge_node.async_rounds` (each device's own cycles,
continuous batching), which reuses this server's sockets, sessions, verifier and handlers (`cycles`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import zmq

from edge_node.controller import (
    Arrival,
    Controller,
    DeviceOutcome,
    RoundPlan,
    air_time,
    channel_links,
    round_record,
    virtual_round,
)
from edge_node.probing import Prober
from edge_node.round_state import DRAIN_BATCH, ArrivedDraft, RoundInFlight
from testbed.core.model import ul_first_bits
from testbed.core.sampling import (
    RoundRandomness,
    SamplingParams,
    Verdict,
    exact_from_wire,
    to_probs,
    to_wire_precision,
    verify_draft,
)
from testbed.runtime import security, timeline
from testbed.runtime.errors import TestbedError
from testbed.runtime.link_estimate import LinkEstimator
from testbed.runtime.waiting import Rehearsal, wait_readable
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

log = logging.getLogger("multispin.edge")

REFUSAL_LOG_BURST = 20  # refusals logged per second; beyond that they are counted (a flood must not fill the disk)
# Messages a second per identity (bursts of one second's worth). An honest device sends 2-3 a round (draft, report,
# a tx_start marker; heartbeats only when idle; probe echoes one per probe, 10 ms apart): 450 a second at 146
# rounds/s (micro pair), 600 at 300 rounds/s (a scripted device against a fake verifier).
MAX_MSGS_PER_S = 1000.0
# A message read within this of the edge becoming free was already queued while the edge was busy, so its
# arrival stamp is late (the virtual clock then estimates the arrival; see `controller.virtual_round`).
WAITED_S = 0.0005
# A connection that has not finished ZeroMQ's handshake within this is closed (libzmq's default is 30 s): a
# raw TCP peer, or a key the ZAP handler refuses, must not hold one of the edge's open files for long.
HANDSHAKE_S = 5.0


class Refusal(ProtocolError):
    """A refused message with a reason tag for the per-reason counters (`EdgeServer.refusals`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
    last_heard: float = 0.0                 # edge clock: the device's latest message of any kind
    last_sent: float = 0.0                  # edge clock: our latest message to it (heartbeats included)
    features: frozenset[str] = frozenset()  # what its device understands (`register.features`)


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


class ThreadClock:
    """This thread's wall and CPU clocks from when it was made: of the span since, how long the thread did not
    run (a host shared with emulated devices gave them the cores). The virtual clock counts only the rest."""

    def __init__(self):
        self.wall0, self.cpu0 = time.monotonic(), time.thread_time()

    def descheduled_s(self) -> float:
        return max(0.0, (time.monotonic() - self.wall0) - (time.thread_time() - self.cpu0))


class EdgeServer:
    def __init__(self, bind: str, verifier, *, scenario, controller: Controller, prompts: list[list[int]],
                 sampling: SamplingParams, seed: int = 0, deadline_s: float = 10.0, max_misses: int = 2,
                 max_new_tokens: int = 0, on_air_vocab_size: int | None = None, vocab_size: int,
                 channel=None, channel_mode: str = "passthrough", base_latency_s: float = 0.0,
                 recorder=None, policy: str = "proposed", prompt_texts: list[str] | None = None,
                 max_array_bytes: int = P.MAX_ARRAY_BYTES, tx_marker: bool = True, context=None,
                 keys_dir: str | None = None, heartbeat_s: float = 1.0, liveness: int = 5,
                 measure_links: bool = False, rate_probes=None,
                 max_msgs_per_s: float | None = MAX_MSGS_PER_S, schedule_ahead: bool = False,
                 busy_poll: bool = False):
        if not (math.isfinite(heartbeat_s) and M.MIN_HEARTBEAT_S <= heartbeat_s <= M.MAX_HEARTBEAT_S):
            raise ValueError(f"heartbeat_s={heartbeat_s!r}; allowed: {M.MIN_HEARTBEAT_S}..{M.MAX_HEARTBEAT_S} s")
        if not (isinstance(liveness, int) and 1 <= liveness <= M.MAX_LIVENESS):
            raise ValueError(f"liveness={liveness!r}; allowed: an integer in 1..{M.MAX_LIVENESS}")
        self.verifier, self.scenario, self.controller = verifier, scenario, controller
        self.prompts, self.prompt_texts = prompts, prompt_texts or [""] * len(prompts)
        self.params, self.seed = sampling, seed
        self.deadline_s, self.max_misses, self.max_new_tokens = deadline_s, max_misses, max_new_tokens
        self.on_air, self.vocab = on_air_vocab_size, vocab_size
        self.bits = scenario.bits_per_prob
        P.wire_dtype(self.bits)  # fail early on an unsupported precision
        self.channel, self.channel_mode, self.base_latency_s = channel, channel_mode, base_latency_s
        # () -> why the emulator's process is gone, or None while it runs: set by whoever started it
        # (`testbed.run.session`); a cheap check each tick, so a dead emulator is seen within a heartbeat.
        self.channel_exited = None
        self.check_stop = None  # optional callable, at every tick: raises to end the run (a swallowed signal)
        # Optional callable(record), just before a record is written: the session's progress line goes first, so
        # a kill between the two leaves the tokens of a round without its record, never a record without them.
        self.before_record = None
        self.channel_down: str | None = None  # why the emulator is known dead: no further control calls
        self.recorder, self.policy = recorder, policy
        self.max_array_bytes, self.tx_marker = max_array_bytes, tx_marker
        self.heartbeat_s, self.liveness = float(heartbeat_s), liveness
        self.window_s = liveness * self.heartbeat_s  # silent this long: the peer is dead
        self.keys = security.ServerKeys.load(keys_dir) if keys_dir else None
        # Per routing identity, i.e. per connection (no handover: one connection per name). None: no limit.
        self.limiter = security.RateLimiter(max_msgs_per_s) if max_msgs_per_s is not None else None
        self.ctx = context or zmq.Context.instance()
        # One open file per connection: up to the hard limit, not the shell's soft one (often 1,024): idle
        # peers that fill the soft limit lock every new device out (seen: 400 connections at a limit of 200).
        security.fd_limit(raise_soft=True)
        self.sock = self._bind(bind, max_array_bytes)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.sessions: dict[str, Session] = {}
        self.routes: dict[str, bytes] = {}  # with CURVE on a direct link: name -> its connection's routing identity
        self.known = {d.name for d in scenario.devices}
        self._sid = itertools.count()
        self._round: RoundInFlight | None = None  # the latest round, kept after it closes for its late reports
        # Asynchronous rounds (`edge_node.async_rounds`): each device's own cycle in flight; None: synchronous.
        self.cycles: dict[str, RoundInFlight] | None = None
        self._in_round = False
        self._finished: dict[str, Session] = {}   # sessions that ended: outputs only (no KV cache, no drafts)
        self._next_plan: tuple[RoundPlan, float] | None = None  # (plan, seconds it took) made one round ahead
        # No channel to account for (passthrough, links not measured): round r+1's schedules may go out right
        # after round r's verdicts, its reports and record then overlap the next drafting (`_schedule_ahead`).
        self.schedule_ahead = schedule_ahead and channel is None and not measure_links
        self._ahead: RoundInFlight | None = None      # the next round, scheduled with this round's verdicts
        self._reporting: RoundInFlight | None = None  # the round whose reports come in while `_ahead` drafts
        self._rounds_end = 0  # `run`'s last round + 1: nothing is scheduled ahead past it
        self.busy_poll = busy_poll  # `testbed.runtime.waiting`: a core for no kernel wake-up per message
        self._dispatch_clock = ThreadClock()  # restarted for each message (a draft's `handled_s`)
        self._frames_in: list = []  # the message being handled (a draft's are kept for `rehearsal`)
        self.rehearsal = Rehearsal(busy_poll)  # the last draft's decode and checks, rerun while busy-polling
        self.refused = 0
        self.refusals: Counter[str] = Counter()   # reason -> refused messages
        self.device_errors: dict[str, str] = {}  # name -> why the device said it cannot take part
        self._refusal_log = security.LogThrottle(log, REFUSAL_LOG_BURST, "refused messages")
        self._heartbeat = M.heartbeat()
        self._next_tick = 0.0
        self._last_probe = 0.0
        self.rounds_done = 0
        self._last_round_end: float | None = None  # edge clock: when the latest round ended (`edge_phases`)
        self.last_record: dict | None = None
        self.t_origin = time.monotonic()
        self.round_index = 0
        self._free_since = 0.0  # edge clock: when the edge last became free to read a message
        # Virtual clock: the measured transport outside the air time (arrival - its lower bound), per message
        # kind and mode, from messages read while the edge was idle; it places the ones that had to wait. For
        # devices sharing a process: each round's least, per kind (`_arrival`).
        self._transport: dict[tuple[str, str], deque[float]] = {}
        self._hosted_least: dict[tuple[str, str], deque[float]] = {}
        # A real link (no emulator): estimate each device's UL and DL rate from what this edge measures, and
        # let the controller plan with them (`testbed.runtime.link_estimate`).
        self.links = LinkEstimator() if measure_links else None
        # ... and probe sweeps of each (`edge_node.probing`; `rate_probes`: testbed.run.profile.RateProbeSettings)
        self.prober = Prober(self, rate_probes) if measure_links and rate_probes and rate_probes.enabled else None
        controller.seed_header_bits(draft_header_bits(controller.base, self.bits, self.on_air))

    def _bind(self, bind: str, max_array_bytes: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # No handover: a second connection under a connected name is ignored by ZeroMQ, so it cannot take a
        # live device's messages. A crashed device's connection closes, which frees its name for the restart;
        # TCP keepalive and a retransmission limit close a connection whose host vanished (no FIN ever comes).
        # Not ZeroMQ's transport heartbeat: with it, libzmq 4.3.5 aborts the process when a peer hangs up with
        # the edge's receive queue full (stream_engine_base.cpp:310), which any peer can arrange.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, math.ceil(self.heartbeat_s)))
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, math.ceil(self.heartbeat_s)))
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, self.liveness)
        sock.setsockopt(zmq.TCP_MAXRT, max(1, int(self.window_s * 1000)))
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        # Refuse absurd messages at the transport too (the peer is disconnected, the edge goes on).
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_array_bytes + P.MAX_HEADER_BYTES)
        # CURVE before bind; no keys: plain. Behind an emulator only its key connects: a device's own key
        # would skip the air time (the handshake fails, so it cannot even hold a device's name here).
        security.make_server(sock, self.keys, admit=None if self.channel_mode == "passthrough"
                             else (security.CHANNEL_CLIENT,))
        sock.bind(bind)
        return sock

    # -- transport -------------------------------------------------------------------------------
    def _send(self, name: str, frames: list) -> None:
        self.sock.send_multipart([self.routes.get(name) or name.encode(), *frames], copy=False)
        s = self.sessions.get(name)
        if s is not None:
            s.last_sent = time.monotonic()

    def _send_air(self, name: str, frames: list) -> None:
        if self.tx_marker and self.channel is not None:
            self._send(name, [P.tx_start_marker("dl")])
        self._send(name, frames)

    def _refuse(self, ident: bytes, reason: str, message: str, round_index=None, *, answer: bool = True) -> None:
        """Count and log a refused message; with `answer`, answer its sender with an `error` (M.error is safe
        on peer text). Under a name in use by another connection ZeroMQ delivers nothing, so the reply reaches
        the sender."""
        self.refused += 1
        self.refusals[reason] += 1
        self._refusal_log.warn(time.monotonic(), reason, "refused a message from %s: %s",
                               P.show(ident.decode("utf-8", "replace"), 80), message)
        if not answer:
            return
        try:
            self.sock.send_multipart([ident, *M.error(message, round_index=round_index)], copy=False)
        except zmq.ZMQError:
            pass

    def poll(self, until: float, stop=None) -> None:
        """Serve incoming messages until the monotonic time `until` or until `stop()` is true; heartbeats,
        liveness and the channel check run in between (`_tick`)."""
        while True:
            if stop is not None and stop():
                return
            now = time.monotonic()
            self._tick(now)
            left = until - now
            if left <= 0:
                return
            wait = min(left, max(0.0, self._next_tick - time.monotonic()))
            self._free_since = time.monotonic()
            if not wait_readable(self.sock, max(0.001, wait), busy=self.busy_poll, rehearse=self.rehearsal.run):
                continue
            if self.drain(stop, limit=DRAIN_BATCH):
                return

    # -- one message -----------------------------------------------------------------------------
    def _dispatch(self, frames: list, t_arr: float) -> None:
        """Handle one message; whatever fails costs this message only (an error reply, one log line)."""
        self._dispatch_clock = ThreadClock()
        self._frames_in = frames
        ident = frames[0].bytes
        if self.limiter is not None and not self.limiter.allow(ident, t_arr):
            # Before anything is decoded, and unanswered: a flood costs a receive and this check. A device's
            # probe echoes come one per probe, at most one per GAP_S (10 ms): far below the limit.
            self._refuse(ident, "rate_limited", f"over {self.limiter.rate:g} messages/s; dropped unanswered",
                         answer=False)
            return
        name, keyed = self._sender(ident, frames)
        header: dict = {}
        try:
            self._check_sender(frames)
            try:
                header, arrays = P.decode(frames[1:], max_array_bytes=self.max_array_bytes)
            except ProtocolError as exc:
                raise Refusal("malformed", f"malformed message: {exc}") from None
            timeline.stamp(f"edge: {header['type']} in", t_arr)
            timeline.stamp(f"edge: {header['type']} decoded")
            if keyed and (name not in self.routes or security.claims_route(name, header)):
                self.routes[name] = ident  # replies to the name go here (one entry per listed key at most)
            s = self.sessions.get(name)
            if s is not None and header["type"] != P.REGISTER:
                s.last_heard = t_arr  # any message is a sign of life, but a register may come from a new process
            nbytes = sum(len(f) for f in frames[1:])  # bytes, as the emulator counts them (header + arrays)
            waited = t_arr - self._free_since < WAITED_S
            self._handle(name, header, arrays, nbytes, self._via_channel(frames), t_arr, waited)
        except Refusal as exc:
            self._refuse(ident, exc.reason, str(exc), header.get("round"))
        except ProtocolError as exc:
            self._refuse(ident, "invalid", str(exc), header.get("round"))
        except Exception as exc:  # a bug or an input nobody foresaw: this message is lost, not the edge
            log.debug("handling a message from %r failed", name, exc_info=True)
            kind = header.get("type") if header.get("type") in M.MESSAGE_TYPES else "message"
            self._refuse(ident, "internal", f"{kind} could not be handled ({type(exc).__name__}); it was dropped",
                         header.get("round"))

    def _sender(self, ident: bytes, frames: list) -> tuple[str, bool]:
        """(the name a message speaks for, whether its key says so): with CURVE on a direct link, the name its
        key is bound to, never the routing identity (the peer's own choice: a listed key that connected first
        under another device's name would hold that name, as ZeroMQ ignores a second connection under it);
        replies to the name go to the connection that last registered under it (`routes`,
        `security.claims_route`). Else the routing identity."""
        key_name = None
        if self.keys is not None and self.channel_mode == "passthrough" and len(frames) > 1:
            key_name = security.sender_name(frames[1])
        if key_name is None or key_name == security.CHANNEL_CLIENT:
            return ident.decode("utf-8", "replace"), False
        return key_name, True

    def _check_sender(self, frames: list) -> None:
        """With CURVE behind an emulator: only the emulator's key, which speaks for every device (the ZAP handler
        refuses the others already). On a direct link a key speaks for its own name (`_sender`): nothing to check."""
        if self.keys is None or len(frames) < 2 or self.channel_mode == "passthrough":
            return
        sender = security.sender_name(frames[1])
        if sender != security.CHANNEL_CLIENT:
            raise Refusal("identity", f"the key of {sender!r} cannot reach this edge: "
                                      "devices connect through the channel emulator")

    def _via_channel(self, frames: list) -> bool:
        """Whether the message came through the channel emulator, so that its `channel` annotation is the
        emulator's and not the sender's own (a device can write any annotation into its header)."""
        if self.channel_mode == "passthrough":
            return False
        if self.keys is not None and len(frames) > 1:
            return security.sender_name(frames[1]) == security.CHANNEL_CLIENT
        return True  # without keys the edge cannot tell; the emulator overwrites charged messages' annotation

    def _handle(self, name: str, header: dict, arrays: dict, nbytes: int, via_channel: bool, t_arr: float,
                waited: bool = False) -> None:
        kind = header["type"]
        if kind == P.TX_START:
            return  # a marker that reached us directly (no emulator in between)
        if kind == P.HEARTBEAT:
            if name not in self.sessions:
                raise Refusal("not_registered", f"heartbeat from {name!r}, which is not registered; send register")
            # last_heard is already refreshed. An idle device's link reading rides on its heartbeat: a device
            # that sits rounds out for want of a fresh reading (live `fallback: drop`) sends no report.
            self._take_link(name, M.parse_link(header), t_arr)
            return
        if kind == P.REGISTER:
            self._on_register(name, header)
        elif kind == P.DRAFT:
            self._on_draft(name, header, arrays, nbytes, via_channel, t_arr, waited)
        elif kind == P.REPORT:
            self._on_report(name, header, via_channel, t_arr, waited)
        elif kind == P.ERROR:
            self._on_device_error(name, header)
        elif kind == P.PROBE_ECHO and self.prober is not None:
            if name not in self.sessions:
                raise Refusal("not_registered", f"probe_echo from {name!r}, which is not registered")
            self.prober.on_echo(name, header, arrays, t_arr)
        else:
            raise ProtocolError(f"type: {P.show(kind)} is not allowed from a device; allowed: register, draft, "
                                "report, heartbeat, error" + (", probe_echo" if self.prober is not None else ""))

    def _on_device_error(self, name: str, header: dict) -> None:
        """A device says why it cannot take part (e.g. its model does not load): keep and print the reason;
        a fatal one ends its session. A non-fatal one naming the round in flight (e.g. a schedule refused over
        an unverified draft) ends the device's part of that round at once. Not answered."""
        err = M.parse_error(header)
        if name not in self.known:
            raise Refusal("unknown_device", "error from a device that is not part of this run")
        s, cur = self.sessions.get(name), self._round_of(name)
        if (not err.fatal and err.round is not None and s is not None and cur is not None
                and err.round == cur.index and cur.sids.get(name) == s.sid):
            log.warning("%s: round %d: %s", name, cur.index, err.message)
            if cur.awaits_draft(name):
                cur.given_up[name] = f"the device refused the round: {P.show(err.message, 200)}"
            return
        self.device_errors[name] = err.message
        log.error("%s: cannot take part: %s", name, err.message)
        if err.fatal and name in self.sessions:
            self._drop_session(name, f"the device reported: {err.message}", notify=False)

    # -- sessions --------------------------------------------------------------------------------
    def _on_register(self, name: str, header: dict) -> None:
        reg = M.parse_register(header)
        if reg.name != name:
            raise ProtocolError(f"register.name: {reg.name!r} differs from the sender's name {P.show(name)} (its "
                                "routing identity; with CURVE keys, the name its key is bound to)")
        if name not in self.known:
            # The valid names are not listed: they would tell a stranger which names to try.
            raise Refusal("unknown_device", f"register.name: {name!r} is not a device of this profile")
        if reg.vocab_size != self.vocab:
            raise ProtocolError(f"register.vocab_size: {reg.vocab_size} is not allowed; the target has {self.vocab}")
        old = self.sessions.get(name)
        if old is not None and self._alive(old):
            # Not "register.*": a restarted device retries (its old session ends once silent), it does not quit.
            raise Refusal("name_in_use", f"name in use: {name!r} has a live session; register again once it has "
                                         f"been silent for {self.window_s:g} s (a restarted device takes it over)")
        if old is not None:
            log.info("%s: re-registered; closing its old session %s", name, old.sid)
            self._end_session(name, "re-registered", notify=False)
        self._open_session(name, reg.hardware, reg.features)

    def _alive(self, s: Session) -> bool:
        """A session whose device was heard within the liveness window and that the edge has not ended."""
        return not s.done and time.monotonic() - s.last_heard <= self.window_s

    def _open_session(self, name: str, hardware: dict, features: frozenset[str] = frozenset()) -> None:
        idx = sorted(self.known).index(name) % len(self.prompts)
        sid = f"{name}#{next(self._sid)}"
        prompt = list(self.prompts[idx])
        self.verifier.open(sid, prompt)
        now = time.monotonic()
        self.sessions[name] = Session(name, sid, prompt, hardware, pending=[], last_heard=now, features=features)
        self.controller.observe_hardware(name, hardware)  # its energy constants, for the records
        self._send(name, M.registered(sid, prompt, seed=self.seed, sampling=dataclasses.asdict(self.params),
                                      bits_per_prob=self.bits, on_air_vocab_size=self.on_air,
                                      max_draft_len=self.scenario.max_draft_len,
                                      tx_marker=self.tx_marker and self.channel_mode != "passthrough",
                                      heartbeat_s=self.heartbeat_s, liveness=self.liveness))
        log.info("%s: registered (session %s, hardware %s)", name, sid, hardware.get("name"))
        if self.prober is not None:
            self.prober.on_register(name, sid)  # its links are swept before its first round

    def _drop_session(self, name: str, reason: str, *, notify: bool = True) -> None:
        """End a session with a log line; `notify`: tell its device (`bye`: it exits)."""
        if name in self.sessions:
            log.warning("%s: left the session: %s", name, reason)
            self._end_session(name, reason, notify=notify)

    def _end_session(self, name: str, reason: str, *, notify: bool) -> None:
        """Close a session: free its KV cache, keep its outputs only, take it out of the round in flight."""
        s = self.sessions.pop(name, None)
        if s is None:
            return
        self.verifier.close(s.sid)
        if s.unconfirmed:
            # Tokens whose verdict the device never confirmed: it may never have had them.
            del s.output_ids[-s.unconfirmed:]
            s.unconfirmed = 0
        s.pending, s.last_drafts = None, []
        self._finished[name] = s
        for cur in {id(c): c for c in (self._reporting, self._round_of(name)) if c is not None}.values():
            if cur.sids.get(name) == s.sid:
                cur.given_up.setdefault(name, reason)
                cur.reports_given_up.add(name)
        if notify:
            try:
                self._send(name, M.done(reason))
            except zmq.ZMQError:
                pass

    def wait_for_devices(self, names: list[str], timeout_s: float) -> list[str]:
        """Serve registrations until all `names` registered or the timeout; returns those missing."""
        self.poll(time.monotonic() + timeout_s, stop=lambda: all(n in self.sessions for n in names))
        return [n for n in names if n not in self.sessions]

    # -- liveness and the channel check ----------------------------------------------------------
    def _tick(self, now: float) -> None:
        """Housekeeping a few times per heartbeat period: the refusal log's window closed, the emulator's
        process checked (in rounds too), heartbeats out, silent sessions ended, and between rounds a check
        that the emulator still answers. `check_stop` first, at every call: it is one attribute test."""
        if self.check_stop is not None:
            self.check_stop()
        if now < self._next_tick:
            return
        self._next_tick = now + self.heartbeat_s / 4
        self._refusal_log.flush(now)
        self._check_channel_process()
        self._send_heartbeats(now)
        self._end_silent_sessions(now)
        if not self._in_round:
            self._probe_channel(now)

    def _send_heartbeats(self, now: float) -> None:
        for name, s in list(self.sessions.items()):
            if not s.done and now - s.last_sent >= self.heartbeat_s:
                self._send(name, self._heartbeat)  # uncharged (no "air"): the emulator passes it at once

    def _end_silent_sessions(self, now: float) -> None:
        for name, s in list(self.sessions.items()):
            cur = self._round_of(name)
            silent = now - s.last_heard
            if silent <= self.window_s:
                continue
            if cur is not None and cur.awaits_draft(name) and cur.sids.get(name) == s.sid:
                continue  # a device busy drafting cannot beat; the round's deadline governs it
            if s.done:
                self._end_session(name, "done and silent", notify=False)
            else:
                # No bye: the device is presumed dead, and its name may already belong to its restarted
                # process. Should it be alive after all, its next message gets "not registered".
                self._drop_session(name, f"silent for {silent:.1f} s (liveness window {self.window_s:g} s)",
                                   notify=False)

    def _check_channel_process(self) -> None:
        """The emulator's process, asked without a request: drafts and reports cannot come through a dead
        emulator, so waiting out the round's deadline and a control timeout would only delay the end."""
        why = self.channel_exited() if self.channel_exited is not None else None
        if why is not None:
            self._channel_dead(f"channel emulator at {getattr(self.channel, 'endpoint', '?')} {why}")

    def _channel_dead(self, message: str):
        self.channel_down = message
        raise TestbedError(message)

    def _probe_channel(self, now: float) -> None:
        if self.channel is None or now - self._last_probe < self.heartbeat_s:
            return
        self._last_probe = now
        self._channel_call("stats", self.channel.stats)

    def _channel_call(self, what: str, fn, *args, **kwargs):
        """A request to the channel emulator; a dead or failing emulator ends the run with a clear error."""
        if self.channel_down is not None:  # known dead: a request would only wait out its timeout
            raise TestbedError(self.channel_down)
        self._check_channel_process()  # died since the last tick (e.g. just before a round's configure)
        try:
            return fn(*args, **kwargs)
        except TimeoutError as exc:
            self._check_channel_process()  # exited: say so rather than "did not answer"
            where = getattr(self.channel, "endpoint", "?")
            self._channel_dead(f"channel emulator at {where} stopped answering ({what}: {exc})")
        except RuntimeError as exc:
            where = getattr(self.channel, "endpoint", "?")
            raise TestbedError(f"channel emulator at {where} failed ({what}: {exc})") from None

    # -- drafts and reports ----------------------------------------------------------------------
    def _on_draft(self, name: str, header: dict, arrays: dict, nbytes: int, via_channel: bool,
                  t_arr: float, waited: bool = False) -> None:
        s = self.sessions.get(name)
        if s is None:
            raise Refusal("not_registered", f"draft from {name!r}, which is not registered; send register first")
        cur, r = self._round_of(name), header.get("round")
        if cur is not None and r == cur.index and name in cur.drafts:
            raise ProtocolError(f"draft.round: a second draft for round {r}")
        if cur is None or r != cur.index or cur.sids.get(name) != s.sid or not cur.awaits_draft(name):
            log.info("%s: discarding a draft for round %s (round in flight: %s)", name, P.show(r, 20),
                     None if cur is None else cur.index)
            return
        slot = cur.schedule[name]
        checks = dict(mode=slot.mode, draft_len=slot.draft_len, vocab_size=self.vocab, bits_per_prob=self.bits,
                      on_air_vocab=self.on_air, topk=cur.plan.topk)
        try:
            d = self._parse_draft(s, header, arrays, checks, via_channel)
        except Exception as exc:
            # Its draft will not come: the round goes on without it at once instead of at the deadline.
            cur.given_up[name] = f"draft refused: {P.show(str(exc), 200)}"
            raise
        timeline.stamp("edge: draft checked")
        self.rehearsal.set(self._rehearse_draft, self._frames_in[1:], checks)
        s.unconfirmed = 0  # its last_token matched: the device holds every token committed so far
        handled_s = max(0.0, time.monotonic() - t_arr - self._dispatch_clock.descheduled_s())
        cur.drafts[name] = ArrivedDraft(t_arr, d, nbytes, waited, handled_s=handled_s)

    def _rehearse_draft(self, frames: list, checks: dict) -> None:
        """A draft's decode and checks on `frames` (one that passed them), its result dropped."""
        header, arrays = P.decode(frames, max_array_bytes=self.max_array_bytes)
        M.parse_draft(header, arrays, **checks)

    def _parse_draft(self, s: Session, header: dict, arrays: dict, checks: dict, via_channel: bool) -> M.Draft:
        d = M.parse_draft(header, arrays, **checks)
        expected_last = (s.output_ids or s.prompt_ids)[-1]
        if d.last_token != expected_last:
            raise ProtocolError(f"draft.last_token: {d.last_token} does not match the committed context "
                                f"(last token {expected_last}); the device is out of sync")
        if not via_channel:
            d.channel = None  # no emulator in between: an annotation would be the device's own claim
        elif header.get("air") != "ul":
            # Through the emulator a draft must be charged: one sent without "air" skips its air time.
            raise ProtocolError(f"draft.air: {P.show(header.get('air'))} is not allowed through the channel "
                                "emulator; must be 'ul'")
        return d

    def _on_report(self, name: str, header: dict, via_channel: bool, t_arr: float | None = None,
                   waited: bool = False) -> None:
        s = self.sessions.get(name)
        if s is None:
            raise Refusal("not_registered", f"report from {name!r}, which is not registered")
        cur = self._reports_round_of(name, s)
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
            cur.reports[name] = (time.monotonic() if t_arr is None else t_arr, rep)
            if waited:
                cur.reports_waited.add(name)
        self._take_link(name, rep.link, time.monotonic() if t_arr is None else t_arr)

    def drain(self, stop=None, mark_free: bool = True, limit: int | None = None) -> bool:
        """Handle every message already queued (until `stop()` is true, or `limit` messages); returns whether it
        stopped. With `mark_free`, the edge counts as free again after each message (what was read late is
        told apart)."""
        for _ in itertools.repeat(None) if limit is None else range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self._dispatch(frames, time.monotonic())
            if mark_free:
                self._free_since = time.monotonic()
            if stop is not None and stop():
                return True
        return False

    def publish_link_rates(self, names: list[str]) -> None:
        """The measured link rates the controller plans `names` with, and their sources (rounds, probe, model)."""
        for name in names:
            rates, sources = self.links.plan_rates(name)
            self.controller.measured_rates[name] = rates
            self.controller.measured_sources[name] = sources

    def probe_links(self) -> None:
        """Between rounds: the probe sweeps due (`edge_node.probing.Prober.between_rounds`); the plan made
        ahead is dropped after one, so that the next round plans with what it measured."""
        if self.prober is not None and self.prober.between_rounds():
            self._next_plan = None

    def _reports_round_of(self, name: str, s: Session) -> RoundInFlight | None:
        """The round a device's report answers: the one collecting reports while the next drafts, else its round."""
        rep = self._reporting
        return rep if rep is not None and rep.index == s.report_round else self._round_of(name)

    def _round_of(self, name: str) -> RoundInFlight | None:
        """The round a device's draft or report belongs to: the round in flight, or with asynchronous rounds
        the device's own cycle."""
        return self._round if self.cycles is None else self.cycles.get(name)

    def _take_link(self, name: str, link: dict | None, t_arr: float) -> None:
        """A device's link reading (its report or heartbeat) to a live channel state, dated on the edge's
        clock of the plans (`t_origin`): its arrival minus the age the device measured on its own clock."""
        cs = self.controller.channel_state
        if link is None or cs is None or getattr(cs, "source", None) != "live":
            return
        cs.report_live(name, link, t_s=t_arr - self.t_origin - (link.get("age_s") or 0.0))

    def _check_report(self, s: Session, header: dict) -> M.Report:
        rep = M.parse_report(header, self.vocab)
        if s.report_round != rep.round:
            raise ProtocolError(f"report.round: {rep.round} is not awaited (awaiting {s.report_round})")
        if rep.n_accepted != s.last_n:
            raise ProtocolError(f"report.n_accepted: {rep.n_accepted} differs from the verdict's {s.last_n}")
        if s.expected_token is not None and rep.token != s.expected_token:
            raise ProtocolError(f"report.token: {rep.token} differs from the token {s.expected_token} sent")
        return rep

    # -- one round, phase by phase -------------------------------------------------------------
    def run_round(self, r: int) -> dict | None:
        """One synchronous round; returns its record (already written), or None when no device can take part.

        plan -> schedule -> collect drafts -> verify and reply -> collect reports -> close and record. A round
        scheduled ahead (with the previous round's verdicts) starts at collecting its drafts.
        """
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.index == r:
            return self._serve_round(ahead, self._active_names())
        self._sit_out_missing_reports()
        self._end_silent_sessions(time.monotonic())  # a dead device is not scheduled
        names = self._active_names()
        if not names:
            return None
        rp, plan_s = self._plan(r, names)
        if not rp.devices:
            # Every device sat out (a live channel without fresh readings, `fallback: drop`): no round; wait
            # a heartbeat period, on which idle devices send their readings.
            log.warning("round %d: no device can be planned (%s)", r, "; ".join(f"{n}: {why}"
                                                                              for n, why in rp.sat_out.items()))
            self.poll(time.monotonic() + self.heartbeat_s)
            return None
        return self._serve_round(self._schedule(r, rp, plan_s), names)

    def _serve_round(self, cur: RoundInFlight, names: list[str]) -> dict:
        """A scheduled round from its drafting on: collect drafts, verify and reply (and perhaps schedule the next
        round), collect reports, close and record."""
        self._in_round = True
        try:
            # While the devices draft: plan the next round (its estimates then lag one round, which costs
            # nothing measurable and keeps the optimizer off the critical path).
            planning = ThreadClock()
            self._next_plan = self._fresh_plan(cur.index + 1, names)
            # The verification's random draws, made while the devices draft instead of after the verification.
            cur.draws = {n: DrawsAhead(self.seed, n, cur.index, slot.draft_len) for n, slot in cur.schedule.items()}
            cur.plan_descheduled_s = planning.descheduled_s()
            timeline.stamp("edge: next round planned")
            present = self._collect_drafts(cur)
            outcomes, verify_s = self._verify_and_reply(cur, present)  # and perhaps the next round's schedules
            try:
                t_end = self._collect_reports(cur, outcomes)
            finally:
                self._reporting = None
            if self._ahead is not None:
                t_end = self._ahead.t0  # the round ended when the next began; its reports overlap that one
            return self._close_round(cur, outcomes, verify_s, t_end)
        finally:
            self._in_round = False

    def _active_names(self) -> list[str]:
        return sorted(n for n, s in self.sessions.items() if not s.done and s.awaiting_report is None)

    def _sit_out_missing_reports(self) -> None:
        """A device whose DL-mode correction (its report) never came cannot draft: it sits this round out."""
        for name, s in list(self.sessions.items()):
            if s.awaiting_report is None or s.done:
                continue
            s.misses += 1
            log.warning("%s: no report for round %d yet (%d misses)", name, s.awaiting_report, s.misses)
            if s.misses >= self.max_misses:
                self._drop_session(name, f"no report for round {s.awaiting_report}")

    # plan
    def _plan(self, r: int, names: list[str]) -> tuple[RoundPlan, float]:
        """The plan made during the previous round if it is for these devices; else a fresh one."""
        planned, self._next_plan = self._next_plan, None
        if planned is not None and planned[0].round == r and (planned[0].requested or planned[0].devices) == names:
            return planned
        return self._fresh_plan(r, names)  # a device joined, left or is late: plan for those actually here

    def _fresh_plan(self, r: int, names: list[str]) -> tuple[RoundPlan, float]:
        t = time.monotonic()
        rp = self.controller.plan_round(r, names, t - self.t_origin)
        return rp, time.monotonic() - t

    def _schedule_ahead(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome]) -> RoundInFlight | None:
        """With `schedule_ahead`, send round r+1's schedules right after round r's verdicts when the edge already
        holds every token of round r (no DL-mode correction to wait for) and the plan made during the drafting
        is for exactly these devices: a device reads its verdict, reports and drafts on at once, and the report
        trip and the record of round r leave the critical path. Returns the round scheduled, or None; its
        schedules go out with the verdicts (`_send_verdict`)."""
        if not self.schedule_ahead or cur.index + 1 >= self._rounds_end or self._next_plan is None:
            return None
        rp, plan_s = self._next_plan
        names = sorted(outcomes)
        if (rp.round != cur.index + 1 or names != sorted(cur.schedule) or sorted(rp.devices) != names
                or any(o.dl_payload != "token" for o in outcomes.values())
                or any(self._has_all_tokens(self.sessions[n], outcomes[n].tokens) for n in names)):
            return None
        self._next_plan, self._reporting = None, cur
        nxt = self._schedule(cur.index + 1, rp, plan_s, send=False)
        nxt.ahead = True
        return nxt

    def _has_all_tokens(self, s: Session, uncommitted: int = 0) -> bool:
        return bool(self.max_new_tokens) and len(s.output_ids) + uncommitted >= self.max_new_tokens

    # schedule
    def _schedule(self, r: int, rp: RoundPlan, plan_s: float, send: bool = True) -> RoundInFlight:
        """Give the channel emulator the plan's rates (which also proves it answers), then send each
        device its schedule (with `send`; else the caller sends them, `_schedule_fields`)."""
        if self.channel is not None:
            self._channel_call("configure", self.channel.configure, round=r, links=channel_links(rp),
                               dl_access=rp.scenario.dl_access, base_latency_s=self.base_latency_s)
            self._last_probe = time.monotonic()
        cur = RoundInFlight(r, rp, plan_s, {n: rp.per_device[n] for n in rp.devices},
                            {n: self.sessions[n].sid for n in rp.devices}, t0=time.monotonic())
        self._round = cur
        if send:
            for name in cur.schedule:
                self._send(name, M.schedule_of(self._schedule_fields(cur, name)))
            timeline.stamp("edge: schedules sent")
        return cur

    def _schedule_fields(self, cur: RoundInFlight, name: str) -> dict:
        """`name`'s schedule of round `cur` (`messages.schedule_fields`)."""
        slot = cur.schedule[name]
        return M.schedule_fields(cur.index, slot.mode, slot.draft_len, slot.ul_power_w or 0.0, slot.dl_power_w or 0.0,
                                 self.deadline_s, topk=cur.plan.topk)

    # collect drafts
    def _collect_drafts(self, cur: RoundInFlight) -> list[str]:
        """Serve messages until every scheduled device drafted or is out (refused, gone), or the deadline;
        returns the devices whose draft came."""
        cur.t_drafts_from = time.monotonic()  # the edge planned the next round before this
        self.poll(cur.t0 + self.deadline_s, stop=cur.drafting_done)
        cur.t_drafts_closed = time.monotonic()
        cur.closed = True
        present = []
        for name in cur.schedule:
            s = self.sessions.get(name)
            if s is None or s.sid != cur.sids[name]:
                continue  # it left or rejoined during the round: nothing to count against the new session
            if name in cur.drafts:
                s.misses = 0
                present.append(name)
            else:
                self._missed(cur.index, name, cur.given_up.get(name, f"no draft within {self.deadline_s} s"))
        return present

    def _missed(self, r: int, name: str, reason: str) -> None:
        """The device is out of round `r`: it gets a `dropped` verdict (it redrafts next round)."""
        s = self.sessions[name]
        s.misses += 1
        log.warning("%s: out of round %d (%d misses in a row): %s", name, r, s.misses, reason)
        self._send(name, M.dropped(r, reason))
        if s.misses >= self.max_misses:
            self._drop_session(name, f"missed {s.misses} consecutive rounds")

    # verify and reply
    def _verify_and_reply(self, cur: RoundInFlight, present: list[str]) -> tuple[dict[str, DeviceOutcome],
                                                                                   float | None]:
        """ONE batched forward over every device's drafts, then each device's verdict; returns the outcomes
        and the verification time (None when no draft came)."""
        if not present:
            return {}, None

        def after_verdicts(outcomes):
            self._ahead = self._schedule_ahead(cur, outcomes)
            return self._ahead

        # Only where rounds can go ahead are all verdicts decided before the first goes out: through an
        # emulator each goes out as decided, its air time overlapping the next device's decision.
        outcomes, verify_s, _, cur.reply_descheduled_s = self.verify_batch(
            {n: cur for n in present}, after_verdicts=after_verdicts if self.schedule_ahead else None)
        return outcomes, verify_s

    def verify_batch(self, rounds: dict[str, RoundInFlight], before_verdicts=None, after_verdicts=None
                     ) -> tuple[dict[str, DeviceOutcome], float, float, float]:
        """ONE batched forward over the drafts of `rounds` (device -> its round in flight; asynchronous rounds
        mix cycles), `before_verdicts()` if given, then each device's verdict as it is decided; with
        `after_verdicts(outcomes)` (it returns the next round in flight, or None) every verdict is decided first
        and goes out with that round's schedule (`_send_verdict`). Then what the devices need not wait for: the
        sessions' commits and the estimates (the verification time's too). A draft that cannot be verified costs
        its device the session, not the others their round. Returns the outcomes, the verification time, when it
        started, and of the time after it the part this thread did not run (`ThreadClock`). Both round loops
        verify so."""
        names = list(rounds)
        items = [(self.sessions[n].sid, list(self.sessions[n].pending), rounds[n].drafts[n].draft.tokens.tolist())
                 for n in names]
        tv = time.monotonic()
        timeline.stamp("edge: verification starts", tv)
        logits = self.verifier.verify(items)
        verify_s = time.monotonic() - tv
        timeline.stamp("edge: verification done")
        replying = ThreadClock()
        if before_verdicts is not None:
            before_verdicts()
        outcomes, verdicts, replies = {}, {}, {}

        def unverifiable(name, exc):  # one device's data must not cost the others their round
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
        for name, verdict in verdicts.items():
            cur = rounds[name]
            try:
                self._commit(self.sessions[name], cur.index, verdict, cur.drafts[name].draft.tokens.tolist(),
                             cur.schedule[name].draft_len)
            except Exception as exc:
                outcomes.pop(name)
                self._unverifiable(cur, name, exc)
        self.controller.observe_verify(sum(rounds[n].schedule[n].draft_len + 1 for n in names), verify_s)
        for name, o in outcomes.items():
            self._observe(rounds[name], name, o)
        return outcomes, verify_s, tv, replying.descheduled_s()

    def _unverifiable(self, cur: RoundInFlight, name: str, exc: Exception) -> None:
        log.warning("%s: its draft of round %d could not be verified (%s: %s)", name, cur.index,
                    type(exc).__name__, P.show(str(exc), 200))
        self._drop_session(name, "its draft could not be verified")

    def _decide(self, cur: RoundInFlight, name: str, logits: np.ndarray) -> tuple[DeviceOutcome, Verdict, dict]:
        """Accept/reject for one device: its outcome, the verdict and the reply to send (`_send_verdict`): the
        token (bonus, or a UL-mode correction made here), or on a DL-mode rejection p_j for the device to
        correct with its own q_j. The session takes the verdict later (`_commit`)."""
        slot, arrived = cur.schedule[name], cur.drafts[name]
        d = arrived.draft
        # p is used as exact_from_wire of its wire rows, in both modes: a DL device rebuilds the identical
        # p_j from the row it downloads, so UL and DL give identical tokens.
        p_wire = to_wire_precision(to_probs(np.asarray(logits, dtype=np.float32), self.params), self.bits)
        rr = cur.draws.get(name) or RoundRandomness(self.seed, name, cur.index)
        verdict = verify_draft(exact_from_wire(p_wire), d.q_at, d.q_rows, d.tokens, slot.mode, rr)
        n = verdict.n_accepted
        reply = {"round_index": cur.index, "n_accepted": n, "token": verdict.token}
        if verdict.token is None:
            reply.update(p_row=p_wire[n], bits_per_prob=self.bits, on_air_vocab=self.on_air)
        return DeviceOutcome(n_accepted=n, tokens=n + 1, dl_payload="p" if verdict.token is None else "token",
                             ul_channel=d.channel, ul_bytes=arrived.nbytes, dl_bytes=0,
                             up_phase_s=arrived.t_arrival - cur.t0, t_verdict=0.0,
                             timings=_finite_values(d.timings), q_bytes=d.q_bytes), verdict, reply

    def _send_verdict(self, name: str, o: DeviceOutcome, reply: dict, nxt: RoundInFlight | None = None) -> None:
        """Send a decided verdict (`reply`: `messages.verdict`'s arguments) and, when the next round `nxt` goes
        out now, its schedule: inside the verdict (`verdict.next`, one message instead of two) to a device that
        listed `schedule_in_verdict`, else right behind it. The outcome takes the verdict's time and bytes
        (a schedule inside not counted: schedules are not charged)."""
        scheduled = nxt is not None and name in nxt.schedule
        inside = scheduled and M.SCHEDULE_IN_VERDICT in self.sessions[name].features
        fields = self._schedule_fields(nxt, name) if scheduled else None
        frames = M.verdict(**reply, next_schedule=fields if inside else None)
        o.t_verdict = time.monotonic()
        timeline.stamp("edge: verdict encoded", o.t_verdict)
        self._send_air(name, frames)  # the device's part of the round goes on while the edge commits
        timeline.stamp("edge: verdict sent")
        if scheduled and not inside:
            self._send(name, M.schedule_of(fields))
        o.dl_bytes = sum(len(f) for f in frames) - (M.next_bytes(fields) if inside else 0)

    def _commit(self, s: Session, r: int, verdict: Verdict, drafts: list[int], draft_len: int) -> None:
        """The verdict's effect on a session: the verifier's cache, the committed tokens, the counters."""
        n, token = verdict.n_accepted, verdict.token
        self.verifier.commit(s.sid, n)
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
        slot = cur.schedule[name]
        self.controller.observe_acceptance(name, o.n_accepted, slot.draft_len, topk=cur.plan.topk)
        self.controller.observe_draft_time(name, o.timings.get("draft_s") or 0.0, slot.draft_len)
        charged = (o.ul_channel or {}).get("bytes")
        if charged:
            self.controller.observe_upload(charged, slot.ul_bits, cur.plan.scenario.header_bits, mode=slot.mode)
        arrived = cur.drafts[name]
        if self.links is not None and not arrived.waited:  # a draft read late says nothing of the link
            # schedule sent -> draft here, minus the device's drafting: the one-way trips (+ the upload)
            seconds = arrived.t_arrival - cur.t0 - (o.timings.get("draft_s") or 0.0)
            o.link = {"ul": self.links.observe(name, "ul", arrived.nbytes, seconds, t=arrived.t_arrival)}
            self.publish_link_rates([name])

    # collect reports
    def _collect_reports(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome]) -> float:
        """The round ends when every device holds its tokens, which only its report tells (tiny, not
        charged); the report also carries the verdict's measured DL air time. Returns the round's end."""
        cur.t_reports_from = time.monotonic()
        if outcomes:
            self.poll(time.monotonic() + self.deadline_s,
                      stop=lambda: all(n in cur.reports or n in cur.reports_given_up for n in outcomes))
        t_end = time.monotonic()
        for name, o in outcomes.items():
            if name not in cur.reports:
                o.report_late = True  # unconfirmed: the record credits none of its tokens
                continue
            self._take_report(cur, name, o)
        return t_end

    def _take_report(self, cur: RoundInFlight, name: str, o: DeviceOutcome) -> float:
        """A device's report into its outcome (correction time, DL annotation, report time) and, on a measured
        link, the DL sample it gives; returns when the report arrived. Both round loops close a device so."""
        t_report, rep = cur.reports[name]
        o.dl_channel, o.correction_s = rep.dl_channel, rep.timings.get("correction_s")
        o.report_s = t_report - o.t_verdict
        if self.links is not None and name not in cur.reports_waited:
            # verdict sent -> report here, minus the device's correction: the one-way trips (+ the verdict)
            entry = self.links.observe(name, "dl", o.dl_bytes, o.report_s - (o.correction_s or 0.0), t=t_report)
            o.link = {**(o.link or {}), "dl": entry}
            self.publish_link_rates([name])
        return t_report

    # close and record
    def _close_round(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome], verify_s: float | None,
                     t_end: float) -> dict:
        """Fit the round overhead (full rounds only), build the record and write it (a crash or Ctrl-C after
        this keeps the round), and finish the sessions that have all their tokens."""
        rp, round_s = cur.plan, t_end - cur.t0
        virtual = self._virtual_round(cur, outcomes, t_end) if self.channel_mode == "virtual" else None
        rec = round_record(rp, policy=self.policy, outcomes=outcomes, verify_s=verify_s, round_s=round_s,
                           t_start_s=cur.t0 - self.t_origin, virtual=virtual,
                           extra={"channel_mode": self.channel_mode, "plan_s": cur.plan_s,
                                  "scheduled_ahead": cur.ahead,
                                  "edge_phases_s": edge_phases(cur, verify_s, t_end, self._last_round_end),
                                  **({"link_probes": self.prober.take_log()} if self.prober is not None else {}),
                                  "joined": sorted(set(self.sessions) - set(cur.schedule) - set(rp.sat_out))})
        # T_0 is fitted on full rounds, in the record's time base (with a virtual channel, the virtual round time).
        full = bool(outcomes) and len(outcomes) == len(cur.schedule)
        self.keep_record(rec, fit_round=(rp.plan["round_time_s"], rp.scenario.round_overhead_s) if full else None)
        self._last_round_end = t_end
        cur.drafts = {}  # the round's q rows are no longer needed; late drafts are refused by `closed`
        for name in outcomes:
            self.finish_if_done(name)
        return rec

    def keep_record(self, rec: dict, fit_round: tuple[float, float] | None) -> None:
        """A closed round's (or cycle's) record: fit the round overhead T_0 on it if `fit_round` (predicted
        round time, prior T_0), feed the energy and outcome estimates, write it (a crash or Ctrl-C after this
        keeps it), count it. Both round loops keep their records so."""
        if fit_round is not None:
            measured, predicted = rec["measured"].get("verify_s"), rec["predicted"].get("verify_s")
            verify_error = measured - predicted if None not in (measured, predicted) else 0.0
            self.controller.observe_round(rec["measured"]["round_s"], *fit_round, verify_error_s=verify_error)
        self.controller.observe_energy(rec)  # measured UL air times: the energy budgets' margins
        self.controller.observe_outcome(rec)  # what the policy sees of this round next time
        if self.before_record is not None:
            self.before_record(rec)
        if self.recorder is not None:
            self.recorder.append_round(rec)
        self.rounds_done += 1
        self.last_record = rec

    def finish_if_done(self, name: str) -> None:
        """A session that has its max_new_tokens drafts no more: free its KV cache now (its outputs are
        kept) and tell the device."""
        s = self.sessions.get(name)
        if s is not None and self._has_all_tokens(s) and not s.done:
            s.done = True
            self.verifier.close(s.sid)
            self._send(name, M.done(f"generated {len(s.output_ids)} tokens"))

    def _virtual_round(self, cur: RoundInFlight, outcomes: dict[str, DeviceOutcome], t_end: float) -> dict:
        """The round on the virtual clock (`controller.virtual_round`) from this round's edge-clock stamps.
        A message that had to wait while the edge was busy is placed at its lower bound (the device's drafting
        time; the verdict plus the device's correction) plus the transport measured on messages that did not
        wait; those feed the transport estimate (`_arrival`)."""
        t0 = cur.t0
        drafts, reports = {}, {}
        least: dict[tuple, float] = {}  # this round's least transport of hosted devices, per kind
        for name, o in outcomes.items():
            arrived, mode = cur.drafts.get(name), cur.schedule[name].mode
            if arrived is None:
                continue
            low = o.timings.get("draft_s") or 0.0
            drafts[name] = self._arrival(("draft", mode), arrived.t_arrival - t0, arrived.waited, low,
                                         air_time(o.ul_channel) or 0.0, o.timings.get("host_wait_s"),
                                         arrived.handled_s, least)
            if name in cur.reports:
                t_report, rep = cur.reports[name]
                low = o.t_verdict - t0 + (o.correction_s or 0.0)
                reports[name] = self._arrival(("report", mode), t_report - t0, name in cur.reports_waited, low,
                                              air_time(o.dl_channel) or 0.0, rep.timings.get("host_wait_s"),
                                              least=least)
        self._remember_least(least)
        return virtual_round(drafts, reports, drafts_from_s=cur.t_drafts_from - t0 - cur.plan_descheduled_s,
                             drafts_closed_s=cur.t_drafts_closed - t0,
                             reports_from_s=None if cur.t_reports_from is None
                             else cur.t_reports_from - t0 - cur.reply_descheduled_s,
                             end_s=t_end - t0, all_drafts=len(drafts) == len(cur.schedule),
                             all_reports=bool(outcomes) and len(reports) == len(outcomes))

    def _remember_least(self, least: dict[tuple, float]) -> None:
        """A round's least transport of hosted devices per kind, kept for the next 20 rounds (`_arrival`)."""
        for kind, t in least.items():
            self._hosted_least.setdefault(kind, deque(maxlen=20)).append(t)

    def _arrival(self, kind: tuple[str, str], at_s: float, waited: bool, low_s: float, air_s: float,
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

    # -- the whole run ---------------------------------------------------------------------------
    def run(self, rounds: int, on_round=None, join_wait_s: float = 0.0, keep_records: bool = True,
            start_round: int = 0) -> list[dict] | None:
        """Run rounds `start_round`..`rounds`-1 (fewer if every session finishes; a resumed run numbers on:
        round indices seed every random draw). Each round's record is written by the recorder as the round
        ends and passed to `on_round`; `run` returns them all only with `keep_records` (the default, for
        callers that summarize the list; a long run should pass False and read rounds.jsonl back, see
        `testbed.runtime.records.load_run`), else None. `rounds_done` and `last_record` tell how far it got."""
        if self.scenario.rounds == "asynchronous":  # each device cycles on its own: `rounds` cycles each
            from edge_node.async_rounds import run_asynchronous

            return run_asynchronous(self, rounds, on_round=on_round, keep_records=keep_records,
                                    start_round=start_round)
        records: list[dict] | None = [] if keep_records else None
        self._rounds_end = rounds
        for r in range(start_round, rounds):
            self.round_index = r
            # Serve registrations that arrived between rounds (joins and rejoins); check the emulator.
            self.poll(time.monotonic() + join_wait_s)
            self.probe_links()
            rec = self.run_round(r)
            if rec is None:
                if not any(not s.done for s in self.sessions.values()):
                    break
                # Everyone is waiting on a late report: give them time instead of burning rounds.
                self.poll(time.monotonic() + self.deadline_s,
                          stop=lambda: bool(self._active_names()))
                continue
            if records is not None:
                records.append(rec)
            if on_round is not None:
                on_round(rec)
        return records

    def finish(self, reason: str = "run complete") -> dict:
        """Tell every device the run is over; return the sessions' outputs (token ids)."""
        out = {}
        for name in list(self.sessions):
            s = self.sessions[name]
            if not s.done:
                try:
                    self._send(name, M.done(reason))
                except zmq.ZMQError:
                    pass
            out[name] = s
        for name, s in self._finished.items():
            out.setdefault(name, s)
        return out

    def close(self) -> None:
        self.sock.close(linger=200)


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


def _finite_values(timings: dict) -> dict:
    """A device's timings with non-finite values left out (the wire layer refuses them; this keeps the
    controller and the record safe should a message reach here some other way)."""
    return {k: v for k, v in timings.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def draft_header_bits(scenario, bits_per_prob: int, on_air_vocab: int | None) -> float:
    """The header bits H of a typical DL-mode draft upload as this wire encodes it: its bytes (as the emulator
    counts them) minus the payload bits the model counts. The controller's prior for H (`seed_header_bits`);
    DL mode because there the header is most of the upload, at the longest draft because DL mode is chosen
    with long drafts (each token adds 12 bytes on the wire, b_id + b_p bits in the model)."""
    L = max(1, scenario.max_draft_len)
    q = np.full((L, 2), 0.5)
    timings = {"draft_s": 0.012345678901234567, "compute_s": 0.012345678901234567,
               "emulated_extra_s": 0.012345678901234567, "compute_scale": 1.5}
    frames = M.draft(100, "DL", np.zeros(L, np.int32), q, last_token=100, bits_per_prob=bits_per_prob,
                     on_air_vocab=on_air_vocab, timings=timings)
    counted = float(ul_first_bits(scenario.model_copy(update={"header_bits": 0.0}), False, L))
    return 8.0 * sum(len(f) for f in frames) - counted
