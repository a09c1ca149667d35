"""A device node: drafts with an ONNX SLM, uploads drafts, corrects in DL mode, reports its timings.

numpy, onnxruntime, pyzmq and pyyaml only: this module must never import torch (directly or through
`testbed`'s heavier modules); `tests/test_live_*.py` checks it in a real device process.

Run: ``python -m device_node.node --connect tcp://HOST:PORT --name dev0 --draft draft.onnx [--hardware phone]``
(or ``multispin device ...``). The edge sends the prompt ids, the seed and the sampling parameters at
registration; the device has no tokenizer. The process exits with an `ExitCode` (device_node.options).

Robustness (a LAN is shared, edges restart):
- every received message is handled under a guard, decoding included: a bad one costs one log line and is
  dropped; the device keeps serving;
- registration is resent with backoff until ``register_timeout_s``, each time on a fresh socket (the "Lazy
  Pirate" pattern: a DEALER whose peer vanished keeps queueing, a new one starts clean);
- when the edge announces heartbeats (``registered.heartbeat_s``), the device sends a `heartbeat` whenever
  it sent nothing for that period, and leaves with `ExitCode.EDGE_GONE` when the edge was silent for
  ``liveness`` periods; with ``reconnect`` it reopens the socket and registers again until the edge returns.
  Heartbeats do not depend on compute: while the device drafts (the emulated slowdown included) or waits for
  its turn on a shared host, it lends its socket to a heartbeat thread (`testbed.runtime.heartbeat.HeartbeatThread`)
  that sends them when due; what the edge sends meanwhile waits in the socket and is read right after.
  A device that was itself away (stopped, a suspended laptop: its loop ran late) first reads what its socket
  holds, waiting up to one period for it, before it judges the edge: the edge's messages may be waiting;
- an edge that ended this device's session (it was silent past the window) refuses its messages as "not
  registered": the device registers again under its name and goes on from the next round;
- with client keys (``--keys``, `testbed.runtime.security`) the socket is a CURVE client of the edge (or emulator);
  a registration that gets no answer because the handshake failed (no keys against an edge that requires them,
  a refused key) says why (`testbed.runtime.handshake_watch`);
- when the edge announces it (``registered.clock``), the device measures its clock's offset to the edge's right
  after registering (`device_node.clock_sync`), for the edge's records.

Several devices in one process (`device_node.host`, a profile's ``devices_per_process``): each is a
`DeviceNode` in its own thread, and they handle their messages one at a time (`device_node.gate`), so that
each device's `draft_s` is its own compute (plus its emulated slowdown), not its wait for the others.

Link probe (``--link-probe SPEC``, `device_node.link_probe`): a background thread measures the radio link;
every report (and every heartbeat of an idle device) carries the latest reading with its age on this
device's clock (`link_reading`), never the clock itself: the edge dates it on its own clock.

Rate probes (an edge with ``channel.measure_links``): a `probe` is echoed at once with the padding it asks
for (at most `M.MAX_PROBE_BYTES`; a larger request is refused and logged), so that the edge can time the
link both ways on its own clock (`edge_node.probing`).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from contextlib import ExitStack

import numpy as np
import zmq

from device_node import next_run
from device_node.clock_sync import ClockExchanges
from device_node.drafting import Draft, Drafter
from device_node.gate import OPEN, Gate
from device_node.hardware import HardwareProfile, load_hardware
from device_node.link_probe import BackgroundProbe, LinkMeasurement, NoneProbe, make_probe
from device_node.options import EPILOG, ExitCode, add_arguments
from testbed.core.sampling import DraftParams, RoundRandomness, SamplingParams, sample_correction
from testbed.core.vocabulary import DL, UPLINK
from testbed.runtime import timeline
from testbed.runtime.handshake_watch import KEYS_HINT, ClientHandshakeWatch
from testbed.runtime.heartbeat import Heartbeat, HeartbeatThread, PeerTimes
from testbed.runtime.security import ClientKeys, SecurityError, is_loopback, make_client
from testbed.runtime.waiting import Rehearsal, wait_readable
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

log = logging.getLogger("multispin.device")

# Before registering, a device times its drafter (`time_drafting`): one warm-up draft, then this many tokens.
CALIBRATE_TOKENS = 8
CALIBRATE_DRAFTS = 2  # timed drafts (the median), each after CALIBRATE_PAUSE_S idle, as a round's follows a wait
CALIBRATE_PAUSE_S = 0.03
REGISTER_RETRY_S = 1.0       # first resend of `register` after this long without an answer ...
REGISTER_RETRY_MAX_S = 8.0   # ... doubling up to this (an edge that returns is found within ~8 s)


class _EdgeLost(Exception):
    """Internal: the edge was silent for its liveness window."""


class _SessionEnded(Exception):
    """Internal: the edge says this device has no session there (it ended it: silent past the liveness window,
    e.g. while this process was stopped); the device registers again under its name."""


# An edge's refusal that means "this device has no session here" (`edge_node.inbox`), or that its session belongs
# to another connection of its key: either way, registering again is the way back in.
SESSION_ENDED_REFUSALS = ("which is not registered", "is in use by another connection")


class DeviceNode:
    """One device: registers with the edge, then drafts, uploads and corrects round by round."""

    def __init__(self, connect: str, name: str, drafter: Drafter, hardware: HardwareProfile | None = None, *,
                 register_timeout_s: float = 120.0, idle_timeout_s: float = 300.0, tx_marker: bool = True,
                 keys: ClientKeys | None = None, reconnect: bool = False,
                 register_retry_s: float = REGISTER_RETRY_S, register_retry_max_s: float = REGISTER_RETRY_MAX_S,
                 link_probe: BackgroundProbe | None = None, gate: Gate | None = None, busy_poll: bool = False,
                 calibrate_tokens: int = CALIBRATE_TOKENS, serve_runs: bool = False):
        self.connect, self.name, self.drafter = connect, name, drafter
        # After a bye, wait for the next run instead of exiting (`device_node.next_run`, a warm pool's devices).
        self.serve_runs = serve_runs
        self._run_generation = next_run.generation()  # the next-run signals seen when the session started
        # Drafting time per token, timed once before the first registration (0 tokens: not timed, not sent).
        self.calibrate_tokens = int(calibrate_tokens)
        self.draft_time_s: float | None = None
        # Several devices in one process (`device_node.host`) handle their messages one at a time.
        self.gate = gate or OPEN
        self.busy_poll = busy_poll  # `testbed.runtime.waiting`: a core for no kernel wake-up per message
        self.link_probe = link_probe
        self.hardware = hardware or HardwareProfile()
        self.register_timeout_s, self.idle_timeout_s = register_timeout_s, idle_timeout_s
        self.tx_marker_wanted = self.tx_marker = tx_marker
        self.keys, self.reconnect = keys, reconnect
        self.register_retry_s, self.register_retry_max_s = register_retry_s, register_retry_max_s
        self.ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.handshake: ClientHandshakeWatch | None = None  # why the edge did not answer, if its handshake failed
        self.clock: ClockExchanges | None = None  # this session's clock exchanges with the edge
        self._open()
        self.rounds_done = 0
        self.session: str | None = None
        self.pending: tuple[M.Schedule, Draft] | None = None  # the round in flight
        self._ahead: tuple | None = None  # (session, round, its drafting generator) made ahead (`_draft_generator`)
        # Liveness: None until the edge announces heartbeats in `registered` (an older edge sends none;
        # then only the idle timeout applies).
        self.heartbeat_s: float | None = None
        self.liveness = M.DEFAULT_LIVENESS
        self.peer = PeerTimes()  # when this device last sent to the edge and last heard from it
        self.dropped_messages = 0  # received messages refused (malformed, out of place)
        self._session_ended: str | None = None  # the edge's refusal saying this device has no session there
        self._probe_pad = None     # a rate probe's echo padding (uint8 zeros), grown to the largest asked for
        # A shared host's wait for the message in hand: received -> its handling began (`_serve`).
        self._gate_wait_s = 0.0
        self._t_recv = 0.0  # when the message in hand was received (monotonic; `testbed.runtime.timeline`)
        self._frames_in: list = []  # the message in hand (a verdict's are kept for `rehearsal`)
        self.rehearsal = Rehearsal(busy_poll)  # the last verdict's decode and checks, rerun while busy-polling
        # Sends the heartbeats due while this device drafts or waits for its turn on a shared host (`lent`).
        self.beats = HeartbeatThread(self._beat_while_lent, M.DEFAULT_HEARTBEAT_S / 4, name=f"{name}-heartbeats")

    # -- transport ------------------------------------------------------------------------------
    def _open(self) -> None:
        """(Re)open the DEALER: a fresh socket drops whatever the old one still queued."""
        if self.sock is not None:
            self.handshake.close()
            self.sock.close(linger=0)
        sock = self.ctx.socket(zmq.DEALER)
        if self.keys is None:  # with keys the edge and the emulator name a device after its key, not its routing id
            sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        sock.setsockopt(zmq.LINGER, 1000)
        make_client(sock, self.keys)
        self.handshake = ClientHandshakeWatch(sock, has_keys=self.keys is not None)
        sock.connect(self.connect)
        self.sock = sock

    def _send(self, frames: list, *, copy: bool = True, flags: int = 0) -> None:
        self.sock.send_multipart(frames, flags=flags, copy=copy)
        self.peer.sent()

    def _send_air(self, frames: list, air: str) -> None:
        # A tiny marker first: the channel emulator starts the air time when the marker arrives, so the
        # real transfer time of the large payload is absorbed instead of added (no clocks are compared).
        if self.tx_marker:
            self.sock.send(P.tx_start_marker(air))
        self._send(frames, copy=False)

    def _heartbeat(self) -> None:
        link = self._link()
        frames = M.heartbeat() if link is None else P.encode({"type": P.HEARTBEAT, "link": link})
        try:  # never block on a dead peer's full queue: a lost heartbeat is what liveness is for
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            self.peer.sent()
        except zmq.Again:
            pass

    def _beat_while_lent(self) -> None:
        """The heartbeat thread's work while this device computes: a heartbeat when one is due."""
        if self.heartbeat_s is not None and self.sock is not None \
                and Heartbeat(self.heartbeat_s, self.liveness).due(self.peer, time.monotonic()):
            self._heartbeat()

    def _recv(self, timeout_s: float) -> tuple[dict, dict] | None:
        """The next message, decoded; None on timeout or when the message was refused (logged)."""
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self.sock.recv_multipart(copy=False)
        try:
            return P.decode(frames)
        except ProtocolError as exc:  # P.decode raises nothing else, whatever the bytes
            self._drop("malformed", exc)
            return None

    def _drop(self, kind: str, exc: BaseException) -> None:
        self.dropped_messages += 1
        log.warning("%s: dropped a %s message: %s", self.name, kind, exc)

    # -- life cycle -----------------------------------------------------------------------------
    def run(self) -> ExitCode:
        """Register, then serve schedules until the edge says bye. Returns the process exit code."""
        self.draft_time_s = self._calibrate()
        deadline = time.monotonic() + self.register_timeout_s
        while True:
            code = self._register(deadline)
            if code is not None:
                if not self._next_run(code):
                    return code
                deadline = None
                continue
            try:
                code = self._serve()
                if not self._next_run(code):
                    return code
                deadline = None  # the next run's edge is bound (`device_node.next_run`)
                continue
            except _SessionEnded as exc:
                log.warning("%s: the edge ended this device's session (%s); registering again", self.name, exc)
                self._end_session()
                deadline = None if self.reconnect else time.monotonic() + self.register_timeout_s
                continue
            except _EdgeLost:
                silent = time.monotonic() - self.peer.last_heard
                if not self.reconnect:
                    log.error("%s: the edge at %s was silent for %.1f s (%d heartbeats of %.2f s); leaving "
                              "(exit %d; --reconnect waits for it instead)", self.name, self.connect, silent,
                              self.liveness, self.heartbeat_s, ExitCode.EDGE_GONE)
                    return ExitCode.EDGE_GONE
                log.warning("%s: the edge at %s was silent for %.1f s; reconnecting and registering again",
                            self.name, self.connect, silent)
                self._end_session()
                self._open()
                deadline = None  # --reconnect: until the edge returns

    def _next_run(self, code: ExitCode) -> bool:
        """With `serve_runs`, after the edge's bye: wait for the next run (`device_node.next_run`), then register
        again on a fresh socket; False (the process ends with `code`) otherwise."""
        if not self.serve_runs or code != ExitCode.OK:
            return False
        self._end_session()
        log.info("%s: waiting for the next run", self.name)
        next_run.wait_beyond(self._run_generation)
        # The same connection (a new one under the same name could be refused while the old one is being torn
        # down): only what the last run left in it is dropped.
        while self.sock.poll(0):
            self.sock.recv_multipart()
        return True

    def close(self) -> None:
        self.beats.close()
        self.handshake.close()
        self.sock.close(linger=0)

    def _register(self, deadline: float | None) -> ExitCode | None:
        """Send `register` until a `registered` comes (None: session started) or the deadline passes.

        Each resend goes out on a fresh socket after a growing wait. An `error` refuses the registration only
        when it is about the register itself (the edge names the field, ``register.*``) or fatal: an error
        answering a message of an earlier connection must not end a reconnecting device."""
        retry, first, told = self.register_retry_s, True, None
        while True:
            if not first:
                self._open()
            first = False
            try:  # never blocks: a socket whose handshake failed has no peer (libzmq gives up on it), and a
                # DEALER without one would block this send for good; the next try opens a fresh socket
                self._send(M.register(self.name, self.drafter.vocab_size, self.hardware.to_dict(),
                                      features=(M.SCHEDULE_IN_VERDICT, M.CLOCK_OFFSET),
                                      draft_time_s=self.draft_time_s), flags=zmq.NOBLOCK)
            except zmq.Again:
                log.debug("%s: register not sent (no connection to the edge)", self.name)
            until = time.monotonic() + retry
            if deadline is not None:
                until = min(until, deadline)
            while (left := until - time.monotonic()) > 0:
                msg = self._recv(left)
                if msg is None:
                    continue
                header, arrays = msg
                kind = header["type"]
                if kind == P.REGISTERED:
                    try:
                        self._start_session(header, arrays)
                        return None
                    except ProtocolError as exc:
                        self._drop("registered", exc)
                elif kind == P.ERROR:
                    try:
                        err = M.parse_error(header)
                    except ProtocolError as exc:
                        self._drop("error", exc)
                        continue
                    if err.fatal or err.message.startswith("register"):
                        log.error("%s: registration refused: %s", self.name, err.message)
                        return ExitCode.REFUSED
                    log.warning("%s: edge reports (while registering): %s", self.name, err.message)
                elif kind == P.BYE:
                    log.info("%s: the edge ended the run before this device registered", self.name)
                    return ExitCode.OK
                else:
                    log.debug("%s: ignoring a %r message while registering", self.name, kind)
            why = self.handshake.poll() or told  # the handshake failed: say why the edge does not answer
            if deadline is not None and time.monotonic() >= deadline:
                why = why or self._unanswered_hint()
                log.error("%s: no answer from the edge at %s within %.0f s%s", self.name, self.connect,
                          self.register_timeout_s, f": {why}" if why else "")
                return ExitCode.NO_EDGE
            if why and why != told:
                log.error("%s: the edge at %s does not answer: %s", self.name, self.connect, why)
                told = why
            log.info("%s: no answer from the edge at %s yet; registering again", self.name, self.connect)
            retry = min(2 * retry, self.register_retry_max_s)

    def _unanswered_hint(self) -> str | None:
        """No handshake failure seen, no keys, an edge beyond the loopback: an edge that requires keys may look
        like a silent one (a handshake the edge never answered)."""
        if self.keys is None and not is_loopback(self.connect):
            return "is the edge up at this address? (if it requires CURVE keys: " + KEYS_HINT + ")"
        return None

    def _calibrate(self) -> float | None:
        """This device's drafting time per token as the rounds will measure it (`time_drafting`, on a shared host
        inside the gate, its CPU time), times its hardware's `compute_scale` (the emulated slowdown, not slept
        here); None when not asked for, or when the drafter fails (the edge then plans on its prior)."""
        if self.calibrate_tokens < 1:
            return None
        hosted = self.gate is not OPEN
        try:
            with self.gate:
                t0 = time.perf_counter()
                per_token = time_drafting(self.drafter, self.calibrate_tokens, hosted=hosted)
                took = time.perf_counter() - t0
        except Exception as exc:  # the rounds will tell the same drafter's trouble; registering matters more
            log.warning("%s: could not time the drafter (%s: %s); the edge plans on its prior", self.name,
                        type(exc).__name__, exc)
            return None
        value = per_token * self.hardware.compute_scale
        lo, hi = M.DRAFT_TIME_RANGE_S
        if not lo <= value <= hi:
            log.warning("%s: drafting timed at %.3g s/token, outside [%g, %g]: not sent", self.name, value, lo, hi)
            return None
        log.info("%s: drafting timed at %.3f ms/token (x compute_scale %g) in %.2f s", self.name, 1e3 * value,
                 self.hardware.compute_scale, took)
        return value

    def _serve(self) -> ExitCode:
        """Serve the session until bye or a fatal error; raises _EdgeLost when the edge goes silent, _SessionEnded
        when the edge says this device has no session there."""
        self._session_ended = None
        last_top, asked = time.monotonic(), 0.0
        away = False  # this process ran late since it last heard the edge (stopped, suspended, a long draft)
        while True:
            now = time.monotonic()
            beat = None if self.heartbeat_s is None else Heartbeat(self.heartbeat_s, self.liveness)
            if beat is not None and now - last_top > asked + beat.period_s:
                away = True
            if beat is None:
                wait = self.idle_timeout_s - (now - self.peer.last_heard)
            else:
                if beat.due(self.peer, now):
                    self._heartbeat()
                    now = time.monotonic()
                wait = beat.wait_s(self.peer, now)
            last_top, asked = now, max(0.0, wait)
            # Poll even when the window is over: after a pause (SIGSTOP, a slow draft) messages may be
            # waiting, and they prove the edge alive.
            if wait_readable(self.sock, wait, busy=self.busy_poll, rehearse=self.rehearsal.run):
                away = False
                frames = self.sock.recv_multipart(copy=False)
                self._t_recv = time.monotonic()
                t_recv = time.perf_counter()
                with ExitStack() as gate:
                    if self.gate is not OPEN:
                        with self.beats.lent():  # the other devices of the process may hold it for long
                            gate.enter_context(self.gate)
                    self._gate_wait_s = time.perf_counter() - t_recv  # the other devices' work, not ours
                    code = self._handle(frames)
                if code is not None:
                    return code
                if self._session_ended is not None:
                    raise _SessionEnded(self._session_ended)
                continue
            if beat is not None and time.monotonic() - last_top > asked + beat.period_s:
                away = True  # the wait itself overran: this process was stopped while it waited
            silent = time.monotonic() - self.peer.last_heard
            if beat is None:
                if silent >= self.idle_timeout_s:
                    log.error("%s: no message from the edge for %.0f s; leaving", self.name, silent)
                    return ExitCode.EDGE_SILENT
            elif beat.expired(self.peer, time.monotonic()):
                if away:
                    # This process was away, and so was ZeroMQ's I/O thread: the edge's messages may still be on
                    # their way into the socket. One period for them before the edge is judged.
                    away = False
                    log.info("%s: this device was away (the edge silent for %.1f s meanwhile); reading what "
                             "the edge sent before judging it", self.name, silent)
                    last_top, asked = time.monotonic(), beat.period_s
                    if wait_readable(self.sock, beat.period_s, busy=self.busy_poll):
                        continue
                raise _EdgeLost()

    def _handle(self, frames: list) -> ExitCode | None:
        """One received message, under a guard: whatever it holds, the device keeps serving. Returns an exit
        code when the session ends."""
        kind = "malformed"
        self._frames_in = frames
        try:
            header, arrays = P.decode(frames)
            kind = header["type"]
            timeline.stamp(f"device: {kind} in", self._t_recv)
            timeline.stamp(f"device: {kind} decoded")
            if kind != P.ERROR:  # an error reply is no proof of a live session (a restarted edge sends them)
                self.peer.heard()
            if kind == P.SCHEDULE:
                self._on_schedule(header)
            elif kind == P.VERDICT:
                self._on_verdict(header, arrays)
                nxt = M.schedule_in(header)  # the next round's schedule, sent with this verdict
                if nxt is not None:
                    kind = "verdict.next"
                    self._on_schedule(nxt)
            elif kind == P.PROBE:
                self._on_probe(header, arrays)
            elif kind == P.CLOCK:
                self._on_clock(header)
            elif kind == P.HEARTBEAT or kind == P.TX_START:
                pass
            elif kind == P.BYE:
                rehearsed = f" (rehearsed a verdict's checks {self.rehearsal.count} times while waiting)"
                log.info("%s: done (%s) after %d rounds%s", self.name, M.parse_bye(header), self.rounds_done,
                         rehearsed if self.rehearsal.enabled else "")
                return ExitCode.OK
            elif kind == P.ERROR:
                err = M.parse_error(header)
                log.warning("%s: edge reports: %s", self.name, err.message)
                if err.fatal:
                    return ExitCode.EDGE_FATAL
                if self.session is not None and any(m in err.message for m in SESSION_ENDED_REFUSALS):
                    self._session_ended = P.show(err.message, 200)  # `_serve` registers again
            elif kind == P.REGISTERED:
                # The edge opened a new session (an answer to a resent register, or the edge restarted it).
                self._start_session(header, arrays)
            else:
                raise ProtocolError(f"type: {P.show(kind)} is not expected by a device")
        except ProtocolError as exc:
            self._drop(kind, exc)
        except Exception as exc:  # a bug or a drafter failure must cost one round, not the device
            self.dropped_messages += 1
            log.error("%s: dropped a %s message after an internal error (%s: %s); drafts of the round in "
                      "flight discarded", self.name, kind, type(exc).__name__, exc)
            self._abandon_round()
        return None

    def _start_session(self, header: dict, arrays: dict) -> None:
        reg = M.parse_registered(header, arrays, vocab_size=self.drafter.vocab_size)
        self._run_generation = next_run.generation()
        self.session = reg.session
        self.seed = reg.seed
        self.params = SamplingParams(**reg.sampling)
        self.bits = reg.bits_per_prob
        self.on_air = reg.on_air_vocab_size
        self.max_draft_len = reg.max_draft_len
        self.tx_marker = self.tx_marker_wanted and reg.tx_marker
        # Heartbeats only with an edge that announces them: an older edge would refuse them, and sends none.
        self.heartbeat_s = reg.heartbeat_s if "heartbeat_s" in header else None
        self.liveness = reg.liveness
        if self.heartbeat_s is not None:
            self.beats.tick_s = self.heartbeat_s / 4
        self.committed = list(reg.prompt_ids)  # prompt + every output token, in order
        self.drafter.reset(self.committed)
        self._prefill()
        self.pending = None
        self.peer.heard()
        log.info("%s: session %s, prompt of %d tokens%s", self.name, self.session, len(self.committed),
                 "" if self.heartbeat_s is None else
                 f", heartbeat {self.heartbeat_s:g} s, liveness {self.liveness}")
        if reg.clock:  # the edge answers clock exchanges: measure the offset between the two clocks
            self.clock = ClockExchanges(self.name)
            self._send(self.clock.start())

    def _on_clock(self, header: dict) -> None:
        """A clock exchange's reply: the next request, or the result for the edge's records."""
        if self.clock is None:
            raise ProtocolError("clock: no exchange in flight")
        t3 = self.clock.wall() - (time.monotonic() - self._t_recv)  # when it was received, on the wall clock
        out = self.clock.on_reply(header, t3)
        if out is not None:
            self._send(out)

    def _prefill(self) -> None:
        """The prompt into the drafter's cache before round 0's schedule (a drafter that can: `prefill`), so
        that round 0's drafting time is a round's, as the device's calibration timed it."""
        prefill = getattr(self.drafter, "prefill", None)
        if prefill is None:
            return
        try:
            prefill()
        except Exception as exc:  # round 0 then prefills as it drafts
            log.warning("%s: prefill failed (%s: %s)", self.name, type(exc).__name__, exc)
            self.drafter.reset(self.committed)

    def _end_session(self) -> None:
        self.session, self.pending, self.heartbeat_s = None, None, None

    def _abandon_round(self) -> None:
        """Forget the round in flight: the drafter goes back to the committed context (the edge drops the
        round for this device when its draft or report does not come)."""
        self.pending = None
        if self.session is not None:
            self.drafter.reset(self.committed)

    # -- one round ------------------------------------------------------------------------------
    def _on_schedule(self, header: dict) -> None:
        if self.session is None:
            raise ProtocolError("schedule before registered")
        sched = M.parse_schedule(header, self.max_draft_len, self.drafter.vocab_size)
        if self.pending is not None:
            # The edge moved on without our verdict (a lost message, an edge restart): drafting again on top
            # of unverified drafts would desynchronise the drafter. Refuse this round, drop the old one; the
            # edge sees neither a draft nor a report and drops them too.
            held = self.pending[0].round
            self._abandon_round()
            self.dropped_messages += 1
            why = (f"refused the schedule of round {sched.round}: the draft of round {held} is unverified; round "
                   f"{held} dropped")
            log.error("%s: %s", self.name, why)
            # Said to the edge at once: its round need not wait the deadline for a draft that will not come.
            self._send(M.error(why, round_index=sched.round))
            return
        generator = self._draft_generator(sched.round)
        hosted = self.gate is not OPEN
        timeline.stamp("device: drafting starts")
        t0, cpu0 = time.perf_counter(), time.thread_time()
        # Sampled through the wire precision: draft.q is exactly what the edge rebuilds from the upload. A top-k
        # round drafts from q truncated to its top k (DraftParams), the q a top-k upload carries.
        params = DraftParams.of(self.params, sched.topk)
        with self.beats.lent():  # drafting may outlast the liveness window: heartbeats go on
            draft = self.drafter.draft(sched.draft_len, params, generator, wire_bits=self.bits)
        compute_s = time.perf_counter() - t0
        timeline.stamp("device: drafted")
        if hosted:
            # A shared host runs more busy threads than it has cores: the wall clock also counts the time the
            # system ran the others. The thread's CPU time is this device's own compute (onnxruntime with one
            # thread runs in the caller's, so on an idle core the two agree).
            compute_s = min(compute_s, time.thread_time() - cpu0)
        # Emulated slower hardware: sleep the extra (scale - 1) x the measured compute (with the gate open:
        # other devices of the process work meanwhile; the wait to get it back is theirs, not ours).
        extra_s = (self.hardware.compute_scale - 1.0) * compute_s
        with self.beats.lent():
            regate_s = self.gate.sleep(extra_s) if extra_s > 0 else 0.0
        # hosted: a late wake-up from that sleep is the busy host's too
        draft_s = compute_s + extra_s if hosted else time.perf_counter() - t0 - regate_s
        self.pending = (sched, draft)  # q float64: never rounded again
        timings = {"draft_s": draft_s, "compute_s": compute_s, "emulated_extra_s": extra_s,
                   "compute_scale": self.hardware.compute_scale}
        if hosted:  # a shared host: its waits are no device's time (the virtual clock drops them)
            timings["host_wait_s"] = self._gate_wait_s + regate_s
        frames = M.draft(sched.round, sched.mode, draft.tokens, draft.q, q_wire=draft.wire,
                         last_token=self.committed[-1], bits_per_prob=self.bits, on_air_vocab=self.on_air,
                         timings=timings, topk=sched.topk)
        timeline.stamp("device: draft encoded")
        self._send_air(frames, UPLINK)
        timeline.stamp("device: draft sent")
        # While the edge verifies: the next round's drafting generator (seeding one is not free, and would
        # otherwise come between the verdict and the next draft).
        self._ahead = (self.session, sched.round + 1,
                       RoundRandomness(self.seed, self.name, sched.round + 1).draft_generator())

    def _on_verdict(self, header: dict, arrays: dict) -> None:
        if header.get("dropped") is True and (self.pending is None or header.get("round") != self.pending[0].round):
            # The edge dropped a round this device holds no draft of (it refused that round's schedule, or
            # already dropped the round itself): nothing to undo.
            log.info("%s: round %s dropped by the edge (no draft of it here)", self.name, P.show(header.get("round")))
            return
        if self.pending is None or header.get("round") != self.pending[0].round:
            raise ProtocolError(f"verdict.round: {P.show(header.get('round'))} does not match the round in flight "
                                f"{None if self.pending is None else self.pending[0].round}")
        sched, draft = self.pending
        checks = dict(draft_len=sched.draft_len, vocab_size=self.drafter.vocab_size, bits_per_prob=self.bits,
                      on_air_vocab=self.on_air)
        try:
            v = M.parse_verdict(header, arrays, **checks)
            # (A dropped verdict carries neither token nor p: it is no verdict to check against the mode.)
            if not v.dropped and v.token is None and (sched.mode != DL or v.n_accepted >= sched.draft_len):
                raise ProtocolError(f"verdict: a distribution p for n_accepted={v.n_accepted} in mode {sched.mode}")
        except ProtocolError as exc:
            # Our round's verdict is unusable: drop the round here too (the edge sees no report).
            self._abandon_round()
            raise ProtocolError(f"{exc}; round {sched.round} dropped") from None
        self.pending = None
        self.rehearsal.set(self._rehearse_verdict, self._frames_in, checks)
        if v.dropped:
            # The edge dropped this round (deadline missed): forget the drafts, redraft next round.
            log.info("%s: round %d dropped by the edge: %s", self.name, v.round, v.reason)
            self.drafter.reset(self.committed)
            return
        t0 = time.perf_counter()
        if v.token is not None:
            token = v.token  # UL-mode correction/bonus, or the DL-mode bonus, sampled at the edge
        else:
            # DL mode, rejection at j = n_accepted: correct here with our own q_j (the exact row the draft
            # was sampled from, the one the edge would rebuild in UL mode), the p_j the edge verified with
            # (exact_from_wire of the downloaded row) and the round's final draw.
            rr = RoundRandomness(self.seed, self.name, sched.round)
            token = sample_correction(v.p_row, draft.q[v.n_accepted], rr.final_uniform())
        correction_s = time.perf_counter() - t0
        timings = {"correction_s": correction_s}
        if self.gate is not OPEN:
            timings["host_wait_s"] = self._gate_wait_s
        # The report first: the edge's round ends with it. (The token is a valid id: the commit cannot fail.)
        timeline.stamp("device: verdict checked")
        self._send(M.report(sched.round, token, v.n_accepted, timings, v.channel, link=self._link()))
        timeline.stamp("device: report sent")
        self.drafter.commit(v.n_accepted, token)
        self.committed.extend(draft.tokens[: v.n_accepted] + [token])
        timeline.stamp("device: committed")
        self.rounds_done += 1

    def _rehearse_verdict(self, frames: list, checks: dict) -> None:
        """A verdict's decode and checks, and those of the schedule inside, on `frames` (one that passed them)."""
        header, arrays = P.decode(frames)
        M.parse_verdict(header, arrays, **checks)
        nxt = M.schedule_in(header)
        if nxt is not None:
            M.parse_schedule(nxt, self.max_draft_len, self.drafter.vocab_size)

    def _draft_generator(self, round_index: int):
        """Round `round_index`'s drafting generator: the one made ahead if it is for this round and session."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (self.session, round_index):
            return ahead[2]
        return RoundRandomness(self.seed, self.name, round_index).draft_generator()

    def _on_probe(self, header: dict, arrays: dict) -> None:
        """A rate probe of the edge (`edge_node.probing`): echo it at once with the padding it asks for, and
        how long it was held here (a duration on this clock). The reply's size is bounded by the parse
        (`M.MAX_PROBE_BYTES`): a larger one is refused before anything is allocated."""
        t0 = time.perf_counter()
        if self.session is None:
            raise ProtocolError("probe before registered")
        probe = M.parse_probe(header, arrays)
        pad = None
        if probe.reply_bytes:
            if self._probe_pad is None or self._probe_pad.size < probe.reply_bytes:
                self._probe_pad = np.zeros(probe.reply_bytes, np.uint8)  # zeros, never written: sent zero-copy
            pad = self._probe_pad[: probe.reply_bytes]
        self._send(M.probe_echo(probe.id, pad, hold_s=time.perf_counter() - t0), copy=False)

    def _link(self) -> dict | None:
        """The latest link reading for the edge (None without a probe or before its first reading)."""
        m = None if self.link_probe is None else self.link_probe.latest()
        return None if m is None else link_reading(m)


def time_drafting(drafter: Drafter, tokens: int = CALIBRATE_TOKENS, *, hosted: bool = False,
                  wire_bits: int = 16) -> float:
    """Seconds per token of a round's drafting with this drafter: one warm-up draft on a short synthetic
    context (it also prefills), a rejection committed, then one timed draft of `tokens` tokens through the wire
    precision (a round's draft: one pending token fed, then a forward per draft but the last, each row
    sampled), `CALIBRATE_DRAFTS` times after an idle pause each (a round's drafting follows a wait for the
    verdict); the median. `hosted` (a shared host): the thread's CPU time when shorter than the wall clock, as
    in rounds. Leaves the drafter reset to that context: a session starts with `reset` of its prompt anyway."""
    vocab = int(drafter.vocab_size)
    context = [(7 * i + 1) % vocab for i in range(16)]
    params, rng = SamplingParams(), np.random.default_rng(0)
    drafter.reset(context)
    drafter.draft(tokens, params, rng, wire_bits=wire_bits)
    times = []
    for _ in range(CALIBRATE_DRAFTS):
        drafter.commit(0, context[-1])
        time.sleep(CALIBRATE_PAUSE_S)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        drafter.draft(tokens, params, rng, wire_bits=wire_bits)
        took = time.perf_counter() - t0
        times.append(min(took, time.thread_time() - cpu0) if hosted else took)
    drafter.reset(context)
    return float(np.median(times)) / tokens


def link_reading(m: LinkMeasurement, now: float | None = None) -> dict:
    """A measurement as a report's `link` (`M.LINK_FIELDS`): its age on this device's clock instead of the
    time. A value outside the wire's bounds is left out and said in `error` (the edge would refuse the whole
    report, and with it the round's tokens); texts are cut to their bounds."""
    out: dict = {"age_s": min(m.age_s(now), M.LINK_FIELDS["age_s"][2])}
    notes = []
    for key in ("snr_db", "signal_dbm", "noise_dbm"):
        value = getattr(m, key)
        _, lo, hi = M.LINK_FIELDS[key]
        if value is None:
            continue
        if isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi:
            out[key] = float(value)
        else:
            notes.append(f"{key}={value!r} outside [{lo:g}, {hi:g}]")
    error = "; ".join(x for x in (m.error, *notes) if x) or None
    for key, text in (("source", m.source), ("error", error)):
        if text is not None:
            out[key] = str(text)[: M.LINK_FIELDS[key][2]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="device_node.node", description="A multispin device node.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_from_args(args)


def tell_edge(connect: str, name: str, message: str, keys: ClientKeys | None, wait_s: float = 5.0) -> None:
    """Best effort: send the edge a fatal `error` saying why this device cannot take part, waiting up to
    `wait_s` for it to leave (an edge that is not up yet never hears it)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        if keys is None:  # with keys the edge knows the device by its key
            sock.setsockopt(zmq.ROUTING_ID, name.encode())
        make_client(sock, keys)
        sock.connect(connect)
        sock.send_multipart(M.error(message, fatal=True))
    except zmq.ZMQError as exc:
        log.debug("%s: could not tell the edge: %s", name, exc)
    finally:
        sock.close(linger=int(wait_s * 1000))  # the linger is the delivery window


def run_from_args(args) -> ExitCode:
    """Build the device from parsed `add_arguments` options and run it; returns its exit code."""
    from device_node.drafter import OnnxDrafter  # onnxruntime + numpy only

    if args.serve_runs:
        next_run.install()  # before the parent may signal the next run
    keys = None
    if args.keys:
        try:
            keys = ClientKeys.load(args.keys)
        except SecurityError as exc:  # without keys the edge cannot even be told
            print(f"multispin device: error: --keys: {exc}", file=sys.stderr)
            return ExitCode.USAGE
    try:
        # A thread only for a real probe; a bad SPEC or period fails here, before the model loads.
        probe = make_probe(args.link_probe)
        probe_thread = None if isinstance(probe, NoneProbe) else BackgroundProbe(probe, args.link_probe_period_s)
        hardware = load_hardware(args.hardware)
        drafter = OnnxDrafter(args.draft, threads=hardware.threads)
    except (ValueError, FileNotFoundError) as exc:  # the message names the file, the profile or the SPEC
        print(f"multispin device: error: {exc}", file=sys.stderr)
        # The edge would otherwise wait for this device until its wait_for_devices_s.
        tell_edge(args.connect, args.name, f"device {args.name} cannot start: {exc}", keys,
                  wait_s=min(5.0, args.register_timeout))
        return ExitCode.USAGE
    node = DeviceNode(args.connect, args.name, drafter, hardware, register_timeout_s=args.register_timeout,
                      tx_marker=not args.no_tx_marker, keys=keys, reconnect=args.reconnect,
                      link_probe=probe_thread.start() if probe_thread else None, busy_poll=args.busy_poll,
                      serve_runs=args.serve_runs)
    try:
        return node.run()
    finally:
        node.close()
        if probe_thread is not None:
            probe_thread.stop()


if __name__ == "__main__":
    sys.exit(main())
