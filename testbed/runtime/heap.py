"""Keep freed heap memory for reuse (glibc's malloc), so that large temporary arrays cost no page faults.

The optimizer's greedy builds (candidates x devices) arrays at every step: 2 MiB each at 512 devices. glibc
maps such blocks fresh from the kernel, or trims the heap once 2x the largest freed block lies free at its
top, so nearly every step faults its pages in again; on a virtual machine that was two thirds of a
512-device plan (`tools/bench_optimizer.py --default-malloc`: 135-170 ms against 47-71 ms with this).
`keep_freed_memory` raises both thresholds for this process: up to `trim_mib` of freed memory stays
mapped for the next allocation. Where the optimizer runs calls it: the edge of every live run
(`testbed.run.session.start_edge`), `multispin plan`, `multispin simulate` and its workers; a device process and
the emulator do not.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_mib: int = 64, trim_mib: int = 256) -> bool:
    """Blocks below `mmap_mib` come from the heap, which is trimmed only beyond `trim_mib` free at its top.
    Returns whether it applies (glibc only; elsewhere nothing changes). Idempotent."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator keeps its own policy
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_mib << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_mib << 20))
    return _done


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the kernel now (glibc's malloc_trim): after a burst that freed much
    (a flood of refused messages), so that what `keep_freed_memory` keeps does not stay the process's size.
    Returns whether anything was released (False off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return False
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
