"""The channel emulator process: a transparent ZeroMQ forwarder that holds messages for their air time.

Devices connect to the frontend ROUTER (``frontend_bind``) with ``routing_id`` = their device name. For every
identity seen there the emulator opens one DEALER to the edge's ROUTER (``edge_connect``) with the same
``routing_id``, so the edge sees the devices exactly as if they were connected directly.

Frames are forwarded unchanged except the header frame (frame 0 of the message body, or frame 1 after an
empty REQ delimiter). A message whose header has ``"air": "ul"`` (device -> edge) or ``"air": "dl"``
(edge -> device) is held for its air time; anything else passes at once. Charged messages get
``"channel": {bytes, rate_bps, airtime_s, base_latency_s, queued_s, held_s, late_s, mode, ...}``.

Timing (all on this process's monotonic clock; no clock of another host is ever read):
    start    = max(arrival, link_free_at)          (FIFO per link)
    free_at  = start + 8 * bytes / rate
    deadline = free_at + base_latency
The message is held at the emulator until ``deadline`` (sleep in poll, then spin the last ``spin_s``).

Absorbing the sender's transfer time: a sender may send the marker ``{"v": 1, "type": "tx_start",
"air": "ul"}`` (the edge: ``"air": "dl"``, addressed to the device) as a one-frame message just before a
large payload. The emulator consumes it (it is not forwarded) and starts the payload's air time at the
marker's arrival instead of at the end of the payload's transfer. Only arrival times on the emulator's own
clock are compared, so this works with senders on other hosts. A marker older than ``marker_ttl_s`` when
the next charged message arrives on that link is ignored.

Shared DL (``dl_access`` in ``configure``): ``fdma_equal_split`` / ``fdma_fixed_split`` give each device its
own DL link at its configured ``dl_rate_bps``; ``tdma`` serialises all DL messages on one shared link, each
at its device's ``dl_rate_bps`` (the full-band rate).

Virtual mode (``mode="virtual"``): forward at once, annotate the air time (and queueing) it would have taken.
Every ``configure`` (one per round) empties the virtual queues: queueing is accounted within a round only.

The ``channel`` annotation: ``bytes`` (all frames of the message body), ``rate_bps`` (null: not charged),
``airtime_s`` = 8 bytes / rate, ``base_latency_s``, ``queued_s`` (waiting for the link), ``held_s`` (from the
start of the air time, i.e. the marker's or the message's arrival, to forwarding), ``late_s`` (forwarding time
minus the release time; >= 0 in real mode, 0 in virtual mode), ``lead_s`` (released this much before the
modeled deadline), ``mode``, ``link`` ("ul"/"dl"), ``round``, ``dl_access``, ``marker`` (a tx_start marker
started the air time). In real mode held_s = queued_s + airtime_s + base_latency_s - lead_s + late_s.

Hardening (a LAN is shared): with a key directory (``keys_dir``, see `testbed.runtime.security`) the frontend and the
control socket are CURVE servers that admit only listed keys, a device is the name its key is bound to
(whatever routing identity its connection chose: devices with keys let ZeroMQ pick one), only the ``edge``
client may use the control socket, and the DEALERs to the edge authenticate as ``channel``. Without keys, a
``control_token`` (passed in the environment, never on the command line) must be
in every control request. Every message is handled under a guard (a bad one is dropped and counted; refusals
are logged per peer in aggregate, `PeerLog`), identities are capped (least recently used idle ones are closed
first, those the edge never registered before devices, and those expire after `unregistered_idle_s`),
rate-limited and limited in bytes held, frontend connections are capped (the idlest shut down first,
`_reap_connections`), a second connection with a device's key moves the device's replies only once the edge
answers its `register` with `registered` (`_route_for_reply`), and a message that
is not charged waits behind the held messages of its own link, so one link's messages stay in order (but a
``heartbeat``, which carries no state, overtakes them: a long held verdict must not make its peer look dead).

Control (REP at ``control_bind``), JSON requests, JSON replies with ``"ok"``:
    {"type": "configure", "round": r, "dl_access": ..., "base_latency_s": ...,
     "links": {"<device>": {"ul_rate_bps": x | null, "dl_rate_bps": y | null}},   (null: not charged)
     "lead_s": a, "lead_per_byte_s": b, "mode": "real"|"virtual"}                  (optional)
``lead_s + lead_per_byte_s * bytes`` is released before the deadline: the calibrated transport time of the
hops outside the emulator (measure it with ``multispin channel validate``); 0 by default.
    {"type": "stats"}   {"type": "stop"}   {"type": "reset"}  (statistics, counters, links as at start)
"""

from __future__ import annotations

import argparse
import heapq
import hmac
import itertools
import json
import logging
import os
import socket
import struct
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import zmq

from channel_emulator import DEFAULT_SPIN_S
from channel_emulator.checks import DL_ACCESS, finite_number
from testbed.core.vocabulary import DIRECTIONS
from testbed.runtime.handshake_watch import SERVER_EVENTS, ServerHandshakeWatch
from testbed.runtime.security import (
    CHANNEL_CLIENT,
    EDGE_CLIENT,
    ClientKeys,
    RateLimiter,
    ServerKeys,
    check_identity,
    claims_route,
    fd_limit,
    make_client,
    make_server,
    sender_name,
    stop_authenticators,
)
from testbed.runtime.sockets import harden_router, max_message_bytes
from testbed.wire import messages as M
from testbed.wire.protocol import (
    ERROR,
    REGISTERED,
    TX_START,
    ProtocolError,
    annotate_header,
    decode_header,
    encode_header,
    parse_json,
)

log = logging.getLogger("channel_emulator.proxy")

