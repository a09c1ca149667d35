"""Warm device processes (`--serve-runs`): after the edge's `bye` a device waits for the next run instead of exiting.

The process that started it (`testbed.run.warm.WarmPool`) sends SIGUSR1 once the next run's edge is bound; each
device of the process then registers again on a fresh socket. Registering only then (not on a timer) keeps
stale `register` messages from piling up in the emulator's queue to an edge that is not there yet.

A signal handler may only do what is safe between two bytecodes: it bumps a counter, and waiting devices poll
it (a lock taken inside a handler could deadlock against the thread it interrupted).
"""

from __future__ import annotations

import signal
import time

_generation = 0  # SIGUSR1 received so far
POLL_S = 0.005


def _bump(signum, frame) -> None:
    global _generation
    _generation += 1


def install() -> None:
    """Count SIGUSR1 (call it in the main thread, before the parent may send one: its default action kills)."""
    signal.signal(signal.SIGUSR1, _bump)


def generation() -> int:
    return _generation


def wait_beyond(seen: int, stop=None) -> bool:
    """Wait until a SIGUSR1 arrived after generation `seen`; False if `stop()` became true first."""
    while _generation <= seen:
        if stop is not None and stop():
            return False
        time.sleep(POLL_S)
    return True
