"""Refused CURVE handshakes, said on both sides (ZeroMQ socket monitor events).

A peer whose handshake fails never delivers a message: without this, the edge logs nothing and the device only
times out. `ServerHandshakeWatch` (the edge's ROUTER) logs each refusing peer's address and why, within a
second of its first refusal and then once per `interval_s` with a count (a peer that retries must not flood
the log). `ClientHandshakeWatch` (a device's DEALER) tells the device why the edge did not answer: no keys,
an unlisted key, or a server key that is not the edge's.

The peer's address: a monitor event names the bound endpoint only (libzmq 4.3 without the draft API), so the
address is read from the accepted connection's file descriptor when `EVENT_ACCEPTED` comes (a connection
already closed by then is logged as "an address not caught"). A failure event is followed by the
`EVENT_DISCONNECTED` of its connection (libzmq's I/O thread emits both in turn), which names the descriptor."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

FAILED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
SERVER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | FAILED_EVENTS | zmq.EVENT_MONITOR_STOPPED
LOG_INTERVAL_S = 5.0  # one line per refusing peer per interval after its first
UNKNOWN_ADDRESS = "an address not caught"
KEYS_HINT = ("start the device with --keys DIR: the folder `multispin keys generate --out KEYS --devices NAME` "
             "wrote for it (KEYS/clients/NAME/), copied from the edge host")


def server_reason(event: int, value: int) -> tuple[str, str]:
    """(tag, what it means) of a handshake failure seen by a CURVE server."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "unlisted_key", "its CURVE key is not among the authorized keys (or not admitted on this socket)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no_keys", "it has no CURVE keys (a plain client) and this socket requires them"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "wrong_server_key", "its server key is not this edge's (keys from another `keys generate`?)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # it saw the mismatch first and hung up (value: errno)
        return "hung_up", ("it hung up during the CURVE handshake: it has no CURVE keys, or its bundle is from "
                           "another key directory")
    return "handshake", f"the CURVE handshake failed ({zmq.Event(event).name}, {value:#x})"


def client_reason(event: int, value: int, has_keys: bool = True) -> str:
    """What a device should be told when its handshake with the edge fails (`has_keys`: whether it has any)."""
    mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    if mismatch or (not has_keys and event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):  # (the edge hung up first)
        return "the edge requires CURVE keys and this device has none: " + KEYS_HINT
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the edge refused this device's CURVE key (not among its authorized keys): use the bundle the edge "
                "host's current `multispin keys generate` wrote for this name (KEYS/clients/NAME/)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the edge hung up mid-handshake (value: errno, EPIPE)
        return ("the edge hung up during the CURVE handshake: the server key in this device's --keys is not the "
                "edge's (a bundle from another `keys generate`?), or the edge runs without keys (drop --keys)")
    return f"the handshake with the edge failed ({zmq.Event(event).name}, {value:#x})"


@dataclass
class _Peer:
    first: float
    logged_at: float
    unlogged: Counter = field(default_factory=Counter)  # reason tag -> refusals since the last line


class ServerHandshakeWatch:
    """Logs the refused handshakes of a CURVE server socket (call before or after bind; `close` before the
    socket closes). `refusals`: (address, tag) -> count, for callers and tests.

    A socket has one monitor: an owner that monitors the socket itself (the channel emulator's frontend) passes
    `sock=None`, adds `SERVER_EVENTS` to its own monitor's and hands each event to `on_event`, and calls
    `flush` from its loop; no thread is started then."""

    def __init__(self, sock: zmq.Socket | None, logger: logging.Logger, what: str = "edge",
                 interval_s: float = LOG_INTERVAL_S):
        self.log, self.what, self.interval_s = logger, what, interval_s
        self.sock = sock
        self.refusals: Counter[tuple[str, str]] = Counter()
        self._addresses: dict[int, str] = {}  # fd -> address of an accepted connection
        self._failed: tuple[int, int] | None = None  # the failure waiting for its connection's disconnect
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._thread = None
        if sock is not None:
            self._mon = sock.get_monitor_socket(SERVER_EVENTS)
            self._thread = threading.Thread(target=self._run, name=f"{what}-handshakes", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                if self._mon.poll(250):
                    msg = recv_monitor_message(self._mon)
                    if msg["event"] == zmq.EVENT_MONITOR_STOPPED:
                        break
                    self.on_event(msg["event"], msg["value"], msg["endpoint"])
                self.flush(time.monotonic())
            except zmq.ZMQError:  # the context is going away
                break
        self.flush(float("inf"))
        self._mon.close(linger=0)

    def on_event(self, event: int, value: int, endpoint: bytes = b"") -> None:
        """One monitor event of the socket (`endpoint`: the bound endpoint the event names)."""
        if event == zmq.EVENT_ACCEPTED:
            self._addresses[value] = peer_of_fd(value)
        elif event & FAILED_EVENTS:
            if self._failed is not None:  # a failure whose disconnect never came: its address is unknown
                self.refused(UNKNOWN_ADDRESS, *self._failed)
            self._failed = (event, value)
        elif event == zmq.EVENT_DISCONNECTED:
            address = self._addresses.pop(value, UNKNOWN_ADDRESS)
            if address == UNKNOWN_ADDRESS:  # closed before its descriptor was read: the kernel still knows it
                address = closing_peer(endpoint.decode("utf-8", "replace"))
            if self._failed is not None:
                self.refused(address, *self._failed)
                self._failed = None

    def refused(self, address: str, event: int, value: int, now: float | None = None) -> None:
        """Count one refused handshake of `address`; the first of a peer is logged at once."""
        now = time.monotonic() if now is None else now
        tag, meaning = server_reason(event, value)
        with self._lock:
            self.refusals[(address, tag)] += 1
            peer = self._peers.get(address)
            if peer is None:
                self._peers[address] = _Peer(now, now)
                self.log.warning("%s: refused a CURVE handshake from %s: %s (%s)", self.what, address, meaning,
                                 _fix(tag))
            else:
                peer.unlogged[tag] += 1

    def flush(self, now: float) -> None:
        """One line per peer whose interval is over, with what it was refused since; quiet peers are forgotten."""
        with self._lock:
            for address, peer in list(self._peers.items()):
                if now - peer.logged_at < self.interval_s:
                    continue
                if not peer.unlogged:
                    del self._peers[address]
                    continue
                self.log.warning("%s: refused %d more CURVE handshakes from %s in %.1f s (%s)", self.what,
                                 peer.unlogged.total(), address, min(now, peer.logged_at + self.interval_s)
                                 - peer.logged_at, ", ".join(f"{k}: {v}" for k, v in peer.unlogged.items()))
                peer.logged_at, peer.unlogged = now, Counter()

    def close(self) -> None:
        if self._thread is None:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=2.0)


