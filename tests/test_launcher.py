"""The launcher's child processes import the same packages as the parent, from any working directory."""

from __future__ import annotations

import os
import subprocess
import sys

from testbed import launcher


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


def test_children_start_from_any_directory(tmp_path):
    # What the launcher runs (python -m ...) imports from an unrelated working directory.
    code = "import channel_emulator.proxy, device_node.node; print(device_node.node.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=launcher.child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(launcher.PACKAGE_ROOT))