MODES = ("real", "virtual")
SHARED_DL = "*tdma*"  # the link key of the one shared DL link under tdma
TOKEN_ENV = "MULTISPIN_CHANNEL_TOKEN"  # where a parent process hands the control token to the emulator
MAX_IDENTITIES = 512     # one DEALER per identity: stay well below the fd limit (see `identity_budget`)
IDLE_REAP_S = 600.0      # an identity silent this long loses its DEALER
UNREGISTERED_IDLE_S = 30.0  # ... and one the edge never answered `registered` (garbage, a scan) after this
MAX_HELD_BYTES = 256 * 2**20  # bytes held for their air time per identity (UL): a device holds one draft or so
PEER_LOG_INTERVAL_S = 5.0  # refusals are said once per peer per interval, counted by reason
PEER_LOG_LINES = 20        # peers named per interval; the rest in one summary line
CONN_PROTECT_AGE_S = 2.0   # a frontend connection this old and active within CONN_ACTIVE_S is reaped last
CONN_ACTIVE_S = 2.0
# Open files per identity: the device's connection to the frontend, its DEALER's connection and mailbox. ZeroMQ
# aborts the process when it runs out of files, so the cap must fit the process's limit (ulimit -n, often 1024).
FDS_PER_IDENTITY = 3
SOCKETS_RESERVE = 16    # the frontend, its monitor, the control socket: ZeroMQ sockets that are no identity's
FD_RESERVE = 64          # listeners, the control socket, ZeroMQ's own threads, the log, Python
LOG_BURST = PEER_LOG_LINES  # (the former name) peers whose refusals are logged per interval
MAX_MSGS_PER_S = 2000.0  # per identity, averaged over a one-second burst
MAX_CONTROL_REPLY_BYTES = 16 * 1024 * 1024  # stats of many links; still bounded
# A configure of many links (1,024 devices: 70 kB) is more than a device's 64 KiB header; only the edge may use
# the control socket (token, CURVE), and it is bounded all the same.
MAX_CONTROL_REQUEST_BYTES = 16 * 1024 * 1024


def _header(frames: list) -> dict | None:
    """A device message's header (after the routing frame), or None if it is not one."""
    try:
        return decode_header(frames[1].bytes)
    except (ProtocolError, IndexError):
        return None


class ConfigError(ValueError):
    pass


class PeerLog:
    """Refusals of peers' messages in aggregate: counted per peer and reason, and said once per `interval_s` in
    one line per peer (at most `lines` peers; the others in one summary line). A flood of any number of messages
    or identities writes a bounded log; the owner calls `flush` from its periodic tick, and at exit."""

    def __init__(self, logger: logging.Logger, interval_s: float = PEER_LOG_INTERVAL_S, lines: int = PEER_LOG_LINES):
        self.logger, self.interval_s, self.lines = logger, float(interval_s), int(lines)
        self.start = time.monotonic()
        self.peers: dict[str, Counter] = {}
        self.example: dict[str, str] = {}

    def warn(self, now: float, peer: str, reason: str, msg: str, *args) -> None:
        counts = self.peers.get(peer)
        if counts is None:
            if len(self.peers) >= 64 * self.lines:  # a flood of identities: count it under one key
                peer = "(other peers)"
                counts = self.peers.setdefault(peer, Counter())
            else:
                counts = self.peers[peer] = Counter()
                try:
                    self.example[peer] = (msg % args)[:300]
                except (TypeError, ValueError):
                    self.example[peer] = msg[:300]
        counts[reason] += 1
        self.flush(now)

    def flush(self, now: float, force: bool = False) -> None:
        if not self.peers or (not force and now - self.start < self.interval_s):
            if not self.peers:
                self.start = now
            return
        span = max(now - self.start, 0.0)
        ranked = sorted(self.peers.items(), key=lambda kv: -kv[1].total())
        for peer, counts in ranked[:self.lines]:
            self.logger.warning("peer %s: %d message(s) refused in %.1f s (%s); first: %s", peer, counts.total(),
                                span, ", ".join(f"{k}: {v}" for k, v in counts.most_common()),
                                self.example.get(peer, "-"))
        rest = ranked[self.lines:]
        if rest:
            total = Counter()
            for _, counts in rest:
                total.update(counts)
            self.logger.warning("%d more peers: %d message(s) refused in %.1f s (%s)", len(rest), total.total(), span,
                                ", ".join(f"{k}: {v}" for k, v in total.most_common()))
        self.start, self.peers, self.example = now, {}, {}


_TCP_INFO_LEN = 104


def tcp_idle_s(fd: int) -> tuple[float, int] | None:
    """(seconds since data last went either way, local port) of a connected tcp socket `fd` (Linux TCP_INFO:
    tcpi_last_data_sent/recv, ms); None if it is not one (an ipc connection, a closed or reused file)."""
    try:
        s = socket.socket(fileno=fd)  # no new file (at the limit, a dup would fail): detached below
    except OSError:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        sent, _, recv = struct.unpack_from("<III", info, 44)
        s.getpeername()  # a connection, not the listener
        return min(sent, recv) / 1000.0, s.getsockname()[1]
    except (OSError, struct.error, AttributeError, IndexError):
        return None
    finally:
        s.detach()  # the file stays libzmq's


