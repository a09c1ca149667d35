"""Child processes of a command: started so that Ctrl-C is left to the parent, which stops them in order,
and ended with their parent on Linux (PR_SET_PDEATHSIG); how one exited, in words."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_preexec():
    """A `preexec_fn` (POSIX) that leaves SIGINT to the parent and, on Linux, makes the child receive SIGTERM
    when its parent dies (see the module docstring, also for the fallback elsewhere); None on Windows."""
    if os.name != "posix":
        return None
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
        except (OSError, AttributeError):
            pass
    parent = os.getpid()

    def preexec() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run stops its children itself (module docstring)
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def how_it_exited(proc: subprocess.Popen) -> str | None:
    """"killed by SIGKILL" or "exit status 2" for a process that has exited, None while it runs
    (`Popen.poll` only: cheap enough for every edge tick)."""
    code = proc.poll()
    if code is None:
        return None
    try:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    except ValueError:
        return f"killed by signal {-code}"
