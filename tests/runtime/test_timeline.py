"""testbed.runtime.timeline: opt-in stamps written by each process at exit, and a round's steps read back in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.runtime.timeline import ENV, critical_path, load


@pytest.mark.live
def test_a_process_with_the_variable_writes_its_stamps_at_exit_and_one_without_writes_nothing(tmp_path):
    code = "from testbed.runtime import timeline; timeline.stamp('a'); timeline.stamp('b', 5.0)"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert list(tmp_path.iterdir()) == []  # off: nothing recorded, nothing written
    proc = subprocess.run([sys.executable, "-c", code + "; import os; print(os.getpid())"],
                          env={**env, ENV: str(tmp_path)}, check=True, timeout=60, capture_output=True, text=True)
    written = tmp_path / f"{proc.stdout.strip()}.json"
    events = json.loads(written.read_text())
    assert [tag for tag, _ in events] == ["a", "b"] and events[1][1] == 5.0
    assert load(tmp_path) == [(tag, t) for tag, t in events]


def test_critical_path_orders_the_steps_by_their_median_time_after_each_start():
    events = []
    for cycle in range(5):
        t0 = 100.0 * cycle
        events += [("start", t0), ("x", t0 + 0.001 * (1 + cycle % 2)), ("y", t0 + 0.004), ("end", t0 + 0.010),
                   ("x", t0 + 0.020)]  # after `end`: not counted
    events.reverse()  # the files come in any order
    rows = critical_path(events, "start", "end", skip=1)
    assert [r[0] for r in rows] == ["start", "x", "y", "end"]
    assert [r[2] for r in rows] == [4, 4, 4, 4]  # the first cycle is skipped
    assert rows[1][1] == pytest.approx(1.5)  # median of 2, 1, 2, 1 ms
    assert rows[2][1] == pytest.approx(4.0) and rows[3][1] == pytest.approx(10.0)
