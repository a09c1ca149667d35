"""Heartbeats and liveness, the ZeroMQ guide's Paranoid Pirate, for the edge and the device alike.

Each side sends a `heartbeat` to a peer it has sent nothing to for `period_s`, and takes a peer it has heard
nothing from for `liveness` x `period_s` (the window) for dead. Any message counts as a sign of life, so
heartbeats flow only while a side is idle. Standard library only: a device imports it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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
