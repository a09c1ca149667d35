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
in every control request. Every message is handled under a guard (a bad one is dropped with one log line),
identities are capped (least recently used idle ones are closed first) and rate-limited, and a message that
is not charged waits behind the held messages of its own link, so one link's messages stay in order (but a
``heartbeat``, which carries no state, overtakes them: a long held verdict must not make its peer look dead).

Control (REP at ``control_bind``), JSON requests, JSON replies with ``"ok"``:
    {"type": "configure", "round": r, "dl_access": ..., "base_latency_s": ...,
     "links": {"<device>": {"ul_rate_bps": x | null, "dl_rate_bps": y | null}},   (null: not charged)
     "lead_s": a, "lead_per_byte_s": b, "mode": "real"|"virtual"}                  (optional)
``lead_s + lead_per_byte_s * bytes`` is released before the deadline: the calibrated transport time of the
hops outside the emulator (measure it with ``multispin channel validate``); 0 by default.
    {"type": "stats"}   {"type": "stop"}
"""

from __future__ import annotations

import argparse
import heapq
import hmac
import itertools
import json
import logging
import os
import sys
import time
from collections import defaultdict
from typing import Any

import zmq

from channel_emulator import DEFAULT_SPIN_S
from channel_emulator.checks import DL_ACCESS, finite_number
from testbed.core.vocabulary import DIRECTIONS
from testbed.runtime.security import (
    CHANNEL_CLIENT,
    EDGE_CLIENT,
    ClientKeys,
    LogThrottle,
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
from testbed.wire.protocol import (
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
# Open files per identity: the device's connection to the frontend, its DEALER's connection and mailbox. ZeroMQ
# aborts the process when it runs out of files, so the cap must fit the process's limit (ulimit -n, often 1024).
FDS_PER_IDENTITY = 3
FD_RESERVE = 64          # listeners, the control socket, ZeroMQ's own threads, the log, Python
LOG_BURST = 20           # warnings about peers' messages a second; the rest are counted (a flood must not fill a disk)
MAX_MSGS_PER_S = 2000.0  # per identity, averaged over a one-second burst
MAX_CONTROL_REPLY_BYTES = 16 * 1024 * 1024  # stats of many links; still bounded


def _header(frames: list) -> dict | None:
    """A device message's header (after the routing frame), or None if it is not one."""
    try:
        return decode_header(frames[1].bytes)
    except (ProtocolError, IndexError):
        return None


