"""testbed.runtime.heap: with freed memory kept, a large temporary array reuses pages instead of faulting them in.

Counted, not timed: the minor page faults of 50 x 4 temporaries of 2 MiB (512 pages each), in a fresh process
with glibc's defaults and in one after `keep_freed_memory()`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import ROOT

from testbed.runtime.heap import keep_freed_memory

pytestmark = pytest.mark.live  # each test counts page faults in fresh processes

PROBE = """
import json, resource, sys
import numpy as np
from testbed.runtime.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
a = np.ones((512, 512))
def step():  # four 2 MiB temporaries alive at once, then all freed (as in a greedy step of the optimizer)
    alive = [a + i for i in range(4)]
    return sum(float(x.sum()) for x in alive)
for _ in range(5):  # warm-up: the first blocks are new pages either way
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_kept_freed_memory_spares_the_page_faults_of_large_temporaries():
    default, kept = _faults("default"), _faults("keep")
    assert kept["kept"] is True and default["kept"] is False
    pages = 200 * 512
    assert default["faults"] >= 0.5 * pages, default  # each temporary faulted in afresh
    assert kept["faults"] <= 0.05 * pages, kept       # the same pages, reused
    assert keep_freed_memory() is True and keep_freed_memory() is True  # idempotent


def test_the_commands_that_plan_keep_freed_memory_and_the_others_do_not(tmp_path):
    probe = ("import contextlib, io, sys; from testbed import cli; from testbed.runtime import heap\n"
             "with contextlib.redirect_stdout(io.StringIO()): rc = cli.main(sys.argv[1:])\n"
             "print(rc, heap._done)")
    for argv, kept in ((["plan", "profiles/scenarios/example-two-devices.yaml"], "True"),
                       (["runs", str(tmp_path)], "False")):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
        assert out.stdout.split() == ["0", kept], (argv, out.stdout, out.stderr[-2000:])
