"""Waiting for the next message: in the kernel (the default) or busy-polling.

A process that sleeps in `zmq_poll` is woken by the kernel when a message comes; on a virtual machine that
wake-up is a large part of a hop's latency, and a round has two such hops plus the slower first instructions
of a core that idled. Busy-polling trades a core for that latency: worth it only where every polling process
has a core of its own (`busy_poll_wanted`).

A busy-polling node also rehearses: on such hosts a step that follows milliseconds of other work (even of
spinning) runs several times slower than back to back (`tools/bench_cold.py`), so while it waits the node
reruns, on the last message of the kind it waits for, the decode and checks that the next one will take, and
the real message finds them warm. The measurements are in docs/code-history.md and docs/performance.md.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

BUSY_POLL_CHOICES = ("auto", "on", "off")


# Often enough to keep a step warm (a step cools within a fraction of a millisecond of spinning), rarely enough
# that a message seldom waits for a rehearsal (itself a fraction of this period) to end.
REHEARSE_EVERY_S = 5e-4
REHEARSE_ENV = "MULTISPIN_REHEARSE"


def rehearsal_wanted() -> bool:
    """Whether busy-polling nodes rehearse (`wait_readable`): yes unless MULTISPIN_REHEARSE=off (to measure
    what it saves, as `tools/bench_overhead.py --rehearse both` does)."""
    value = os.environ.get(REHEARSE_ENV, "on")
    if value not in ("on", "off"):
        raise ValueError(f"{REHEARSE_ENV}={value!r}: must be on or off")
    return value == "on"


class Rehearsal:
    """What a busy-polling node reruns while it waits (`wait_readable`): one pure step on the last message of
    the kind it waits for, set after each such message passed its checks, and how often it ran (`count`). Off
    unless the node busy-polls and the environment allows it (`rehearsal_wanted`)."""

    def __init__(self, busy_poll: bool):
        self.enabled = busy_poll and rehearsal_wanted()
        self.count = 0
        self._step: Callable[[], object] | None = None

    def set(self, step: Callable[..., object], *args) -> None:
        """Rehearse `step(*args)` from now on (nothing when off)."""
        if self.enabled:
            self._step = functools.partial(step, *args)

    @property
    def run(self) -> Callable[[], None] | None:
        """The call for `wait_readable(rehearse=...)`: None until a step is set."""
        return None if self._step is None else self._run

    def _run(self) -> None:
        self.count += 1
        self._step()


def wait_readable(sock: zmq.Socket, timeout_s: float, *, busy: bool = False,
                  rehearse: Callable[[], object] | None = None) -> bool:
    """Whether `sock` has a message within `timeout_s`. `busy`: poll without sleeping, yielding the core to any
    other runnable thread between polls (the zmq I/O threads, a recorder's fsync); then `rehearse`, every
    `REHEARSE_EVERY_S`, reruns the checks that the expected message will take on the last one of its kind
    (pure: its result is dropped), so that they find their code and data in the caches when it comes."""
    if not busy:
        return bool(sock.poll(max(0, int(timeout_s * 1000))))
    now = time.monotonic()
    end, next_rehearsal = now + timeout_s, now + REHEARSE_EVERY_S
    while True:
        if sock.poll(0):
            return True
        now = time.monotonic()
        if now >= end:
            return False
        if rehearse is not None and now >= next_rehearsal:
            try:
                rehearse()
            except Exception:  # a rehearsal only warms the caches: never the wait's business
                log.debug("a rehearsal failed; not rehearsing in this wait", exc_info=True)
                rehearse = None
            next_rehearsal = time.monotonic() + REHEARSE_EVERY_S
        else:
            os.sched_yield()


def busy_poll_wanted(setting: str, processes: int, cores: int | None = None) -> bool:
    """`setting` (auto | on | off) for a run of `processes` busy-polling processes on `cores` (default: this
    machine's usable cores): auto is on only when each of them has a core of its own."""
    if setting not in BUSY_POLL_CHOICES:
        raise ValueError(f"busy_poll: {setting!r} is not one of {', '.join(BUSY_POLL_CHOICES)}")
    if setting != "auto":
        return setting == "on"
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return processes <= cores
