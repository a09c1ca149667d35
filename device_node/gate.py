"""The compute gate of a device process: which device may work now.

A process that hosts several emulated devices (`device_node.host`) lets one device at a time handle a
message (draft, correct, encode), so that each device's measured compute is its own work, not time shared
with the other devices of the process; an emulated slowdown (`HardwareProfile.compute_scale`) is slept with
the gate open. A process of one device uses `OPEN`, which never waits.
"""

from __future__ import annotations

import threading
import time


class Gate:
    """A lock around one device's message handling; `sleep` opens it for the emulated slowdown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> Gate:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def sleep(self, seconds: float) -> float:
        """Sleep with the gate open (held on entry and on return); returns the seconds spent waiting to get
        it back, which are other devices' work and not this device's drafting time."""
        self._lock.release()
        try:
            time.sleep(seconds)
        finally:
            t = time.perf_counter()
            self._lock.acquire()
        return time.perf_counter() - t


class _Open:
    """The gate of a process with one device: nothing to wait for."""

    def __enter__(self) -> _Open:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return 0.0


OPEN = _Open()
