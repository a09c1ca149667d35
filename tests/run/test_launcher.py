"""The launcher's child processes import the same packages as the parent, from any working directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testbed.run import launcher


def test_child_env_puts_a_checkout_first_without_an_empty_entry(monkeypatch):
    monkeypatch.setattr(launcher.site, "getsitepackages", lambda: ["/nowhere/site-packages"])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = launcher.child_env()
    # An empty entry would put the child's working directory on its path.
    assert env["PYTHONPATH"] == str(launcher.PACKAGE_ROOT)
    monkeypatch.setenv("PYTHONPATH", "/extra")
    assert launcher.child_env()["PYTHONPATH"] == os.pathsep.join([str(launcher.PACKAGE_ROOT), "/extra"])


def test_child_env_leaves_an_installed_package_alone(monkeypatch):
    # Installed into site-packages: nothing to add (on PYTHONPATH it would precede the standard library).
    monkeypatch.setattr(launcher.site, "getsitepackages", lambda: [str(launcher.PACKAGE_ROOT)])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert "PYTHONPATH" not in launcher.child_env()


@pytest.mark.live
def test_children_start_from_any_directory(tmp_path):
    # What the launcher runs (python -m ...) imports from an unrelated working directory.
    code = "import channel_emulator.proxy, device_node.node; print(device_node.node.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=launcher.child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(launcher.PACKAGE_ROOT))


class _SignalsInDel:
    """An object whose finalizer is where the SIGTERM lands: Python prints the handler's exception there and
    goes on (CI saw a run go on for 3,585 rounds after its SIGTERM, every later signal ignored)."""

    def __del__(self):
        import signal
        import time

        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, inside __del__


def test_a_swallowed_signal_still_ends_the_run_at_the_next_check(monkeypatch):
    import pytest

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))  # what Python prints
    with launcher.interrupt_signals() as guard:
        launcher.raise_if_interrupted()  # nothing received: nothing raised
        _SignalsInDel()  # collected at once: the RunInterrupted is raised in __del__, and goes no further
        assert guard.received is not None and swallowed == [launcher.RunInterrupted]
        with pytest.raises(launcher.RunInterrupted):  # the next round or edge tick ends the run after all
            launcher.raise_if_interrupted()
        guard.shield()  # the run stops now: the check leaves the shutdown alone
        launcher.raise_if_interrupted()


def test_the_edge_asks_the_stop_check_at_every_tick():
    from edge_node.server import EdgeServer

    calls = []

    class Stop(Exception):
        pass

    def check_stop():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    server = EdgeServer.__new__(EdgeServer)  # only what _tick reads before its own schedule
    server.check_stop, server._next_tick = check_stop, float("inf")
    server._tick(0.0)
    server._tick(0.0)
    import pytest

    with pytest.raises(Stop):
        server._tick(0.0)


@pytest.mark.parametrize("asked_to_leave", [True, False])
def test_an_emulator_asked_to_stop_is_waited_for_not_terminated(tmp_path, asked_to_leave):
    # A channel that takes 0.5 s to exit (its sockets, its interpreter on a busy host) after `stop`: its clean
    # exit is reported as 0, not as the -15 of a terminate; one never asked is terminated at once.
    runner = launcher.Launcher(tmp_path)
    runner.start("channel", [sys.executable, "-c", "import time; time.sleep(0.5)"])
    if asked_to_leave:
        runner.leaving.add("channel")
    assert runner.stop_all(grace_s=0.0) == {"channel": 0 if asked_to_leave else -15}
