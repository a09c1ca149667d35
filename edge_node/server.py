"""The edge node: a ZeroMQ ROUTER serving many devices, rounds of one batched verification each.

`EdgeServer` puts the edge's parts together and is the public interface both round loops run on:

- `edge_node.transport.EdgeSocket`: the ROUTER (hardened as every device-facing ROUTER, `testbed.runtime.sockets`),
  sends, receives, refusals, rate limits, CURVE identities, heartbeats out;
- `edge_node.inbox.Inbox`: one message handled (decoded, checked, put into its round or session);
- `edge_node.sessions.Sessions`: registration, liveness, leaving, rejoining;
- `edge_node.channel_watch.ChannelWatch`: the channel emulator's control calls, its process, whether it answers;
- `edge_node.verification.Verification`: one batched forward and each device's accept/reject;
- `edge_node.sync_rounds.SyncRounds` and `edge_node.async_rounds.AsyncRounds` (`scenario.rounds`): the rounds;
- `edge_node.virtual_clock`: a round's times as if every message had been read as it arrived.

Liveness is the ZeroMQ guide's Paranoid Pirate (`testbed.runtime.heartbeat`): the edge sends a `heartbeat` to a
device it has sent nothing to for `heartbeat_s`, and drops a session it has heard nothing from for `liveness` x
`heartbeat_s` (its KV cache is freed). Liveness does not depend on compute: around a long call (the target's
forward, a plan) the loop lends its socket to the heartbeat thread (`EdgeSocket.lent`), which keeps the
heartbeats going and takes in what arrives; the loop handles that before it judges anyone silent. On a measured
real link (`measure_links`) each device's link is also probed at registration and between rounds
(`edge_node.probing`). See docs/wire-protocol.md for the hardening.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from edge_node.async_rounds import AsyncRounds
from edge_node.channel_watch import ChannelWatch
from edge_node.config import MAX_MSGS_PER_S, EdgeConfig
from edge_node.controller import Controller, RoundPlan
from edge_node.inbox import Inbox
from edge_node.probing import Prober
from edge_node.round_state import DRAIN_BATCH, InFlight, Rounds
from edge_node.sessions import Session, Sessions
from edge_node.sync_rounds import SyncRounds, edge_phases
from edge_node.transport import REFUSAL_LOG_BURST, EdgeSocket, Refusal
from edge_node.verification import DrawsAhead, Verification, extra_positions
from edge_node.virtual_clock import WAITED_S, ThreadClock
from testbed.core.model import ul_first_bits
from testbed.runtime.link_estimate import LinkEstimator
from testbed.runtime.sockets import HANDSHAKE_S
from testbed.runtime.waiting import wait_readable
from testbed.wire import messages as M
from testbed.wire import protocol as P

CLOCK_WAIT_S = 2.0  # at most this for the devices' clock offsets once all registered (`wait_for_devices`)

__all__ = ["DRAIN_BATCH", "HANDSHAKE_S", "MAX_MSGS_PER_S", "REFUSAL_LOG_BURST", "WAITED_S", "DrawsAhead",
           "EdgeConfig", "EdgeServer", "Refusal", "Session", "ThreadClock", "draft_header_bits", "edge_phases"]


class EdgeServer:
    def __init__(self, bind: str, verifier, *, scenario, controller: Controller, prompts: list[list[int]],
                 config: EdgeConfig | None = None, channel=None, recorder=None, context=None, **options):
        """`config`, or its fields as keyword `options` (`EdgeConfig`); `channel`: the emulator's control
        client (`channel_emulator.proxy.ChannelControl`), None without one."""
        cfg = self.config = config if config is not None else EdgeConfig(**options)
        self.verifier, self.scenario, self.controller, self.recorder = verifier, scenario, controller, recorder
        self.bits = scenario.bits_per_prob
        P.wire_dtype(self.bits)  # fail early on an unsupported precision
        self.check_stop = None  # optional callable, at every tick: raises to end the run (a swallowed signal)
        # Optional callable(record), just before a record is written: the session's progress line goes first, so
        # a kill between the two leaves the tokens of a round without its record, never a record without them.
        self.before_record = None
        self.watch = ChannelWatch(channel, cfg.heartbeat_s, cfg.base_latency_s)
        self.inflight = InFlight()
        # Request-level serving (`edge_node.requests.RequestQueues`, set before devices register); None: each
        # device generates from one prompt for the whole run.
        self.requests = None
        self.roster = Sessions(self, {d.name for d in scenario.devices}, prompts)
        self.sessions: dict[str, Session] = self.roster.by_name
        self.socket = EdgeSocket(bind, cfg, self.sessions, context)
        self.endpoint = self.socket.endpoint
        self.inbox = Inbox(self)
        self.verification = Verification(self)
        # No channel to account for (passthrough, links not measured): round r+1's schedules may go out right
        # after round r's verdicts, its reports and record then overlap the next drafting.
        self.sync = SyncRounds(self, cfg.schedule_ahead and channel is None and not cfg.measure_links)
        self._next_tick = 0.0
        self.rounds_done = 0
        self.last_record: dict | None = None
        self.t_origin = time.monotonic()
        # A real link (no emulator): estimate each device's UL and DL rate from what this edge measures, and
        # let the controller plan with them (`testbed.runtime.link_estimate`), with probe sweeps of each.
        self.links = LinkEstimator() if cfg.measure_links else None
        probes = cfg.rate_probes
        self.prober = Prober(self, probes) if cfg.measure_links and probes and probes.enabled else None
        controller.seed_header_bits(draft_header_bits(controller.base, self.bits, cfg.on_air_vocab_size))

    # -- what others read and set ----------------------------------------------------------------
    channel = property(lambda self: self.watch.channel, lambda self, v: setattr(self.watch, "channel", v))
    channel_exited = property(lambda self: self.watch.exited, lambda self, v: setattr(self.watch, "exited", v))
    channel_down = property(lambda self: self.watch.down)
    sock = property(lambda self: self.socket.sock)
    refused = property(lambda self: self.socket.refused)
    refusals = property(lambda self: self.socket.refusals)
    device_errors = property(lambda self: self.roster.device_errors)
    rehearsal = property(lambda self: self.inbox.rehearsal)
    max_array_bytes = property(lambda self: self.config.max_array_bytes)
    heartbeat_s = property(lambda self: self.config.heartbeat_s)
    deadline_s = property(lambda self: self.config.deadline_s)

    # -- serving ---------------------------------------------------------------------------------
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
            self.inbox.mark_free()
            if not self.socket.held and not wait_readable(self.sock, max(0.001, wait), busy=self.config.busy_poll,
                                                          rehearse=self.inbox.rehearsal.run):
                continue
            if self.drain(stop, limit=DRAIN_BATCH):
                return

    def drain(self, stop=None, mark_free: bool = True, limit: int | None = None) -> bool:
        """Handle every message already queued (until `stop()` is true, or `limit` messages); returns whether it
        stopped. With `mark_free`, the edge counts as free again after each message (what was read late is
        told apart)."""
        for _ in itertools.repeat(None) if limit is None else range(limit):
            got = self.socket.recv()
            if got is None:
                return False
            frames, t_arr, held = got
            self.inbox.dispatch(frames, t_arr, waited=held)
            if mark_free:
                self.inbox.mark_free()
            if stop is not None and stop():
                return True
        return False

    def _tick(self, now: float) -> None:
        """Housekeeping a few times per heartbeat period: the refusal log's window closed, the emulator's
        process checked (in rounds too), heartbeats out, silent sessions ended, and between rounds a check
        that the emulator still answers. `check_stop` first, at every call: it is one attribute test."""
        if self.check_stop is not None:
            self.check_stop()
        if now < self._next_tick:
            return
        self._next_tick = now + self.config.heartbeat_s / 4
        self.socket.flush_log(now)
        self.watch.check_process()
        self.socket.send_heartbeats(now)
        self.roster.end_silent(now)
        if not self.inflight.in_round:
            self.watch.probe(now)

    def send(self, name: str, frames: list) -> None:
        self.socket.send(name, frames)

    def take_held(self) -> None:
        """Handle what the heartbeat thread took in during the last long call (signs of life among it), before
        anyone is judged silent (`Sessions.end_silent`)."""
        if self.socket.held:
            self.drain(mark_free=False, limit=len(self.socket.held))

    def wait_for_devices(self, names: list[str], timeout_s: float) -> list[str]:
        """Serve registrations until all `names` registered or the timeout; returns those missing. Once all
        registered, up to `CLOCK_WAIT_S` more for the clock offsets of the devices that measure one (a few round
        trips: the run's first rounds must not race them)."""
        self.poll(time.monotonic() + timeout_s, stop=lambda: all(n in self.sessions for n in names))
        missing = [n for n in names if n not in self.sessions]
        if not missing:
            self.poll(time.monotonic() + CLOCK_WAIT_S, stop=lambda: all(
                s.clock is not None for s in self.sessions.values() if M.CLOCK_OFFSET in s.features))
        return missing

    # -- what both round loops share ---------------------------------------------------------------
    def plan_fresh(self, r: int, names: list[str]) -> tuple[RoundPlan, float]:
        """The controller's plan of round `r` for `names`, and the seconds it took."""
        t = time.monotonic()
        self.controller.prefill_positions = extra_positions(
            self.verifier, [self.sessions[n].sid for n in names if n in self.sessions])
        with self.socket.lent():  # a plan may take long (many devices, a plug-in policy): heartbeats go on
            rp = self.controller.plan_round(r, names, t - self.t_origin)
        return rp, time.monotonic() - t

    def publish_link_rates(self, names: list[str]) -> None:
        """The measured link rates the controller plans `names` with, and their sources (rounds, probe, model)."""
        for name in names:
            rates, sources = self.links.plan_rates(name)
            self.controller.measured_rates[name] = rates
            self.controller.measured_sources[name] = sources

    def keep_record(self, rec: dict, fit_round: tuple[float, float] | None) -> None:
        """A closed round's (or cycle's) record: fit the round overhead T_0 on it if `fit_round` (predicted
        round time, prior T_0), feed the energy and outcome estimates, write it (a crash or Ctrl-C after this
        keeps it), count it."""
        if fit_round is not None:
            measured, predicted = rec["measured"].get("verify_s"), rec["predicted"].get("verify_s")
            verify_error = measured - predicted if None not in (measured, predicted) else 0.0
            self.controller.observe_round(rec["measured"]["round_s"], *fit_round, verify_error_s=verify_error)
        self.controller.observe_energy(rec)  # measured UL air times: the energy budgets' margins
        self.controller.observe_outcome(rec)  # what the policy sees of this round next time
        if self.requests is not None:  # each request's tokens of this round, before it may complete
            self.requests.on_record(rec, self.sessions, self.t_origin)
        if self.before_record is not None:
            self.before_record(rec)
        if self.recorder is not None:
            self.recorder.append_round(rec)
        self.rounds_done += 1
        self.last_record = rec

    # -- the whole run ---------------------------------------------------------------------------
    def run(self, rounds: int, on_round=None, join_wait_s: float = 0.0, keep_records: bool = True,
            start_round: int = 0) -> list[dict] | None:
        """Run rounds `start_round`..`rounds`-1 (fewer if every session finishes; a resumed run numbers on:
        round indices seed every random draw). Each round's record is written by the recorder as the round
        ends and passed to `on_round`; `run` returns them all only with `keep_records` (the default, for
        callers that summarize the list; a long run should pass False and read rounds.jsonl back, see
        `testbed.runtime.records.load_run`), else None. `rounds_done` and `last_record` tell how far it got.
        With `scenario.rounds: asynchronous` each device cycles on its own: `rounds` cycles each."""
        loop: Rounds = AsyncRounds(self) if self.scenario.rounds == "asynchronous" else self.sync
        return loop.run(rounds, on_round=on_round, join_wait_s=join_wait_s, keep_records=keep_records,
                        start_round=start_round)

    def run_round(self, r: int) -> dict | None:
        """One synchronous round (`SyncRounds.run_round`)."""
        return self.sync.run_round(r)

    def finish(self, reason: str = "run complete") -> dict:
        """Tell every device the run is over; return the sessions' outputs (token ids)."""
        return self.roster.finish(reason)

    def close(self) -> None:
        self.socket.close()


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
