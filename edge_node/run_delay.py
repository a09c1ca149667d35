"""How long this process's threads that move messages waited for a core: a probe timed while they waited
measures the host, not the link (`edge_node.probing` discards it).

Linux's /proc/self/task/<tid>/schedstat gives, per thread, the time it ran, the time it was runnable but
waited on a run queue, and the number of its time slices. The threads that move a probe are the main
thread (the edge's loop) and ZeroMQ's I/O threads ("ZMQbg/IO/<n>"); the others (heartbeats, PyTorch's pool)
do not touch a message in flight. Elsewhere (no /proc) `RunDelay.now` is None and nothing is discarded."""

from __future__ import annotations

import os

_IO_THREAD = "ZMQbg/IO"


class RunDelay:
    """`tasks`: the schedstat files to watch (default: found at the first reading); [] watches none (a link
    simulated on a simulated clock, where no thread of this process moves the messages)."""

    def __init__(self, tasks: list[str] | None = None):
        self._tasks = tasks

    def _find_tasks(self) -> list[str]:
        """The schedstat files of the main thread and the ZeroMQ I/O threads (found once: they live as long
        as the process and its context)."""
        pid, found = os.getpid(), []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if int(task) == pid or comm.startswith(_IO_THREAD):
                found.append(f"/proc/self/task/{task}/schedstat")
        return found

    def now(self) -> float | None:
        """Seconds those threads have waited for a core so far (a counter: compare two readings); None where
        the kernel does not say."""
        try:
            if self._tasks is None:
                self._tasks = self._find_tasks()
            total = 0
            for path in self._tasks:
                with open(path) as f:
                    total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            self._tasks = None  # a thread gone (a new context): look again next time
            return None
        return total / 1e9

    @staticmethod
    def waited(before: float | None, after: float | None) -> float:
        """The wait between two readings (0 when either is unknown)."""
        return 0.0 if before is None or after is None else max(0.0, after - before)