def _fix(tag: str) -> str:
    return {"no_keys": "the device needs --keys DIR, its bundle from `multispin keys generate`",
            "unlisted_key": "give the device its bundle from this edge's key directory, or regenerate the keys "
                            "with its name",
            "wrong_server_key": "the device's bundle must come from this edge's key directory",
            "hung_up": "give the device --keys DIR, its bundle from this edge's key directory"}.get(
                tag, "check the peer's keys")


def peer_of_fd(fd: int) -> str:
    """The remote host of the connected socket `fd` (its port left out: a peer that retries comes from a new
    port each time, and is one peer), or UNKNOWN_ADDRESS when it is gone."""
    try:
        dup = os.dup(fd)  # a socket object of our own: closing it leaves ZeroMQ's descriptor open
    except OSError:
        return UNKNOWN_ADDRESS
    try:
        sock = socket.socket(fileno=dup)  # the family is read from the descriptor
    except OSError:  # no longer a socket (closed and reused)
        os.close(dup)
        return UNKNOWN_ADDRESS
    try:
        with sock:
            name = sock.getpeername()
    except OSError:
        return UNKNOWN_ADDRESS
    if isinstance(name, tuple) and len(name) >= 2:
        return str(name[0])
    return f"ipc:{name or '(unnamed peer)'}"


# TCP states of a connection this host closed moments ago (FIN_WAIT1, FIN_WAIT2, TIME_WAIT, CLOSING, LAST_ACK)
_CLOSING_STATES = {"04", "05", "06", "0B", "09"}


def closing_peer(endpoint: str) -> str:
    """The host of the connections to `endpoint`'s port that are closing (Linux /proc/net/tcp*): the refused
    peer whose descriptor was gone before it was read. 'HOST' when one host, 'one of A, B' when several."""
    port = endpoint.rpartition(":")[2]
    if not endpoint.startswith("tcp://") or not port.isdigit():
        return UNKNOWN_ADDRESS
    hosts = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and int(cols[1].rpartition(":")[2], 16) == int(port) and cols[3] in _CLOSING_STATES:
                hosts.add(_host(cols[2].partition(":")[0], width))
    hosts.discard(None)
    if not hosts:
        return UNKNOWN_ADDRESS
    return next(iter(hosts)) if len(hosts) == 1 else "one of " + ", ".join(sorted(hosts))


def _host(hex_address: str, width: int) -> str | None:
    """An address of /proc/net/tcp (little-endian 32-bit words in hex) as text."""
    try:
        raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, width, 8))
        if width == 32 and raw[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped
            raw = raw[12:]
        return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
    except (ValueError, OSError):
        return None


class ClientHandshakeWatch:
    """The handshake failures of a client socket, read when the client wonders why nobody answers (no thread:
    the events wait in the monitor's queue). `close` before the socket closes."""

    def __init__(self, sock: zmq.Socket, has_keys: bool = True):
        self.sock, self.has_keys = sock, has_keys
        self._mon = sock.get_monitor_socket(FAILED_EVENTS | zmq.EVENT_MONITOR_STOPPED)
        self.reason: str | None = None

    def poll(self) -> str | None:
        """The latest handshake failure's explanation (kept once seen), None if there was none."""
        while True:
            try:
                if not self._mon.poll(0):
                    return self.reason
                msg = recv_monitor_message(self._mon)
            except zmq.ZMQError:
                return self.reason
            if msg["event"] & FAILED_EVENTS:
                self.reason = client_reason(msg["event"], msg["value"], self.has_keys)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)
