"""Child processes of a command: started so that Ctrl-C is left to the parent, which stops them in order,
and ended with their parent on Linux (PR_SET_PDEATHSIG); how one exited, in words."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # linux/prctl.h
HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextmanager
def signals_held():
    """Hold Ctrl-C, SIGTERM and SIGHUP (POSIX, main thread) until the block ends: a child started inside it
    is in the caller's hands before the signal's KeyboardInterrupt can land. Otherwise a signal that comes
    while Popen waits for the child's exec loses the handle, and nobody stops the child."""
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


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
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)  # a mask held by `signals_held` is the parent's only
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


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one of another user counts; a zombie, which has
    exited and waits for its parent to reap it, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS), or it exited meanwhile
        return True
