"""The edge's socket: one ZeroMQ ROUTER, hardened, and everything that goes in and out of it.

It sends (to a device's name, through its route with CURVE keys), receives, refuses (counted per reason, logged
at most `REFUSAL_LOG_BURST` a second so that a flood cannot fill the disk), rate-limits each identity before
anything is decoded, tells which name a message speaks for, and sends the heartbeats. During a long call of the
edge's loop (a verification, a plan: `lent()`) its `HeartbeatThread` serves the socket instead: it sends the
heartbeats due and takes in what arrives, stamped on arrival (`held`), so that the loop handles it before it
judges any device silent and before it reads the socket again. With CURVE keys
(`keys_dir`) only listed keys connect, and a message speaks for the name its key is bound to, whatever routing
identity its connection chose; behind an emulator (`channel_mode` not passthrough) only the emulator's key
connects, so no device skips its air time."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import zmq

from testbed.runtime import security
from testbed.runtime.handshake_watch import ServerHandshakeWatch
from testbed.runtime.heap import release_freed_memory
from testbed.runtime.heartbeat import Heartbeat, HeartbeatThread
from testbed.runtime.sockets import harden_router, max_message_bytes
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

log = logging.getLogger("multispin.edge")

REFUSAL_LOG_BURST = 20  # refusals logged per second; beyond that they are counted (a flood must not fill the disk)
# What the heartbeat thread takes in during one long call, at most; the rest waits in ZeroMQ's queues as it would
# without the thread (a flood must not fill the memory).
# After this many refused messages and this long without one, the flood is over: the freed heap goes back to
# the kernel (`testbed.runtime.heap.release_freed_memory`; the edge keeps 256 MiB of it otherwise).
FLOOD_TRIM_REFUSALS, FLOOD_QUIET_S = 1_000, 1.0
# A slow trickle of refusals (a hostile device registering again and again, each time a session and its KV cache
# built and dropped) frees as much over time: after this long with any refusal since the last trim, trim too.
TRICKLE_TRIM_S = 30.0
HELD_MAX_MESSAGES = 10_000
HELD_MAX_BYTES = 256 << 20
# With `measure_links`, the heartbeat thread looks at the socket this often during a long call, so that what it
# takes in is stamped within a few ms of its arrival (`stamp_width_s`): a draft or report that came while the
# edge planned still measures the link (at 250 ms it was left out, and a DL-mode uplink lost every draft).
STAMP_TICK_S = 0.001


class Refusal(ProtocolError):
    """A refused message with a reason tag for the per-reason counters (`EdgeSocket.refusals`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class EdgeSocket:
    def __init__(self, bind: str, cfg, sessions: dict, context=None):
        self.cfg, self.sessions = cfg, sessions  # sessions: name -> Session, whose `peer.last_sent` sends update
        self.heartbeat = Heartbeat(cfg.heartbeat_s, cfg.liveness)
        self.keys = security.ServerKeys.load(cfg.keys_dir) if cfg.keys_dir else None
        # Per routing identity, i.e. per connection (no handover: one connection per name). None: no limit.
        self.limiter = security.RateLimiter(cfg.max_msgs_per_s) if cfg.max_msgs_per_s is not None else None
        self.ctx = context or zmq.Context.instance()
        # One open file per connection: up to the hard limit, not the shell's soft one (often 1,024), or idle
        # peers that fill the soft limit lock every new device out.
        security.fd_limit(raise_soft=True)
        self.sock = self._bind(bind)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.routes: dict[str, bytes] = {}  # with CURVE on a direct link: name -> its connection's routing identity
        self._claim: tuple[str, bytes] | None = None  # (name, connection) a `register` in hand would move it to
        self._in_hand: list = []  # the last message's first frames (`recv`): a refusal logs its sender's address
        self.refused = 0
        self._refused_at_trim, self._last_refusal, self._trimmed_at = 0, 0.0, time.monotonic()
        self.refusals: Counter[str] = Counter()  # reason -> refused messages
        self._refusal_log = security.LogThrottle(log, REFUSAL_LOG_BURST, "refused messages")
        self._beat = M.heartbeat()
        # (frames, arrival, width) taken in by the heartbeat thread during a long call, handled first by `recv`
        self.held: deque[tuple[list, float, float | None]] = deque()
        self._held_bytes = 0
        self._emptied: float | None = None  # when the socket was last seen empty (edge clock)
        # Of the message `recv` returned last: how long before its stamp it may have arrived (its stamp minus
        # when the socket was last seen empty); None when not known. `edge_node.link_stamps` reads it.
        self.stamp_width_s: float | None = None
        tick = cfg.heartbeat_s / 4
        self.beats = HeartbeatThread(self._serve_lent, min(tick, STAMP_TICK_S) if cfg.measure_links else tick,
                                     name="edge-heartbeats")

    def lent(self):
        """Context manager around a long call of the edge's loop (it must not touch the socket inside): the
        heartbeat thread sends the heartbeats due and takes in what arrives meanwhile."""
        if not self.held and not self.sock.poll(0):
            self._emptied = time.monotonic()  # what the thread takes in arrived after this
        return self.beats.lent()

    def _serve_lent(self) -> None:
        """The heartbeat thread's work while the socket is lent: heartbeats due out, arrivals in (stamped)."""
        self.send_heartbeats(time.monotonic())
        while len(self.held) < HELD_MAX_MESSAGES and self._held_bytes < HELD_MAX_BYTES:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._emptied = time.monotonic()
                return
            now = time.monotonic()
            self.held.append((frames, now, None if self._emptied is None else now - self._emptied))
            self._held_bytes += sum(len(f) for f in frames)
        self._emptied = None  # left in the socket: what comes next may have waited since before

    def _bind(self, bind: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        harden_router(sock, max_msg_bytes=max_message_bytes(self.cfg.max_array_bytes),
                      heartbeat_s=self.cfg.heartbeat_s, liveness=self.cfg.liveness)
        # CURVE before bind; no keys: plain. Behind an emulator only its key connects: a device's own key
        # would skip the air time (the handshake fails, so it cannot even hold a device's name here).
        security.make_server(sock, self.keys, admit=None if self.cfg.channel_mode == "passthrough"
                             else (security.CHANNEL_CLIENT,))
        # A refused handshake delivers no message: the watch logs the peer's address and why (no keys, ...).
        self.handshakes = ServerHandshakeWatch(sock, log) if self.keys is not None else None
        sock.bind(bind)
        return sock

    # -- out -------------------------------------------------------------------------------------
    def send(self, name: str, frames: list) -> None:
        self.sock.send_multipart([self.routes.get(name) or name.encode(), *frames], copy=False)
        if not self.held and not self.sock.poll(0):
            self._emptied = time.monotonic()  # a reply to this arrives after it (`stamp_width_s`)
        s = self.sessions.get(name)
        if s is not None:
            s.peer.sent()

    def send_quietly(self, name: str, frames: list) -> None:
        """A send whose failure changes nothing (a goodbye to a device that may be gone)."""
        try:
            self.send(name, frames)
        except zmq.ZMQError:
            pass

    def send_heartbeats(self, now: float) -> None:
        for name, s in list(self.sessions.items()):
            if not s.done and self.heartbeat.due(s.peer, now):
                self.send(name, self._beat)  # uncharged (no "air"): the emulator passes it at once

    def refuse(self, ident: bytes, reason: str, message: str, round_index=None, *, answer: bool = True) -> None:
        """Count and log a refused message; with `answer`, answer its sender with an `error` (M.error is safe
        on peer text). Under a name in use by another connection ZeroMQ delivers nothing, so the reply reaches
        the sender."""
        self.refused += 1
        self.refusals[reason] += 1
        self._last_refusal = time.monotonic()
        self._refusal_log.warn(self._last_refusal, reason, "refused a message from %s%s: %s",
                               P.show(ident.decode("utf-8", "replace"), 80), self._address(ident), message)
        if not answer:
            return
        try:
            self.sock.send_multipart([ident, *M.error(message, round_index=round_index)], copy=False)
        except zmq.ZMQError:
            pass

    def _address(self, ident: bytes) -> str:
        """' (from ADDRESS)': the peer address ZeroMQ gives the message in hand from `ident`, if it has one."""
        frames = self._in_hand
        if len(frames) < 2 or frames[0].bytes != ident:
            return ""
        address = security.peer_address(frames[1])
        return f" (from {address[:80]})" if address else ""

    def flush_log(self, now: float) -> None:
        self._refusal_log.flush(now)
        since = self.refused - self._refused_at_trim
        due = since >= FLOOD_TRIM_REFUSALS or (since > 0 and now - self._trimmed_at >= TRICKLE_TRIM_S)
        if due and now - self._last_refusal >= FLOOD_QUIET_S:
            self._refused_at_trim, self._trimmed_at = self.refused, now
            released = release_freed_memory()
            log.info("edge: %s ended (%d refused messages in all): freed heap %s",
                     "a flood" if since >= FLOOD_TRIM_REFUSALS else "a trickle of refusals", self.refused,
                     "given back to the system" if released else "had nothing to give back")

    # -- in --------------------------------------------------------------------------------------
    def recv(self) -> tuple[list, float, bool] | None:
        """The next message: (frames, arrival on the edge clock, whether it was held: taken in by the heartbeat
        thread during a long call, so that its arrival stamp is late by up to a tick, `stamp_width_s`); None when
        none is queued. Held messages come first: they arrived before anything still in the socket."""
        if self.held:
            frames, t_arr, self.stamp_width_s = self.held.popleft()
            self._held_bytes -= sum(len(f) for f in frames)
            held = True
        else:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._emptied = time.monotonic()
                return None
            t_arr, held = time.monotonic(), False
            self.stamp_width_s = None if self._emptied is None else t_arr - self._emptied
        self._in_hand = frames[:2]  # identity and header only: an array frame may be large
        return frames, t_arr, held

    def admitted(self, ident: bytes, t_arr: float) -> bool:
        """Within its identity's rate; else refused, before anything is decoded and unanswered: a flood costs a
        receive and this check. A device's probe echoes come at most one per 10 ms: far below the limit."""
        if self.limiter is None or self.limiter.allow(ident, t_arr):
            return True
        self.refuse(ident, "rate_limited", f"over {self.limiter.rate:g} messages/s; dropped unanswered", answer=False)
        return False

    def sender(self, ident: bytes, frames: list) -> tuple[str, bool]:
        """(the name a message speaks for, whether its key says so): with CURVE on a direct link, the name its
        key is bound to, never the routing identity (the peer's own choice: a listed key that connected first
        under another device's name would hold that name, as ZeroMQ ignores a second connection under it);
        replies to the name go to the connection that last registered under it (`routes`,
        `security.claims_route`). Else the routing identity."""
        key_name = None
        if self.keys is not None and self.cfg.channel_mode == "passthrough" and len(frames) > 1:
            key_name = security.sender_name(frames[1])
        if key_name is None or key_name == security.CHANNEL_CLIENT:
            return ident.decode("utf-8", "replace"), False
        return key_name, True

    def route(self, name: str, ident: bytes, keyed: bool, header: dict) -> None:
        """Which connection holds a keyed name: replies to it go there (`routes`, one entry per listed key at
        most). The first connection heard from holds it until a registration is accepted from another
        (`take_route`, from `Sessions.register`): a `register` under the key's own name from a second connection
        only proposes a move, so one refused as "name in use" leaves the replies with the live holder. Any
        other message from a second connection while the name has a session is refused (`duplicate_key`): a
        copy of a device's key file can neither speak for its live session nor cut it out."""
        self._claim = None
        if not keyed:
            return
        holder = self.routes.get(name)
        if holder is None:
            self.routes[name] = ident
        elif holder != ident:
            if security.claims_route(name, header):
                self._claim = (name, ident)
            elif name in self.sessions:
                raise Refusal("duplicate_key", f"the key of {name!r} is in use by another connection, which holds "
                                               "its session; refused")

    def take_route(self, name: str) -> None:
        """A registration under `name` was accepted: replies to it go to the connection it came from."""
        if self._claim is not None and self._claim[0] == name:
            self.routes[name] = self._claim[1]
        self._claim = None

    def check_sender(self, frames: list) -> None:
        """With CURVE behind an emulator: only the emulator's key, which speaks for every device (the ZAP handler
        refuses the others already). On a direct link a key speaks for its own name (`sender`): nothing to check."""
        if self.keys is None or len(frames) < 2 or self.cfg.channel_mode == "passthrough":
            return
        sender = security.sender_name(frames[1])
        if sender != security.CHANNEL_CLIENT:
            raise Refusal("identity", f"the key of {sender!r} cannot reach this edge: "
                                      "devices connect through the channel emulator")

    def via_channel(self, frames: list) -> bool:
        """Whether the message came through the channel emulator, so that its `channel` annotation is the
        emulator's and not the sender's own (a device can write any annotation into its header)."""
        if self.cfg.channel_mode == "passthrough":
            return False
        if self.keys is not None and len(frames) > 1:
            return security.sender_name(frames[1]) == security.CHANNEL_CLIENT
        return True  # without keys the edge cannot tell; the emulator overwrites charged messages' annotation

    def close(self) -> None:
        self.beats.close()
        if self.handshakes is not None:
            self.handshakes.close()
        self.sock.close(linger=200)
