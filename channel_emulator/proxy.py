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

The ``channel`` annotation: ``bytes`` (all frames of the message body), ``rate_bps`` (null: not charged),
``airtime_s`` = 8 bytes / rate, ``base_latency_s``, ``queued_s`` (waiting for the link), ``held_s`` (from the
start of the air time, i.e. the marker's or the message's arrival, to forwarding), ``late_s`` (forwarding time
minus the release time; >= 0 in real mode, 0 in virtual mode), ``lead_s`` (released this much before the
modeled deadline), ``mode``, ``link`` ("ul"/"dl"), ``round``, ``dl_access``, ``marker`` (a tx_start marker
started the air time). In real mode held_s = queued_s + airtime_s + base_latency_s - lead_s + late_s.

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
import itertools
import json
import logging
import sys
import time
from typing import Any

import zmq

from channel_emulator import DEFAULT_SPIN_S
from channel_emulator.checks import DL_ACCESS, finite_number
from testbed.wire.protocol import TX_START, ProtocolError, annotate_header, decode_header

log = logging.getLogger("channel_emulator.proxy")

MODES = ("real", "virtual")
SHARED_DL = "*tdma*"  # the link key of the one shared DL link under tdma


class ConfigError(ValueError):
    pass


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
    return {"round": msg.get("round"), "dl_access": dl_access, "base_latency_s": base, "links": out_links,
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
                 spin_s: float = DEFAULT_SPIN_S, marker_ttl_s: float = 5.0, context: zmq.Context | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid; allowed: {', '.join(MODES)}")
        if not (0 <= spin_s < 1):
            raise ValueError(f"spin_s={spin_s!r} is invalid; allowed: 0 <= spin_s < 1")
        self.mode, self.spin_s, self.marker_ttl_s = mode, float(spin_s), float(marker_ttl_s)
        self.edge_connect = edge_connect
        self.ctx = context or zmq.Context()
        self._own_ctx = context is None
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.setsockopt(zmq.SNDHWM, 0)
        self.frontend.setsockopt(zmq.RCVHWM, 0)
        self.frontend.bind(frontend_bind)
        self.control = self.ctx.socket(zmq.REP)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(control_bind)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        self.dealers: dict[bytes, zmq.Socket] = {}
        self.dealer_ident: dict[zmq.Socket, bytes] = {}
        self.config = {"round": None, "dl_access": "fdma_equal_split", "base_latency_s": 0.0, "links": {},
                       "lead_s": 0.0, "lead_per_byte_s": 0.0}
        self.free_at: dict[tuple[str, bytes | str], float] = {}
        self.markers: dict[tuple[str, bytes], float] = {}
        self.heap: list = []
        self.seq = itertools.count()
        self.stats: dict[tuple[str, str], _LinkStats] = {}
        self.counters = {"passed": 0, "charged": 0, "markers": 0, "stale_markers": 0, "malformed": 0,
                         "refused_identity": 0, "unconfigured": 0, "unknown_peer": 0}
        self.running = False

    # -- sockets -------------------------------------------------------------------------------------
    def _dealer_for(self, ident: bytes) -> zmq.Socket | None:
        sock = self.dealers.get(ident)
        if sock is None:
            if not ident or ident[0] == 0:
                # ZeroMQ reserves identities starting with a zero byte (auto-generated ones): the device did
                # not set routing_id, so the edge could not address it by name.
                self.counters["refused_identity"] += 1
                log.warning("refusing peer without routing_id (identity %r); devices must set routing_id", ident)
                return None
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, ident)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.edge_connect)
            self.dealers[ident] = sock
            self.dealer_ident[sock] = ident
            self.poller.register(sock, zmq.POLLIN)
            log.info("device %r: opened DEALER to %s", ident, self.edge_connect)
        return sock

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
        if header is None or header.get("air") not in ("ul", "dl"):
            self.counters["passed"] += 1
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
            heapq.heappush(self.heap, (deadline, next(self.seq), direction, ident, body, h, t_arr, ref, info))

    def _release(self, direction, ident, body, h, t_arr, ref, deadline, info, virtual=False) -> None:
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
        if direction == "ul":
            self.dealers[ident].send_multipart(body, copy=False)
        else:
            self.frontend.send_multipart([ident, *body], copy=False)

    def _deliver_due(self) -> None:
        while self.heap and self.heap[0][0] <= time.monotonic():
            deadline, _, direction, ident, body, h, t_arr, ref, info = heapq.heappop(self.heap)
            self._release(direction, ident, body, h, t_arr, ref, deadline, info)

    # -- control -------------------------------------------------------------------------------------
    def _control(self, raw: bytes) -> dict:
        try:
            msg = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return {"ok": False, "error": f"control request is not JSON: {exc}"}
        if not isinstance(msg, dict):
            return {"ok": False, "error": "control request is not a JSON object"}
        kind = msg.get("type")
        if kind == "configure":
            try:
                cfg = parse_configure(msg)
            except ConfigError as exc:
                return {"ok": False, "error": str(exc)}
            if cfg.pop("mode") is not None:
                self.mode = msg["mode"]
            if cfg["dl_access"] != self.config["dl_access"]:
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
        return {"ok": False, "error": f"type={kind!r} is invalid; allowed: configure, stats, stop"}

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
                            self.control.send(json.dumps(self._control(frames[0].bytes)).encode())
                            break
                        if sock is self.frontend:
                            self._handle("ul", frames[0].bytes, frames[1:], t_arr)
                        else:
                            self._handle("dl", self.dealer_ident[sock], frames, t_arr)
                        self._deliver_due()
        finally:
            self.close()

    def close(self) -> None:
        for sock in [self.frontend, self.control, *self.dealers.values()]:
            sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()


def run_proxy(frontend_bind: str, edge_connect: str, control_bind: str, mode: str = "real",
              spin_s: float = DEFAULT_SPIN_S, marker_ttl_s: float = 5.0, log_level: str | None = None) -> None:
    """Blocking: serve until a ``stop`` control request. Usable as a multiprocessing/subprocess target."""
    if log_level:
        logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ChannelProxy(frontend_bind, edge_connect, control_bind, mode=mode, spin_s=spin_s,
                 marker_ttl_s=marker_ttl_s).run()


class ChannelControl:
    """Client of the emulator's control socket (REQ with a timeout; the socket is rebuilt after one)."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0, context: zmq.Context | None = None):
        self.endpoint, self.timeout_ms = endpoint, int(timeout_s * 1000)
        self.ctx = context or zmq.Context.instance()
        self.sock = None
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self.sock.connect(self.endpoint)

    def request(self, msg: dict) -> dict:
        try:
            self.sock.send(json.dumps(msg).encode())
            reply = json.loads(self.sock.recv())
        except zmq.Again:
            self._connect()  # a REQ socket is stuck after a lost reply ("lazy pirate")
            raise TimeoutError(f"channel emulator at {self.endpoint} did not answer "
                               f"{msg.get('type')!r} within {self.timeout_ms} ms") from None
        if not reply.get("ok"):
            raise RuntimeError(f"channel emulator refused {msg.get('type')!r}: {reply.get('error')}")
        return reply

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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_proxy(args.frontend, args.edge, args.control, mode=args.mode, spin_s=args.spin_s,
              marker_ttl_s=args.marker_ttl_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