def shut_down(fd: int, port: int) -> bool:
    """End the tcp connection `fd` (a frontend connection of local `port`): libzmq sees the peer gone and closes
    it itself (ZeroMQ has no call to drop one peer of a ROUTER). Checked against `port` first: the file may have
    been closed and reused since its monitor event."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if s.type != socket.SOCK_STREAM or s.getsockname()[1] != port:
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except (OSError, IndexError, TypeError):
        return False
    finally:
        s.detach()


def identity_budget(max_identities: int, files: int | None) -> int:
    """The identity cap that fits `files` open files (`FDS_PER_IDENTITY` each beyond `FD_RESERVE`)."""
    if files is None:
        return max_identities
    return max(1, min(max_identities, (files - FD_RESERVE) // FDS_PER_IDENTITY))


def _rate(field: str, value: Any) -> float | None:
    if value is None:
        return None
    return finite_number(field, value, allowed="a finite rate in bit/s > 0, or null (not charged)",
                         error=ConfigError)


def parse_configure(msg: dict) -> dict:
    """Validate a configure request; returns the normalised config or raises ConfigError naming the field."""
    dl_access = msg.get("dl_access", "fdma_equal_split")
    if dl_access not in DL_ACCESS:
        raise ConfigError(f"dl_access={dl_access!r} is invalid; allowed: {', '.join(DL_ACCESS)}")
    base = finite_number("base_latency_s", msg.get("base_latency_s", 0.0), allowed="a finite number >= 0",
                         low_inclusive=True, error=ConfigError)
    links = msg.get("links", {})
    if not isinstance(links, dict):
        raise ConfigError(f"links={links!r} is invalid; allowed: an object {{device: {{ul_rate_bps, dl_rate_bps}}}}")
    out_links = {}
    for name, spec in links.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"links[{name!r}]={spec!r} is invalid; allowed: {{ul_rate_bps, dl_rate_bps}}")
        out_links[name] = {
            "ul": _rate(f"links[{name!r}].ul_rate_bps", spec.get("ul_rate_bps")),
            "dl": _rate(f"links[{name!r}].dl_rate_bps", spec.get("dl_rate_bps")),
        }
    lead = {f: finite_number(f, msg.get(f, 0.0), allowed="a number of seconds, 0 <= value < 1", low_inclusive=True,
                             high=1.0, error=ConfigError) for f in ("lead_s", "lead_per_byte_s")}
    mode = msg.get("mode")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode={mode!r} is invalid; allowed: {', '.join(MODES)}")
    rnd = msg.get("round")
    if rnd is not None and not (type(rnd) is int and abs(rnd) < 2**53):
        raise ConfigError(f"round={rnd!r} is invalid; allowed: an integer, or null")
    return {"round": rnd, "dl_access": dl_access, "base_latency_s": base, "links": out_links,
            "mode": mode, **lead}


class _LinkStats:
    __slots__ = ("messages", "bytes", "airtime_s", "queued_s", "held_s", "late_s_sum", "late_s_max")

    def __init__(self):
        self.messages = self.bytes = 0
        self.airtime_s = self.queued_s = self.held_s = self.late_s_sum = 0.0
        self.late_s_max = 0.0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class ChannelProxy:
    def __init__(self, frontend_bind: str, edge_connect: str, control_bind: str, mode: str = "real",
                 spin_s: float = DEFAULT_SPIN_S, marker_ttl_s: float = 5.0, context: zmq.Context | None = None,
                 keys_dir: str | None = None, control_token: str | None = None,
                 max_identities: int = MAX_IDENTITIES, idle_reap_s: float = IDLE_REAP_S,
                 max_msgs_per_s: float = MAX_MSGS_PER_S, unregistered_idle_s: float = UNREGISTERED_IDLE_S,
                 max_held_bytes: int = MAX_HELD_BYTES, max_unregistered: int | None = None,
                 expect_devices: int = 0,
                 max_connections: int | None = None, peer_log_interval_s: float = PEER_LOG_INTERVAL_S):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid; allowed: {', '.join(MODES)}")
        if not (0 <= spin_s < 1):
            raise ValueError(f"spin_s={spin_s!r} is invalid; allowed: 0 <= spin_s < 1")
        self.mode, self.spin_s, self.marker_ttl_s = mode, float(spin_s), float(marker_ttl_s)
        self.start_mode = mode  # what `reset` goes back to
        self.edge_connect = edge_connect
        self.ctx = context or zmq.Context()
        self._own_ctx = context is None
        self.secure = keys_dir is not None
        server_keys = ServerKeys.load(keys_dir) if keys_dir else None
        self.edge_keys = ClientKeys.for_name(keys_dir, CHANNEL_CLIENT) if keys_dir else None
        self.control_token = control_token
        # A run of many devices (`expect_devices`) needs an identity each, and all of them register at once.
        self.max_identities = max(int(max_identities), int(expect_devices) + int(max_identities) // 2)
        self.idle_reap_s = float(idle_reap_s)
        self.unregistered_idle_s, self.max_held_bytes = float(unregistered_idle_s), int(max_held_bytes)
        files = self.files = fd_limit()
        self._files_checked = 0.0
        if identity_budget(self.max_identities, files) < self.max_identities:
            self.max_identities = identity_budget(self.max_identities, files)
            log.warning("identities capped at %d: this process may open %d files (ulimit -n), %d per identity",
                        self.max_identities, files, FDS_PER_IDENTITY)
        # Identities the edge never answered `registered` hold at most a quarter of the DEALERs; frontend
        # connections (one file each) at most half the identities plus the registered ones, the idle ones shut
        # down first (`_reap_connections`): a flood's files in flight (connections accepted before the next
        # check, DEALERs closing) stay within what the cap leaves free.
        self.max_unregistered = max(1, int(max_unregistered) if max_unregistered is not None
                                    else max(self.max_identities // 4, min(int(expect_devices), self.max_identities)))
        self.max_connections = max(2, int(max_connections) if max_connections is not None
                                   else self.max_identities // 2)
        if self._own_ctx:  # libzmq's default cap is 1,023 sockets per context: a DEALER per identity beyond it
            self.ctx.set(zmq.MAX_SOCKETS, max(self.ctx.get(zmq.MAX_SOCKETS), self.max_identities + SOCKETS_RESERVE))
        self.limiter = RateLimiter(max_msgs_per_s)  # per identity; the same limit as the edge's
        self.max_msgs_per_s = self.limiter.rate
        self.frontend = self.ctx.socket(zmq.ROUTER)
        # The edge's hardening, with the edge's own message limit (what passes here the edge would accept) and
        # no high-water marks: a message held for its air time must never be dropped for a full queue.
        harden_router(self.frontend, max_msg_bytes=max_message_bytes(), hwm=0)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone device raises, it is not lost silently
        make_server(self.frontend, server_keys)
        self.frontend.bind(frontend_bind)
        last = self.frontend.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.frontend_port = int(last.rsplit(":", 1)[1]) if last.startswith("tcp://") else None
        # Connections (for the cap) and, with keys, refused CURVE handshakes: logged with the peer's address.
        self.handshakes = ServerHandshakeWatch(None, log, "channel emulator") if server_keys is not None else None
        self.monitor = self.frontend.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                                        | (SERVER_EVENTS if self.handshakes is not None else 0))
        self.conns: dict[int, float] = {}  # fd of a frontend connection -> when it was accepted
        self.control = self.ctx.socket(zmq.REP)
        self.control.setsockopt(zmq.LINGER, 0)
        make_server(self.control, server_keys)
        self.control.bind(control_bind)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.dealers: dict[bytes, zmq.Socket] = {}
        self.routes: dict[bytes, bytes] = {}  # with CURVE: a device's name -> its connection's routing identity
        self.claims: dict[bytes, bytes] = {}  # a name -> a second connection whose `register` awaits the edge's answer
        self.registered: set[bytes] = set()   # identities the edge answered `registered` (kept longer, reaped last)
        self.registering: set[bytes] = set()  # identities that sent a `register` the edge has not answered yet
        self.held_bytes: dict[bytes, int] = defaultdict(int)  # UL bytes held for their air time, per identity
        self.dealer_ident: dict[zmq.Socket, bytes] = {}
        self.config = {"round": None, "dl_access": "fdma_equal_split", "base_latency_s": 0.0, "links": {},
                       "lead_s": 0.0, "lead_per_byte_s": 0.0}
        self.free_at: dict[tuple[str, bytes | str], float] = {}
        self.markers: dict[tuple[str, bytes], float] = {}
        self.heap: list = []
        self.seq = itertools.count()
        self.stats: dict[tuple[str, str], _LinkStats] = {}
        self.counters = {"passed": 0, "charged": 0, "markers": 0, "stale_markers": 0, "malformed": 0,
                         "refused_identity": 0, "unconfigured": 0, "unknown_peer": 0, "errors": 0,
                         "impersonation": 0, "identity_cap": 0, "reaped": 0, "rate_limited": 0,
                         "queued_behind": 0, "control_refused": 0, "undeliverable": 0, "forged_annotation": 0,
                         "heartbeat_overtook": 0, "duplicate_key": 0, "held_bytes_cap": 0,
                         "unregistered_cap": 0, "expired_unregistered": 0, "connections_shut": 0,
                         "route_moved": 0}
        self.held_on_link: dict[tuple[str, bytes], int] = defaultdict(int)   # held messages per (dir, device)
        self.link_release: dict[tuple[str, bytes], float] = {}               # latest held deadline per link
        self.last_seen: dict[bytes, float] = {}
        self._last_reap = time.monotonic()
        self._peer_log = PeerLog(log, peer_log_interval_s)
        self.running = False

    # -- sockets -------------------------------------------------------------------------------------
    def _dealer_for(self, ident: bytes) -> zmq.Socket | None:
        sock = self.dealers.get(ident)
        if sock is None:
            if not ident or ident[0] == 0:
                # ZeroMQ reserves identities starting with a zero byte (auto-generated ones): the device did
                # not set routing_id, so the edge could not address it by name.
                self.counters["refused_identity"] += 1
                self._warn(ident, "no_routing_id",
                           "refusing peer without routing_id (identity %r); devices must set routing_id", ident)
                return None
            unregistered = len(self.dealers) - len(self.registered)
            if unregistered >= self.max_unregistered and not self._reap(time.monotonic(), need_one=True,
                                                                        unregistered_only=True):
                self.counters["unregistered_cap"] += 1
                self._warn(ident, "unregistered_cap", "refusing identity %r: %d identities the edge has not "
                           "registered are open (cap)", ident, unregistered)
                return None
            if len(self.dealers) >= self.max_identities and not self._reap(time.monotonic(), need_one=True):
                self.counters["identity_cap"] += 1
                self._warn(ident, "identity_cap", "refusing identity %r: %d identities are open (cap)", ident,
                           len(self.dealers))
                return None
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, ident)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            make_client(sock, self.edge_keys)
            sock.connect(self.edge_connect)
            self.dealers[ident] = sock
            self.dealer_ident[sock] = ident
            self.poller.register(sock, zmq.POLLIN)
            log.debug("device %r: opened DEALER to %s", ident, self.edge_connect)  # a flood's are many
        return sock

    def _reap(self, now: float, need_one: bool = False, unregistered_only: bool = False) -> bool:
        """Close DEALERs of identities idle past `idle_reap_s` (one the edge never registered: past
        `unregistered_idle_s`) that hold no message; with `need_one`, else the least recently used idle one,
        unregistered ones first. Returns whether one was closed."""
        idle = sorted((i in self.registered, i in self.registering, t, i) for i, t in self.last_seen.items()
                      if i in self.dealers and not self.held_on_link[("ul", i)] and not self.held_on_link[("dl", i)]
                      and not (unregistered_only and i in self.registered))
        victims = [i for reg, _, t, i in idle if now - t > (self.idle_reap_s if reg else self.unregistered_idle_s)]
        if not victims and need_one and idle:
            victims = [idle[0][3]]  # garbage first, then a registration on its way, then a device
        for ident in victims:
            if ident not in self.registered and now - self.last_seen.get(ident, now) > self.unregistered_idle_s:
                self.counters["expired_unregistered"] += 1
            sock = self.dealers.pop(ident)
            self.dealer_ident.pop(sock, None)
            self.poller.unregister(sock)
            sock.close(linger=0)
            (log.info if ident in self.registered else log.debug)("device %r: closed its idle DEALER", ident)
            self._forget(ident)
            self.counters["reaped"] += 1
        return bool(victims)

    def _forget(self, ident: bytes) -> None:
        """Drop what is kept per identity (it holds no message): a stream of new identities must not grow the
        emulator, nor its `stats` reply (the edge reads it every heartbeat). A configured link keeps its stats."""
        self.last_seen.pop(ident, None)
        self.routes.pop(ident, None)
        self.claims.pop(ident, None)
        self.registered.discard(ident)
        self.registering.discard(ident)
        self.held_bytes.pop(ident, None)
        self.limiter.forget(ident)
        for direction in DIRECTIONS:
            for table in (self.held_on_link, self.link_release, self.markers, self.free_at):
                table.pop((direction, ident), None)
        name = ident.decode("utf-8", "replace")
        if name not in self.config["links"]:
            self.stats.pop((name, "ul"), None)
            self.stats.pop((name, "dl"), None)

    def _warn(self, peer: bytes | str, reason: str, msg: str, *args) -> None:
        """A refused message of `peer`: counted, and said in aggregate once per interval (`PeerLog`)."""
        if isinstance(peer, bytes):
            peer = repr(peer[:64])
        self._peer_log.warn(time.monotonic(), peer, reason, msg, *args)

    def _within_rate(self, ident: bytes, now: float) -> bool:
        """Token bucket per identity (`security.RateLimiter`): `max_msgs_per_s`, bursts of one second's."""
        ok = self.limiter.allow(ident, now)
        if not ok:
            self.counters["rate_limited"] += 1
            self._warn(ident, "rate_limited", "device %r: over %.0f messages/s; dropping", ident, self.max_msgs_per_s)
        return ok

    def _from_frontend(self, frames: list, t_arr: float) -> None:
        ident = frames[0].bytes
        if self.secure and len(frames) > 1:
            # The device is the name its key is bound to, whatever routing identity its connection chose: a
            # listed key that connected first under another device's name holds nothing of that device's.
            name = sender_name(frames[1])
            if not name:
                self.counters["refused_identity"] += 1
                self._warn(ident, "no_name", "dropped a message from identity %r: no authenticated name", ident)
                return
            key = name.encode()
            holder = self.routes.get(key)
            if holder is None:
                self.routes[key] = ident  # the first connection heard from holds the name
            elif holder != ident:
                # A second connection with the name's key (a restarted device, or a copy of its key file): its
                # `register` goes to the edge as a claim, and the replies move to it only once the edge answers
                # `registered` (`_claimed`); anything else from it is refused, so it cannot cut the holder out.
                if not claims_route(name, _header(frames)):
                    self.counters["duplicate_key"] += 1
                    self._warn(ident, "duplicate_key", "the key of %r is in use by another connection (%r); "
                               "refused", name, ident)
                    try:
                        self.frontend.send_multipart([ident, *M.error(
                            f"the key of {name!r} is in use by another connection, which holds its session; "
                            "refused")], copy=False)
                    except zmq.ZMQError:
                        pass
                    return
                self.claims[key] = ident
            ident = key
        if not self._within_rate(ident, t_arr):
            return
        self.last_seen[ident] = t_arr
        if ident not in self.registered and len(frames) > 1 and b'"register"' in frames[1].bytes[:4096]:
            header = _header(frames)
            if header is not None and header.get("type") == "register":
                self.registering.add(ident)  # an unregistered identity that asks to be one: reaped after garbage
        self._handle("ul", ident, frames[1:], t_arr)
        if ident not in self.dealers:  # refused (no routing id, the cap): it keeps nothing here
            self._forget(ident)

    # -- message handling ----------------------------------------------------------------------------
    def _handle(self, direction: str, ident: bytes, body: list, t_arr: float) -> None:
        """direction 'ul': body came from device `ident` on the frontend; 'dl': from the edge for `ident`."""
        out = self._dealer_for(ident) if direction == "ul" else None
        if direction == "ul" and out is None:
            return
        h = 1 if len(body) > 1 and len(body[0]) == 0 else 0  # skip a REQ envelope delimiter
        header = None
        if body:
            try:
                header = decode_header(body[h].bytes)
            except ProtocolError as exc:
                self.counters["malformed"] += 1
                log.debug("forwarding malformed message from %r unchanged: %s", ident, exc)
        if direction == "dl" and header is not None and header.get("type") == REGISTERED:
            self.registered.add(ident)  # the edge admitted it: its DEALER is kept like a device's
            self.registering.discard(ident)
        if header is None or header.get("air") not in DIRECTIONS:
            self.counters["passed"] += 1
            if header is not None and "channel" in header:
                # Only the emulator writes air-time annotations: a sender's own would pass for measured ones.
                self.counters["forged_annotation"] += 1
                body = list(body)
                body[h] = annotate_header(body[h].bytes, channel=None)
            if self.held_on_link[(direction, ident)] and header is not None and header.get("type") == "heartbeat":
                # A heartbeat carries no state, and held behind a long verdict it would make the peer look
                # dead (a verdict held past the liveness window would end the session): it overtakes.
                self.counters["heartbeat_overtook"] += 1
                self._send(direction, ident, body)
            elif self.held_on_link[(direction, ident)]:
                # Behind a held message of the same link (e.g. the next schedule behind a verdict): keep order.
                self.counters["queued_behind"] += 1
                self._hold(self.link_release[(direction, ident)], direction, ident, body, h, t_arr, t_arr, None)
            else:
                self._send(direction, ident, body)
            return
        if header["type"] == TX_START:
            self.markers[(direction, ident)] = t_arr
            self.counters["markers"] += 1
            return
        if direction == "ul" and self.mode == "real":
            nbytes = sum(len(f) for f in body)
            if self.held_bytes[ident] + nbytes > self.max_held_bytes:
                self.counters["held_bytes_cap"] += 1
                self._warn(ident, "held_bytes_cap", "device %r: %d bytes held for their air time, %d more would "
                           "pass the cap of %d; dropped", ident, self.held_bytes[ident], nbytes, self.max_held_bytes)
                return
        self._charge(direction, ident, body, h, t_arr)

    def _charge(self, direction: str, ident: bytes, body: list, h: int, t_arr: float) -> None:
        cfg = self.config
        name = ident.decode("utf-8", "replace")
        link = cfg["links"].get(name)
        if link is None:
            self.counters["unconfigured"] += 1
        rate = link[direction] if link else None
        nbytes = sum(len(f) for f in body)
        ref = t_arr
        marker = self.markers.pop((direction, ident), None)
        if marker is not None:
            if t_arr - marker <= self.marker_ttl_s:
                ref = marker
            else:
                self.counters["stale_markers"] += 1
        key = (direction, SHARED_DL if direction == "dl" and cfg["dl_access"] == "tdma" else ident)
        start = max(ref, self.free_at.get(key, 0.0))
        airtime = 8.0 * nbytes / rate if rate else 0.0
        self.free_at[key] = start + airtime
        # Release early by the calibrated time of the emulator -> receiver hop, so that the message is *in*
        # the receiver at the modeled time (lead = 0 unless configured; see `multispin channel validate`).
        lead = cfg["lead_s"] + cfg["lead_per_byte_s"] * nbytes
        deadline = max(t_arr, start + airtime + cfg["base_latency_s"] - lead)
        info = {"bytes": nbytes, "rate_bps": rate, "airtime_s": airtime, "base_latency_s": cfg["base_latency_s"],
                "queued_s": start - ref, "mode": self.mode, "link": direction, "round": cfg["round"],
                "dl_access": cfg["dl_access"], "marker": ref != t_arr, "lead_s": lead}
        self.counters["charged"] += 1
        if self.mode == "virtual":
            self._release(direction, ident, body, h, t_arr, ref, deadline, info, virtual=True)
        else:
            self._hold(deadline, direction, ident, body, h, t_arr, ref, info)

    def _hold(self, deadline, direction, ident, body, h, t_arr, ref, info) -> None:
        link = (direction, ident)
        # A link releases in order: never before a message held earlier on it (tdma or a late configure
        # could otherwise give a later message an earlier deadline).
        deadline = max(deadline, self.link_release.get(link, deadline)) if self.held_on_link[link] else deadline
        self.held_on_link[link] += 1
        if direction == "ul":
            self.held_bytes[ident] += sum(len(f) for f in body)
        self.link_release[link] = deadline
        heapq.heappush(self.heap, (deadline, next(self.seq), direction, ident, body, h, t_arr, ref, info))

    def _release(self, direction, ident, body, h, t_arr, ref, deadline, info, virtual=False) -> None:
        if info is None:  # an uncharged message that waited behind held ones
            self._send(direction, ident, body)
            return
        now = time.monotonic()
        info["held_s"] = now - ref          # from the start of the air time (marker or arrival) to forwarding
        info["late_s"] = 0.0 if virtual else now - deadline  # against the (lead-adjusted) release time
        try:
            body = list(body)
            body[h] = annotate_header(body[h].bytes, channel=info)
        except (ProtocolError, ValueError) as exc:  # cannot happen for a decoded header; keep serving anyway
            log.warning("could not annotate header from %r: %s", ident, exc)
        self._send(direction, ident, body)
        st = self.stats.setdefault((ident.decode("utf-8", "replace"), direction), _LinkStats())
        st.messages += 1
        st.bytes += info["bytes"]
        st.airtime_s += info["airtime_s"]
        st.queued_s += info["queued_s"]
        st.held_s += info["held_s"]
        st.late_s_sum += info["late_s"]
        st.late_s_max = max(st.late_s_max, info["late_s"])

    def _send(self, direction: str, ident: bytes, body: list) -> None:
        try:
            if direction == "ul":
                self.dealers[ident].send_multipart(body, copy=False)
            else:
                self.frontend.send_multipart([self._route_for_reply(ident, body), *body], copy=False)
        except (zmq.ZMQError, KeyError) as exc:  # the device left (or was reaped) meanwhile
            self.counters["undeliverable"] += 1
            log.info("could not forward to %r (%s): %s", ident, direction, exc)

    def _route_for_reply(self, ident: bytes, body: list) -> bytes:
        """The connection an edge message for `ident` goes to: its holder's; with a claim pending (a second
        connection's `register`), the edge's `registered` moves the name to the claimant, and its refusal ("name
        in use") goes to the claimant, which asked; everything else stays with the holder."""
        route = self.routes.get(ident, ident)
        if ident in self.claims:
            h = 1 if len(body) > 1 and len(body[0]) == 0 else 0
            try:
                header = decode_header(body[h].bytes)
            except (ProtocolError, IndexError):
                header = None
            kind = header.get("type") if header else None
            if kind == REGISTERED:
                route = self.routes[ident] = self.claims.pop(ident)
                self.counters["route_moved"] += 1
                log.info("device %r: registered from another connection; replies go there", ident)
            elif kind == ERROR and "name in use" in str(header.get("message", "")):
                route = self.claims.pop(ident)
        return route

    def _deliver_due(self) -> None:
        while self.heap and self.heap[0][0] <= time.monotonic():
            deadline, _, direction, ident, body, h, t_arr, ref, info = heapq.heappop(self.heap)
            self.held_on_link[(direction, ident)] -= 1
            if direction == "ul" and ident in self.held_bytes:
                self.held_bytes[ident] = max(0, self.held_bytes[ident] - sum(len(f) for f in body))
            self._release(direction, ident, body, h, t_arr, ref, deadline, info)

    # -- control -------------------------------------------------------------------------------------
    def _control_reply(self, frame: zmq.Frame) -> bytes:
        """One control request in, one strict-JSON reply out, whatever the request held."""
        try:
            reply = self._control(frame)
        except Exception as exc:  # noqa: BLE001 - no request may stop the emulator but `stop`
            self.counters["errors"] += 1
            log.warning("control request failed: %s: %s", type(exc).__name__, exc)
            reply = {"ok": False, "error": f"internal error handling the request: {type(exc).__name__}"}
        try:
            return json.dumps(reply, allow_nan=False).encode()
        except ValueError:
            return b'{"ok": false, "error": "reply not encodable"}'

    def _control(self, frame: zmq.Frame) -> dict:
        if self.secure:
            who = check_identity(EDGE_CLIENT, frame)
            if who is not None:
                self.counters["control_refused"] += 1
                self._warn("control", "control_refused", "refused a control request: %s", who)
                return {"ok": False, "error": "only the edge may use the control socket"}
        try:
            msg = decode_header(frame.bytes, max_bytes=MAX_CONTROL_REQUEST_BYTES,
                                max_items=MAX_CONTROL_REQUEST_BYTES // 8)
        except ProtocolError as exc:
            return {"ok": False, "error": f"control request is not JSON (strict, versioned): {exc}"}
        if self.control_token is not None and not hmac.compare_digest(
                str(msg.get("token", "")).encode(), self.control_token.encode()):
            self.counters["control_refused"] += 1
            self._warn("control", "control_token", "refused a control request without the right token")
            return {"ok": False, "error": "control request refused: missing or wrong token"}
        kind = msg.get("type")
        if kind == "configure":
            try:
                cfg = parse_configure(msg)
            except ConfigError as exc:
                return {"ok": False, "error": str(exc)}
            if cfg.pop("mode") is not None:
                self.mode = msg["mode"]
            if self.mode == "virtual":
                # Virtual air time never passes on this clock: a link stays "busy" far past the real time, so
                # each round (one configure) starts with empty queues, or they grow without bound round after
                # round. Queueing within the round (FIFO per link, the shared tdma DL) is still accounted.
                self.free_at = {}
            elif cfg["dl_access"] != self.config["dl_access"]:
                self.free_at = {k: v for k, v in self.free_at.items() if k[0] == "ul"}
            self.config = cfg
            return {"ok": True, "round": cfg["round"], "mode": self.mode}
        if kind == "stats":
            links: dict[str, dict] = {}
            for (name, direction), st in self.stats.items():
                links.setdefault(name, {})[direction] = st.as_dict()
            return {"ok": True, "mode": self.mode, "round": self.config["round"],
                    "dl_access": self.config["dl_access"], "held": len(self.heap),
                    "devices": sorted(i.decode("utf-8", "replace") for i in self.dealers),
                    "registered": len(self.registered), "connections": len(self.conns),
                    "counters": dict(self.counters), "links": links}
        if kind == "stop":
            self.running = False
            return {"ok": True}
        if kind == "reset":
            self._reset()
            return {"ok": True}
        return {"ok": False, "error": f"type={str(kind)[:40]!r} is invalid; allowed: configure, stats, reset, stop"}

    def _reset(self) -> None:
        """A warm pool's next run (`testbed.run.warm`): links, configuration, statistics and counters as a freshly
        started emulator has them; the devices' connections stay."""
        self.mode = self.start_mode
        self.config = {"round": None, "dl_access": "fdma_equal_split", "base_latency_s": 0.0, "links": {},
                       "lead_s": 0.0, "lead_per_byte_s": 0.0}
        self.free_at, self.markers, self.stats = {}, {}, {}
        self.link_release.clear()
        self.counters = dict.fromkeys(self.counters, 0)

    # -- loop ----------------------------------------------------------------------------------------
    def _timeout_ms(self) -> int:
        if not self.heap:
            return 200
        remaining = self.heap[0][0] - time.monotonic() - self.spin_s
        # zmq poll timeouts are whole milliseconds: sleep the floor, then busy-poll (timeout 0) the rest.
        return max(0, int(remaining * 1000.0))

    def run(self) -> None:
        self.running = True
        log.info("channel emulator (%s) serving", self.mode)
        try:
            while self.running:
                self._deliver_due()
                for sock, _ in self.poller.poll(self._timeout_ms()):
                    for _ in range(64):  # drain, but keep checking deadlines between messages
                        if sock.closed:  # a DEALER reaped by a message handled above in this same loop
                            break
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        t_arr = time.monotonic()
                        if sock is self.monitor:
                            self._conn_event(frames)
                            continue
                        if sock is self.control:
                            self.control.send(self._control_reply(frames[0]))
                            break
                        self._guarded(sock, frames, t_arr)
                        self._deliver_due()
                self._check_files()
                self._peer_log.flush(time.monotonic())  # a flood that stopped is still reported
                if self.handshakes is not None:
                    self.handshakes.flush(time.monotonic())
                if time.monotonic() - self._last_reap > min(10.0, self.unregistered_idle_s / 2):
                    self._last_reap = time.monotonic()
                    self._reap(self._last_reap)
        finally:
            self._peer_log.flush(time.monotonic(), force=True)
            self.close()

    def connection_cap(self) -> int:
        """Frontend connections kept: `max_connections` plus one per registered device, up to `max_identities`."""
        return min(self.max_identities, self.max_connections + len(self.registered))

    def _conn_event(self, frames: list) -> None:
        """A frontend monitor event: a connection accepted (its file) or gone."""
        try:
            event, fd = struct.unpack("=Hi", frames[0].bytes[:6])
        except (struct.error, IndexError):
            return
        if self.handshakes is not None:  # fd: a descriptor, or a failed handshake's error code
            self.handshakes.on_event(event, fd, frames[1].bytes if len(frames) > 1 else b"")
        if event == zmq.EVENT_ACCEPTED:
            self.conns[fd] = time.monotonic()
        elif event == zmq.EVENT_DISCONNECTED:
            self.conns.pop(fd, None)

    def _check_files(self) -> None:
        """At most every 50 ms: over the connection cap (by the monitor's count, which may lose events under a
        flood, or by this process's open files past 60 % of its limit), shut the idlest connections down."""
        now = time.monotonic()
        if now - self._files_checked < 0.05:
            return
        self._files_checked = now
        over = len(self.conns) > self.connection_cap()
        if not over and self.files is not None:
            try:
                over = len(os.listdir("/proc/self/fd")) > 0.5 * self.files
            except OSError:
                pass
        if over:
            self._reap_connections()

    def _frontend_fds(self) -> list[int]:
        """This process's files that are frontend connections (Linux: /proc/self/fd), the monitor's too."""
        try:
            fds = {int(f) for f in os.listdir("/proc/self/fd")}
        except OSError:
            return list(self.conns)
        return sorted(fds | set(self.conns))

    def _reap_connections(self) -> None:
        """Over `max_connections` frontend connections (a flood of identities that connect and stay): shut the
        idlest down to 90 % of the cap, so that the process keeps files for an honest newcomer (ZeroMQ cannot
        accept a connection, nor open its DEALER, without one). A connection older than CONN_PROTECT_AGE_S that
        carried data within CONN_ACTIVE_S (a device that heartbeats) goes last; a fresh one that is idle, or
        one idle for long, first. Only tcp connections (an ipc frontend is reached by local processes only)."""
        if self.frontend_port is None:
            return
        now, ranked = time.monotonic(), []
        for fd in self._frontend_fds():
            got = tcp_idle_s(fd)
            if got is None or got[1] != self.frontend_port:
                self.conns.pop(fd, None)  # closed meanwhile (its event is on the way), or the file was reused
                continue
            idle, accepted = got[0], self.conns.setdefault(fd, now)
            ranked.append((now - accepted >= CONN_PROTECT_AGE_S and idle < CONN_ACTIVE_S, -idle, fd))
        ranked.sort()
        cap = self.connection_cap()
        excess = len(ranked) - int(0.9 * cap)
        shut = 0
        for _, _, fd in ranked[:max(0, excess)]:
            if shut_down(fd, self.frontend_port):
                shut += 1
            self.conns.pop(fd, None)
        if shut:
            self.counters["connections_shut"] += shut
            self._warn("(frontend)", "connections_shut", "%d frontend connections over the cap of %d: shut the "
                       "idlest down", len(ranked), cap)

    def _guarded(self, sock: zmq.Socket, frames: list, t_arr: float) -> None:
        """Handle one message; whatever it holds, the emulator keeps serving (one log line per failure)."""
        try:
            if sock is self.frontend:
                self._from_frontend(frames, t_arr)
            elif sock in self.dealer_ident:
                self._handle("dl", self.dealer_ident[sock], frames, t_arr)
        except Exception as exc:  # noqa: BLE001 - a message must never stop the emulator
            self.counters["errors"] += 1
            self._warn("(any)", "errors", "dropped a message that failed to forward: %s: %s",
                       type(exc).__name__, exc)

    def close(self) -> None:
        try:
            self.frontend.disable_monitor()
        except zmq.ZMQError:
            pass
        for sock in [self.monitor, self.frontend, self.control, *self.dealers.values()]:
            sock.close(linger=0)
        if self._own_ctx:
            stop_authenticators(self.ctx)
            self.ctx.term()


def run_proxy(frontend_bind: str, edge_connect: str, control_bind: str, mode: str = "real",
              spin_s: float = DEFAULT_SPIN_S, marker_ttl_s: float = 5.0, log_level: str | None = None,
              keys_dir: str | None = None, control_token: str | None = None,
              unregistered_idle_s: float = UNREGISTERED_IDLE_S, expect_devices: int = 0) -> None:
    """Blocking: serve until a ``stop`` control request. Usable as a multiprocessing/subprocess target.
    The control token defaults to the environment's ``MULTISPIN_CHANNEL_TOKEN`` (unset: none required)."""
    if log_level:
        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = control_token if control_token is not None else os.environ.get(TOKEN_ENV) or None
    fd_limit(raise_soft=True)  # a process of its own: as many identities as the host allows, up to MAX_IDENTITIES
    ChannelProxy(frontend_bind, edge_connect, control_bind, mode=mode, spin_s=spin_s,
                 marker_ttl_s=marker_ttl_s, keys_dir=keys_dir, control_token=token,
                 unregistered_idle_s=unregistered_idle_s, expect_devices=expect_devices).run()


class ChannelControl:
    """Client of the emulator's control socket (REQ with a timeout; the socket is rebuilt after one, and
    after a request cut short by anything else, e.g. a signal while waiting for the reply).

    `gone`: optional callable saying why the emulator's process is gone (None while it runs); a request
    waiting for its reply asks it every `GONE_CHECK_MS`, so an emulator killed mid-request ends the wait
    at once rather than after the whole timeout."""

    GONE_CHECK_MS = 50

    def __init__(self, endpoint: str, timeout_s: float = 5.0, context: zmq.Context | None = None,
                 keys: ClientKeys | None = None, token: str | None = None, gone=None):
        self.endpoint, self.timeout_ms = endpoint, int(timeout_s * 1000)
        self.ctx = context or zmq.Context.instance()
        self.keys, self.token, self.gone = keys, token, gone
        self.sock = None
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        make_client(self.sock, self.keys)
        self.sock.connect(self.endpoint)

    def request(self, msg: dict) -> dict:
        if self.token is not None:
            msg = {**msg, "token": self.token}
        try:
            # versioned, strict JSON (a NaN is refused here, not there)
            self.sock.send(encode_header(msg, max_bytes=MAX_CONTROL_REQUEST_BYTES))
            raw = self._reply(msg)
        except zmq.Again:
            self._connect()  # a REQ socket is stuck after a lost reply ("lazy pirate")
            raise TimeoutError(f"channel emulator at {self.endpoint} did not answer "
                               f"{msg.get('type')!r} within {self.timeout_ms} ms") from None
        except BaseException:
            # Cut short (SIGTERM during recv): the REQ socket would refuse the next send (EFSM), e.g. the
            # stats the run asks for while stopping.
            self._connect()
            raise
        try:  # the reply is peer input too: strict and bounded, like every header
            reply = parse_json(raw, what="control reply", max_bytes=MAX_CONTROL_REPLY_BYTES,
                               max_items=MAX_CONTROL_REPLY_BYTES // 8)
        except ProtocolError as exc:
            raise RuntimeError(f"channel emulator sent an invalid reply to {msg.get('type')!r}: {exc}") from None
        if not isinstance(reply, dict):
            raise RuntimeError(f"channel emulator sent a non-object reply to {msg.get('type')!r}")
        if not reply.get("ok"):
            raise RuntimeError(f"channel emulator refused {msg.get('type')!r}: {reply.get('error')}")
        return reply

    def _reply(self, msg: dict) -> bytes:
        if self.gone is None:
            return self.sock.recv()  # RCVTIMEO bounds it
        deadline = time.monotonic() + self.timeout_ms / 1000
        while not self.sock.poll(max(1, min(self.GONE_CHECK_MS, int((deadline - time.monotonic()) * 1000)))):
            why = self.gone()
            if why is not None:
                raise TimeoutError(f"channel emulator at {self.endpoint} {why} while asked {msg.get('type')!r}")
            if time.monotonic() >= deadline:
                raise zmq.Again()
        return self.sock.recv()

    def configure(self, round: int | None = None, links: dict | None = None, dl_access: str = "fdma_equal_split",
                  base_latency_s: float = 0.0, mode: str | None = None, lead_s: float = 0.0,
                  lead_per_byte_s: float = 0.0) -> dict:
        msg = {"type": "configure", "round": round, "dl_access": dl_access, "base_latency_s": base_latency_s,
               "links": links or {}, "lead_s": lead_s, "lead_per_byte_s": lead_per_byte_s}
        if mode is not None:
            msg["mode"] = mode
        return self.request(msg)

    def stats(self) -> dict:
        return self.request({"type": "stats"})

    def stop(self) -> dict:
        return self.request({"type": "stop"})

    def reset(self) -> dict:
        """Statistics, counters and links as a fresh emulator's (the next run of a warm pool)."""
        return self.request({"type": "reset"})

    def close(self) -> None:
        self.sock.close(linger=0)


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="python -m channel_emulator.proxy",
                                          description="Run the channel emulator (a ZeroMQ forwarder).")
    p.add_argument("--frontend", required=True, help="bind endpoint for devices, e.g. tcp://0.0.0.0:5600")
    p.add_argument("--edge", required=True, help="the edge ROUTER to connect to, e.g. tcp://edge-host:5555")
    p.add_argument("--control", required=True, help="bind endpoint of the control REP, e.g. tcp://0.0.0.0:5601")
    p.add_argument("--mode", choices=MODES, default="real", help="real: hold messages; virtual: annotate only")
    p.add_argument("--spin-s", type=float, default=DEFAULT_SPIN_S, help="busy-wait window before a deadline (s)")
    p.add_argument("--marker-ttl-s", type=float, default=5.0, help="ignore tx_start markers older than this")
    p.add_argument("--unregistered-idle-s", type=float, default=UNREGISTERED_IDLE_S,
                   help="close the DEALER of an identity the edge never registered after this long idle (s)")
    p.add_argument("--keys", default=None,
                   help="key directory (multispin keys generate): CURVE on the frontend, control and edge links")
    p.add_argument("--expect-devices", type=int, default=0,
                   help="devices of the run: the identity caps grow to hold them all, registering at once")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_proxy(args.frontend, args.edge, args.control, mode=args.mode, spin_s=args.spin_s,
              marker_ttl_s=args.marker_ttl_s, keys_dir=args.keys, unregistered_idle_s=args.unregistered_idle_s,
              expect_devices=args.expect_devices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
