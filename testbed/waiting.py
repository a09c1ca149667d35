"""Waiting for the next message: in the kernel (the default) or busy-polling.

A process that sleeps in `zmq_poll` is woken by the kernel when a message comes; on a virtual machine that
wake-up costs 0.3-0.5 ms (measured here: a 100-byte round trip takes 0.12 ms between two busy processes and
0.57 ms when the receiver slept), and a round has two such hops plus the slower first instructions of a core
that idled. Busy-polling trades a core for that latency: worth it only where every polling process has a core
of its own (`busy_poll_wanted`).
"""

from __future__ import annotations

import os
import time

import zmq

BUSY_POLL_CHOICES = ("auto", "on", "off")


def wait_readable(sock: zmq.Socket, timeout_s: float, *, busy: bool = False) -> bool:
    """Whether `sock` has a message within `timeout_s`. `busy`: poll without sleeping, yielding the core to any
    other runnable thread between polls (the zmq I/O threads, a recorder's fsync)."""
    if not busy:
        return bool(sock.poll(max(0, int(timeout_s * 1000))))
    end = time.monotonic() + timeout_s
    while True:
        if sock.poll(0):
            return True
        if time.monotonic() >= end:
            return False
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
