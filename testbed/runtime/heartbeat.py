"""Heartbeats and liveness, the ZeroMQ guide's Paranoid Pirate, for the edge and the device alike.

Each side sends a `heartbeat` to a peer it has sent nothing to for `period_s`, and takes a peer it has heard
nothing from for `liveness` x `period_s` (the window) for dead. Any message counts as a sign of life, so
heartbeats flow only while a side is idle. Liveness does not depend on compute: while a side runs a long call
(the edge's verification or planning, a device's drafting) it lends its socket to a `HeartbeatThread`, which
sends the heartbeats due and takes in what arrives meanwhile. Standard library only: a device imports it."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class PeerTimes:
    """When this side last sent to a peer and last heard from it (monotonic clock)."""

    last_sent: float = field(default_factory=time.monotonic)
    last_heard: float = field(default_factory=time.monotonic)

    def sent(self, now: float | None = None) -> None:
        self.last_sent = time.monotonic() if now is None else now

    def heard(self, now: float | None = None) -> None:
        self.last_heard = time.monotonic() if now is None else now


@dataclass(frozen=True)
class Heartbeat:
    """The cadence (`period_s`) and the liveness window (`liveness` periods) both sides agree on."""

    period_s: float
    liveness: int

    @property
    def window_s(self) -> float:
        return self.liveness * self.period_s

    def due(self, peer: PeerTimes, now: float) -> bool:
        """Whether a heartbeat should go to `peer` now (nothing sent to it for a period)."""
        return now - peer.last_sent >= self.period_s

    def silent_s(self, peer: PeerTimes, now: float) -> float:
        return now - peer.last_heard

    def expired(self, peer: PeerTimes, now: float) -> bool:
        """Whether `peer` has been silent past the window: presumed dead."""
        return self.silent_s(peer, now) > self.window_s

    def wait_s(self, peer: PeerTimes, now: float) -> float:
        """How long this side may wait before it has to beat or to judge `peer` dead."""
        return min(self.period_s - (now - peer.last_sent), self.window_s - self.silent_s(peer, now))


class HeartbeatThread:
    """Liveness independent of compute: a thread that serves a node's socket while, and only while, the node's
    loop lends it for a long call (`lent()`).

    ZeroMQ sockets are not thread-safe, so a lock says who may touch the socket: the loop's side holds it
    from the start and lets go of it only inside `lent()`. Every `tick_s` this thread tries the lock without
    waiting for it; when it gets it (the loop is inside a long call) it runs `service()` (send the heartbeats
    due, take in the messages that arrived) and lets go at once. The loop never wakes this thread: a call costs
    it one lock release and one acquire, plus, when a service is in progress as the call ends, the rest of that
    service (microseconds). The lock is not owned by a thread: the loop's side may run in any one thread."""

    def __init__(self, service: Callable[[], None], tick_s: float, name: str = "heartbeats"):
        self.tick_s = tick_s  # may change (a device learns the edge's heartbeat period at registration)
        self.name = name
        self.services = 0  # services run: how often the socket was served during a long call
        self._service = service
        self._lock = threading.Lock()
        self._lock.acquire()  # the loop's side holds the socket
        self._depth = 0  # nested `lent()` calls (the loop's side only)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Lend the socket for the call inside: this thread serves it meanwhile. The loop's side must not touch
        the socket inside (a nested `lent()` is a no-op)."""
        if self._depth or self._stop.is_set():
            yield
            return
        if self._thread is None:
            self._start()
        self._depth = 1
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()  # waits only for a service in progress
            self._depth = 0

    def _start(self) -> None:
        # The thread holds this object weakly: a node that is dropped without `close()` ends it too.
        self._thread = threading.Thread(target=_serve_lent, args=(weakref.ref(self), self._lock, self._stop),
                                        name=self.name, daemon=True)
        self._thread.start()

    def _run_service(self) -> None:
        self.services += 1
        try:
            self._service()
        except Exception:  # a failed heartbeat must not end the thread: the next tick tries again
            log.warning("%s: serving the socket during a long call failed", self.name, exc_info=True)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (the loop's side keeps the socket); later `lent()` calls lend nothing."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def _serve_lent(ref: weakref.ref, lock: threading.Lock, stop: threading.Event) -> None:
    while True:
        keeper = ref()
        if keeper is None:
            return
        tick = keeper.tick_s
        del keeper
        if stop.wait(max(1e-3, tick)):
            return
        if not lock.acquire(blocking=False):
            continue  # the loop holds the socket: nothing to do
        try:
            keeper = ref()
            if keeper is None or stop.is_set():
                return
            keeper._run_service()
            del keeper
        finally:
            lock.release()