class ConfigError(ValueError):
    pass


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
                 max_msgs_per_s: float = MAX_MSGS_PER_S):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid; allowed: {', '.join(MODES)}")
        if not (0 <= spin_s < 1):
            raise ValueError(f"spin_s={spin_s!r} is invalid; allowed: 0 <= spin_s < 1")
        self.mode, self.spin_s, self.marker_ttl_s = mode, float(spin_s), float(marker_ttl_s)
        self.edge_connect = edge_connect
        self.ctx = context or zmq.Context()
        self._own_ctx = context is None
        self.secure = keys_dir is not None
        server_keys = ServerKeys.load(keys_dir) if keys_dir else None
        self.edge_keys = ClientKeys.for_name(keys_dir, CHANNEL_CLIENT) if keys_dir else None
        self.control_token = control_token
        self.max_identities, self.idle_reap_s = int(max_identities), float(idle_reap_s)
        files = fd_limit()
        if identity_budget(self.max_identities, files) < self.max_identities:
            self.max_identities = identity_budget(self.max_identities, files)
            log.warning("identities capped at %d: this process may open %d files (ulimit -n), %d per identity",
                        self.max_identities, files, FDS_PER_IDENTITY)
        self.limiter = RateLimiter(max_msgs_per_s)  # per identity; the same limit as the edge's
        self.max_msgs_per_s = self.limiter.rate
        self.frontend = self.ctx.socket(zmq.ROUTER)
        # The edge's hardening, with the edge's own message limit (what passes here the edge would accept) and
        # no high-water marks: a message held for its air time must never be dropped for a full queue.
        harden_router(self.frontend, max_msg_bytes=max_message_bytes(), hwm=0)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone device raises, it is not lost silently
        make_server(self.frontend, server_keys)
        self.frontend.bind(frontend_bind)
        self.control = self.ctx.socket(zmq.REP)
        self.control.setsockopt(zmq.LINGER, 0)
        make_server(self.control, server_keys)
        self.control.bind(control_bind)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        self.dealers: dict[bytes, zmq.Socket] = {}
        self.routes: dict[bytes, bytes] = {}  # with CURVE: a device's name -> its connection's routing identity
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
                         "heartbeat_overtook": 0}
        self.held_on_link: dict[tuple[str, bytes], int] = defaultdict(int)   # held messages per (dir, device)
        self.link_release: dict[tuple[str, bytes], float] = {}               # latest held deadline per link
        self.last_seen: dict[bytes, float] = {}
        self._last_reap = time.monotonic()
        self._peer_log = LogThrottle(log, LOG_BURST, "warnings about peers' messages")
        self.running = False

    # -- sockets -------------------------------------------------------------------------------------
    def _dealer_for(self, ident: bytes) -> zmq.Socket | None:
        sock = self.dealers.get(ident)
        if sock is None:
            if not ident or ident[0] == 0:
                # ZeroMQ reserves identities starting with a zero byte (auto-generated ones): the device did
                # not set routing_id, so the edge could not address it by name.
                self.counters["refused_identity"] += 1
                self._warn("refusing peer without routing_id (identity %r); devices must set routing_id", ident)
                return None
            if len(self.dealers) >= self.max_identities and not self._reap(time.monotonic(), need_one=True):
                self.counters["identity_cap"] += 1
                self._warn("refusing identity %r: %d identities are open (cap)", ident, len(self.dealers))
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
            log.info("device %r: opened DEALER to %s", ident, self.edge_connect)
        return sock

    def _reap(self, now: float, need_one: bool = False) -> bool:
        """Close DEALERs of identities idle past `idle_reap_s` (or, with `need_one`, the least recently
        used idle one) that hold no message. Returns whether one was closed."""
        idle = sorted((t, i) for i, t in self.last_seen.items()
                      if i in self.dealers and not self.held_on_link[("ul", i)] and not self.held_on_link[("dl", i)])
        victims = [i for t, i in idle if now - t > self.idle_reap_s] or ([idle[0][1]] if need_one and idle else [])
        for ident in victims:
            sock = self.dealers.pop(ident)
            self.dealer_ident.pop(sock, None)
            self.poller.unregister(sock)
            sock.close(linger=0)
            self._forget(ident)
            self.counters["reaped"] += 1
            log.info("device %r: closed its idle DEALER", ident)
        return bool(victims)

    def _forget(self, ident: bytes) -> None:
        """Drop what is kept per identity (it holds no message): a stream of new identities must not grow the
        emulator, nor its `stats` reply (the edge reads it every heartbeat). A configured link keeps its stats."""
        self.last_seen.pop(ident, None)
        self.routes.pop(ident, None)
        self.limiter.forget(ident)
        for direction in DIRECTIONS:
            for table in (self.held_on_link, self.link_release, self.markers, self.free_at):
                table.pop((direction, ident), None)
        name = ident.decode("utf-8", "replace")
        if name not in self.config["links"]:
            self.stats.pop((name, "ul"), None)
            self.stats.pop((name, "dl"), None)

    def _warn(self, msg: str, *args) -> None:
        """A warning about a peer's message, at most LOG_BURST a second (the rest are counted, then said)."""
        self._peer_log.warn(time.monotonic(), "other", msg, *args)

    def _within_rate(self, ident: bytes, now: float) -> bool:
        """Token bucket per identity (`security.RateLimiter`): `max_msgs_per_s`, bursts of one second's."""
        ok = self.limiter.allow(ident, now)
        if not ok:
            self.counters["rate_limited"] += 1
            if self.counters["rate_limited"] % 1000 == 1:
                log.warning("device %r: over %.0f messages/s; dropping", ident, self.max_msgs_per_s)
        return ok

    def _from_frontend(self, frames: list, t_arr: float) -> None:
        ident = frames[0].bytes
        if self.secure and len(frames) > 1:
            # The device is the name its key is bound to, whatever routing identity its connection chose: a
            # listed key that connected first under another device's name holds nothing of that device's.
            name = sender_name(frames[1])
            if not name:
                self.counters["refused_identity"] += 1
                self._warn("dropped a message from identity %r: no authenticated name", ident)
                return
            key = name.encode()
            if self.routes.get(key, key) != ident and (key not in self.routes or claims_route(name, _header(frames))):
                self.routes[key] = ident  # replies to the name go to the connection that last registered it
            ident = key
        if not self._within_rate(ident, t_arr):
            return
        self.last_seen[ident] = t_arr
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
                self.frontend.send_multipart([self.routes.get(ident, ident), *body], copy=False)
        except (zmq.ZMQError, KeyError) as exc:  # the device left (or was reaped) meanwhile
            self.counters["undeliverable"] += 1
            log.info("could not forward to %r (%s): %s", ident, direction, exc)

    def _deliver_due(self) -> None:
        while self.heap and self.heap[0][0] <= time.monotonic():
            deadline, _, direction, ident, body, h, t_arr, ref, info = heapq.heappop(self.heap)
            self.held_on_link[(direction, ident)] -= 1
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
                self._warn("refused a control request: %s", who)
                return {"ok": False, "error": "only the edge may use the control socket"}
        try:
            msg = decode_header(frame.bytes)
        except ProtocolError as exc:
            return {"ok": False, "error": f"control request is not JSON (strict, versioned): {exc}"}
        if self.control_token is not None and not hmac.compare_digest(
                str(msg.get("token", "")).encode(), self.control_token.encode()):
            self.counters["control_refused"] += 1
            self._warn("refused a control request without the right token")
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
                    "counters": dict(self.counters), "links": links}
        if kind == "stop":
            self.running = False
            return {"ok": True}
        return {"ok": False, "error": f"type={str(kind)[:40]!r} is invalid; allowed: configure, stats, stop"}

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
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        t_arr = time.monotonic()
                        if sock is self.control:
                            self.control.send(self._control_reply(frames[0]))
                            break
                        self._guarded(sock, frames, t_arr)
                        self._deliver_due()
                self._peer_log.flush(time.monotonic())  # a flood that stopped is still reported
                if time.monotonic() - self._last_reap > 10.0:
                    self._last_reap = time.monotonic()
                    self._reap(self._last_reap)
        finally:
            self.close()

    def _guarded(self, sock: zmq.Socket, frames: list, t_arr: float) -> None:
        """Handle one message; whatever it holds, the emulator keeps serving (one log line per failure)."""
        try:
            if sock is self.frontend:
                self._from_frontend(frames, t_arr)
            elif sock in self.dealer_ident:
                self._handle("dl", self.dealer_ident[sock], frames, t_arr)
        except Exception as exc:  # noqa: BLE001 - a message must never stop the emulator
            self.counters["errors"] += 1
            self._warn("dropped a message that failed to forward: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        for sock in [self.frontend, self.control, *self.dealers.values()]:
            sock.close(linger=0)
        if self._own_ctx:
            stop_authenticators(self.ctx)
            self.ctx.term()


def run_proxy(frontend_bind: str, edge_connect: str, control_bind: str, mode: str = "real",
              spin_s: float = DEFAULT_SPIN_S, marker_ttl_s: float = 5.0, log_level: str | None = None,
              keys_dir: str | None = None, control_token: str | None = None) -> None:
    """Blocking: serve until a ``stop`` control request. Usable as a multiprocessing/subprocess target.
    The control token defaults to the environment's ``MULTISPIN_CHANNEL_TOKEN`` (unset: none required)."""
    if log_level:
        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = control_token if control_token is not None else os.environ.get(TOKEN_ENV) or None
    fd_limit(raise_soft=True)  # a process of its own: as many identities as the host allows, up to MAX_IDENTITIES
    ChannelProxy(frontend_bind, edge_connect, control_bind, mode=mode, spin_s=spin_s,
                 marker_ttl_s=marker_ttl_s, keys_dir=keys_dir, control_token=token).run()


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
            self.sock.send(encode_header(msg))  # versioned, strict JSON (a NaN is refused here, not there)
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
    p.add_argument("--keys", default=None,
                   help="key directory (multispin keys generate): CURVE on the frontend, control and edge links")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_proxy(args.frontend, args.edge, args.control, mode=args.mode, spin_s=args.spin_s,
              marker_ttl_s=args.marker_ttl_s, keys_dir=args.keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
