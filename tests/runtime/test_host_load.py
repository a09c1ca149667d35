"""How busy the host is: wake-up delays measured by sleeping, other processes' CPU share from /proc/stat, and the
hint `channel validate` prints when a busy host is why cells missed (real processes, no fakes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from support import wait_until

from testbed.runtime.host_load import Wakeups, busy_hint, cpu_snapshot, others_share, wakeup_delays

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc")


def test_wakeup_delays_are_measured():
    w = wakeup_delays(samples=50)
    assert w.samples == 50 and 0 <= w.median_s <= w.p95_s < 1.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@pytest.mark.live
def test_a_cpu_hog_counts_among_the_others():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        wait_until(lambda: cpu_seconds(hog.pid) > 0.05, 30, "the hog running")
        before, hog_before = cpu_snapshot(), cpu_seconds(hog.pid)
        wait_until(lambda: cpu_seconds(hog.pid) - hog_before >= 0.5, 60, "half a CPU second of the hog")
        after, hog_used = cpu_snapshot(), cpu_seconds(hog.pid) - hog_before
        share = others_share(before, after)
        span = (after.wall_s - before.wall_s) * os.cpu_count()
        # Everything the hog burnt is among the others' (with the rest of the host's load; tick rounding: 2 ticks)
        assert share * span >= hog_used - 2 / os.sysconf("SC_CLK_TCK")
        # Counted as this process's own, it is not the others' any more.
        mine = others_share(before, after, extra_own_s=hog_used)
        assert mine <= share
        if 0.0 < mine and share < 1.0:  # (both within the clamps)
            assert abs((share - mine) * span - hog_used) < 1e-6
    finally:
        hog.kill()
        hog.wait(5)


def test_the_hint_names_the_figures_or_stays_quiet():
    quiet, late = Wakeups(20e-6, 60e-6, 200), Wakeups(400e-6, 3e-3, 200)
    assert busy_hint([80e-6, 800e-6], quiet, 0.1, quiet) is None  # the misses are the emulator's
    assert busy_hint([], late, 0.9) is None  # nothing missed
    said = busy_hint([80e-6, 800e-6], quiet, 0.1, late)
    assert "woke up 400 us late (median; p95 3000 us)" in said and "80 us at the tightest" in said
    said = busy_hint([800e-6], quiet, 0.75)
    assert f"75% of its {os.cpu_count()} CPUs" in said and "woke up 20 us late" in said


@pytest.mark.live
def test_channel_validate_reports_the_host_and_the_hint_on_a_miss(capsys):
    """A release 50 ms early misses every cell: the hint comes exactly when the host figures (in the JSON) say
    the host was busy, and then with those figures."""
    import json

    from testbed.cli import main

    t0 = time.monotonic()
    status = main(["channel", "validate", "--sizes", "1000", "--rates", "1e6", "--repeats", "3", "--lead", "0.05,0",
                   "--json"])
    out, err = capsys.readouterr()
    assert status == 1 and time.monotonic() - t0 < 120
    report = json.loads(out)
    host = report["host"]
    assert set(host) == {"wakeup_before", "wakeup_after", "others_cpu_share_during"}
    before, after = (Wakeups(**host[k]) for k in ("wakeup_before", "wakeup_after"))
    tolerances = [0.01 * c["modeled_s"] for c in report["cells"] if c["meets_target"] is False]
    expected = busy_hint(tolerances, before, host["others_cpu_share_during"], after)
    if expected is None:
        assert "too busy" not in err
    else:
        assert f"multispin channel: {expected}" in err
