"""The host-side supervisor as `fleet up` starts it: it restarts a device that exits, and `--stop` ends it
and every device it runs (checked by pid), removing its pid file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import ROOT, wait_until

from testbed.fleet.supervisor import alive

SHORT = "import time; print('short lived', flush=True); time.sleep(0.2)"
LONG = "import time; print('long lived', flush=True); time.sleep(600)"


@pytest.mark.live
def test_a_device_that_exits_is_restarted_and_stop_leaves_no_process(tmp_path):
    spec = {"pid_file": str(tmp_path / "run" / "supervisor.pid"), "log_dir": str(tmp_path / "logs"),
            "env": {"FLEET_TEST": "1"},
            "devices": [{"name": "a", "argv": [sys.executable, "-c", SHORT]},
                        {"name": "b", "argv": [sys.executable, "-c", LONG]}]}
    (tmp_path / "run").mkdir()
    spec_file = tmp_path / "run" / "supervisor.json"
    spec_file.write_text(json.dumps(spec))
    sup = subprocess.Popen([sys.executable, "-m", "testbed.fleet.supervisor", str(spec_file)], cwd=ROOT,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        log_a = tmp_path / "logs" / "a.log"
        # started, exited, restarted after the first backoff (1 s), started again
        wait_until(lambda: log_a.is_file() and log_a.read_text().count("short lived") >= 2, 20, "a restart")
        text = log_a.read_text()
        assert "a exited with status 0" in text and "restarting in 1 s" in text
        pids = json.loads(open(spec["pid_file"]).read())
        assert pids["pid"] == sup.pid and pids["pgid"] == sup.pid  # its own process group
        b = pids["devices"]["b"]
        assert alive(b)
        out = subprocess.run([sys.executable, "-m", "testbed.fleet.supervisor", "--stop", str(spec_file)],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
        stopped = json.loads(out.stdout)["stopped"]
        assert stopped["supervisor"] == {"pid": sup.pid, "gone": True} and stopped["b"]["pid"] == b
        assert all(v["gone"] for v in stopped.values())
        assert sup.wait(timeout=10) == 0
        assert not alive(b) and not os.path.exists(spec["pid_file"])
        # nothing left to stop: a second --stop says so
        again = subprocess.run([sys.executable, "-m", "testbed.fleet.supervisor", "--stop", str(spec_file)],
                               cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert json.loads(again.stdout) == {"running": False, "stopped": {}}
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


@pytest.mark.parametrize("module", ["probe", "supervisor"])
def test_what_runs_on_a_device_host_needs_only_the_standard_library(module):
    """probe.py runs before anything is installed there (`python -c`), the supervisor under any device Python."""
    import ast

    tree = ast.parse((ROOT / "testbed" / "fleet" / f"{module}.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {n.split(".")[0] for n in names} - {"__future__"} <= set(sys.stdlib_module_names), names
