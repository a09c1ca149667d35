"""The straggler bench of synchronous rounds (edge_node/bench.py, `straggler_misses`), on a whole run.

`multispin run` as a process (the micro pair, passthrough). One device is slowed from outside: its process is
stopped most of the time (SIGSTOP, then SIGCONT for a moment, over and over), so that every draft of it comes
long after its round's deadline. After `straggler_misses` misses in a row it is benched: the other device's
rounds no longer wait for it (they end in a fraction of the deadline again), it stays registered, and once it is
left to run at full speed it drafts in time and is back in the rounds. Every process is stopped by its pid."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import threading

import pytest
import yaml
from support import (
    CLI,
    child_pids,
    device_pid,
    kill_all,
    pid_alive,
    profile_data,
    records_so_far,
    wait_rounds,
    wait_until,
)

from edge_node.bench import Bench
from testbed.run.profile import load_profile

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]

DEADLINE_S = 0.4


def _wall(rec: dict) -> float:
    return rec["measured"].get("wall_round_s") or rec["measured"]["round_s"]


def _slow_down(pid: int, stop: threading.Event) -> None:
    """Keep `pid` stopped but for a moment every 0.6 s (the fault's shape, not a wait) until `stop` is set."""
    while not stop.is_set():
        os.kill(pid, signal.SIGSTOP)
        stop.wait(0.6)
        os.kill(pid, signal.SIGCONT)
        stop.wait(0.02)
    os.kill(pid, signal.SIGCONT)


def test_a_slow_device_is_benched_the_others_recover_and_it_rejoins_once_fast(micro_pair, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(profile_data(micro_pair, rounds=100_000, deadline_s=DEADLINE_S, max_misses=1000,
                                                straggler_misses=3, channel={"mode": "passthrough"})))
    proc = subprocess.Popen([*CLI, "run", str(prof), "--runs-dir", str(tmp_path / "runs"), "--quiet", "--no-plots"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    stop, slow = threading.Event(), None

    def recs():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return records_so_far(run_dir)

    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        d1 = device_pid(children, "d1")
        n0 = len(recs())
        slow = threading.Thread(target=_slow_down, args=(d1, stop), daemon=True)
        slow.start()
        # Benched after 3 misses in a row; then rounds that do not wait for it.
        wait_until(lambda: sum("d1" in r.get("benched", []) for r in recs()[n0:]) >= 20, 60,
                   "20 rounds with d1 benched")
        stop.set()
        slow.join(5)
        n1 = len(recs())
        wait_until(lambda: sum(not r["devices"]["d1"]["missed"] and "d1" not in r["benched"]
                               for r in recs()[n1:] if "d1" in r["devices"]) >= 3, 60, "d1 back in the rounds")
        assert pid_alive(d1)  # the same process throughout: registered all along
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err[-3000:]
        wait_until(lambda: not [p for p in children if pid_alive(p)], 15, "the run's children gone")
    finally:
        stop.set()
        kill_all([proc, *children])
    records = records_so_far(run_dir)
    assert [r["round"] for r in records] == list(range(len(records)))
    moved = [r for r in records if "d1" in (r.get("bench_events") or {}).get("benched", [])]
    back = [r for r in records if "d1" in (r.get("bench_events") or {}).get("rejoined", [])]
    assert moved and back and moved[0]["round"] < back[-1]["round"]
    first = moved[0]["round"]
    # Before the bench, each round d1 missed waited the whole deadline for it (between them, rounds it sat out
    # for want of a report, which count as misses too).
    waited = [r for r in records[n0:first + 1] if "d1" in r["missed"] and not r["benched"]]
    assert waited and all(_wall(r) >= DEADLINE_S for r in waited), [_wall(r) for r in waited]
    # On the bench: d0's rounds no longer wait (median under a quarter of the deadline), d0 served in each.
    benched = [r for r in records if "d1" in r["benched"]]
    assert all(r["devices"]["d1"].get("benched") for r in benched)
    assert all(not r["devices"]["d0"]["missed"] for r in benched)
    assert statistics.median(_wall(r) for r in benched) < DEADLINE_S / 4, [_wall(r) for r in benched][:40]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["bench"]["events"] == len(moved) and summary["bench"]["rejoined"] == len(back)
    assert summary["bench"]["devices"]["d1"]["rounds"] == len(benched)


def test_straggler_misses_must_be_below_max_misses(micro_pair, tmp_path):
    """Else the session would end before the bench: refused at load, naming both keys."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile_data(micro_pair, max_misses=3, straggler_misses=3)))
    with pytest.raises(ValueError, match=r"straggler_misses: 3 must be below max_misses \(3\)"):
        load_profile(path)
    path.write_text(yaml.safe_dump(profile_data(micro_pair, max_misses=4, straggler_misses=3)))
    assert load_profile(path).straggler_misses == 3


def test_the_bench_is_per_session_and_never_empties_a_round():
    bench = Bench(misses=2)
    assert not bench.after_miss("d1", "d1#0", 1, r=0)  # one miss: not yet
    assert bench.after_miss("d1", "d1#0", 2, r=1) and bench.moved == 1
    assert bench.of_round({"d0": "d0#0", "d1": "d1#0"}) == {"d1"}
    assert bench.of_round({"d1": "d1#0"}) == set()  # all benched: the round waits for them as usual
    assert bench.of_round({"d0": "d0#0", "d1": "d1#5"}) == set()  # registered again: a new session, off it
    assert not bench.answered("d1", "d1#5", r=2) and bench.answered("d1", "d1#0", r=2) and bench.rejoined == 1
    assert bench.of_round({"d0": "d0#0", "d1": "d1#0"}) == set()
    assert not Bench(misses=0).after_miss("d1", "d1#0", 99, r=0)  # 0: no bench
