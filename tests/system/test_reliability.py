"""The fault promises of docs/reliability.md (issue 35): the rows that no other test checks end to end, and a
check that the table and the tests agree.

Whole runs of `multispin run` as processes (the micro pair, ipc:// sockets in the test's folder), with faults
injected from outside: a signal, kill -9 of a child, SIGSTOP/SIGCONT of a device, a full disk (a small tmpfs,
mounted here when the test runs as root). Every test also checks what every row promises: no completed round
lost (rounds.jsonl's rounds consecutive from 0), every record line whole (each line of every .jsonl file
parses, and the file ends with a newline), and no process left behind (the run's children are gone by their
pids). Every process started here is stopped by its pid."""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from support import (
    CLI,
    ROOT,
    child_pids,
    device_pid,
    kill_all,
    pid_alive,
    profile_data,
    records_so_far,
    wait_rounds,
    wait_until,
)

pytestmark = [pytest.mark.live, pytest.mark.timeout(400)]

DOC = ROOT / "docs" / "reliability.md"


# --- helpers ------------------------------------------------------------------------------------------------------

def _profile(tmp_path: Path, pair, **overrides) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile_data(pair, **overrides)))
    return path


def _start(prof: Path, runs: Path) -> subprocess.Popen:
    """`multispin run` with stdout and stderr apart: the promise of "one clear line" is about stderr."""
    return subprocess.Popen([*CLI, "run", str(prof), "--runs-dir", str(runs), "--quiet", "--no-plots"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rounds(run_dir: Path) -> list[int]:
    """The recorded rounds: consecutive from 0 (none lost, none twice) and every line whole."""
    raw = (run_dir / "rounds.jsonl").read_text()
    assert raw == "" or raw.endswith("\n"), raw[-200:]
    rounds = [json.loads(line)["round"] for line in raw.splitlines()]
    assert rounds == list(range(len(rounds))), rounds
    return rounds


def _whole(run_dir: Path) -> None:
    """Every line of every record file of the run directory is a whole JSON value."""
    for f in run_dir.glob("*.jsonl"):
        raw = f.read_text()
        assert raw == "" or raw.endswith("\n"), f"{f.name}: a torn last line: {raw[-200:]!r}"
        for line in raw.splitlines():
            json.loads(line)
    for f in run_dir.glob("*.json"):
        if f.stat().st_size:  # a full disk may leave one unwritten; never half written
            json.loads(f.read_text())


def _gone(pids: list[int]) -> None:
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 15, "the run's children gone (none left behind)")


def _cmdlines(pids: list[int]) -> dict[int, list[bytes]]:
    return {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in pids}


def _exit_2_with_one_error_line(proc, err: str) -> str:
    """Exit status 2, no traceback, and one `multispin run: error:` line, alone on stderr (--quiet: no log line
    repeats it, no `run directory:` line beside it); returns it."""
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("multispin run: error: "), lines
    return lines[-1]


def _error_lines(stderr: str) -> list[str]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    print("stderr:", *lines, sep="\n  ")
    return lines


def _stop_run(proc: subprocess.Popen, sig=signal.SIGTERM) -> tuple[str, str]:
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    return out, err


# --- SIGHUP: exit 129, status interrupted ------------------------------------------------------------------------

def test_sighup_ends_the_run_with_129_and_resume_completes_it(micro_pair, tmp_path):
    """SIGINT and SIGTERM: tests/run/test_run_lifecycle.py. SIGHUP (the terminal closed) ends the run the same
    way: status `interrupted`, exit 129, every round recorded whole; `--resume` then completes the run with
    every round once."""
    prof = _profile(tmp_path, micro_pair, rounds=400)
    proc = _start(prof, tmp_path / "runs")
    children: list[int] = []
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        assert len(children) == 3
        _, err = _stop_run(proc, signal.SIGHUP)
        _gone(children)
    finally:
        kill_all([proc, *children])
    assert "Traceback" not in err, err[-3000:]
    meta = json.loads((run_dir / "meta.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert meta["status"] == summary["status"] == "interrupted" and "SIGHUP" in summary["reason"]
    rounds = _rounds(run_dir)
    _whole(run_dir)
    assert len(rounds) >= 3 and summary["rounds"] == len(rounds)
    meta["profile"]["rounds"] = len(rounds) + 2  # the resumed part short, so that the test stays short
    (run_dir / "meta.json").write_text(json.dumps(meta))
    again = subprocess.run([*CLI, "run", "--resume", str(run_dir), "--quiet", "--no-plots"], capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _rounds(run_dir) == list(range(len(rounds) + 2))
    _whole(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "complete"


# --- kill -9 of the emulator: exit 2 and one clear line ---------------------------------------------------------

def test_a_killed_emulator_ends_the_run_with_2_and_one_line(micro_pair, tmp_path):
    """How fast, on tcp and in a waiting round: tests/system/test_hostile_lan.py. Here: what the user sees on
    stderr, one line naming the emulator, and no traceback."""
    prof = _profile(tmp_path, micro_pair, rounds=5000, channel={"mode": "real"})
    proc = _start(prof, tmp_path / "runs")
    children: list[int] = []
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        (emulator,) = [p for p, argv in _cmdlines(children).items() if b"channel_emulator.proxy" in argv]
        os.kill(emulator, signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
        _gone(children)
    finally:
        kill_all([proc, *children])
    # One error line alone: no WARNING log line repeating it, no `run directory:` line (the log path names it).
    last = _exit_2_with_one_error_line(proc, err)
    assert "channel emulator" in last and "killed by SIGKILL" in last, last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "channel emulator" in summary["reason"]
    _rounds(run_dir)
    _whole(run_dir)


# --- a full disk: exit 2, one line, every record line whole --------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted in the test's folder (root only), unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mount tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path) -> Path:
    """Fill the file system up to its last byte: a file written until ENOSPC."""
    filler = mnt / "filler"
    block = b"\0" * 4096
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:
                fh.write(b"\0")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_a_full_disk_ends_the_run_with_2_one_line_and_whole_records(micro_pair, tmp_path, small_disk):
    """The disk fills up while rounds are flowing: the run ends with exit 2 and one line that says the runs
    directory is full, every line on disk is whole and the rounds recorded are consecutive; freed again, the
    run resumes. (The recorder's own part, a write cut short: tests/run/test_run_lifecycle.py.)"""
    prof = _profile(tmp_path, micro_pair, rounds=100_000)
    runs = small_disk / "runs"
    proc = _start(prof, runs)
    children: list[int] = []
    try:
        run_dir = wait_rounds(runs, 3, proc)
        children = child_pids(proc.pid)
        filler = _fill(small_disk)
        _, err = proc.communicate(timeout=120)
        _gone(children)
    finally:
        kill_all([proc, *children])
    # One error line alone: the abort's own writes, refused by the same full disk, are not said again.
    last = _exit_2_with_one_error_line(proc, err)
    assert last.startswith("multispin run: error: runs directory full or unwritable"), last
    assert "No space left on device" in last, last
    rounds = _rounds(run_dir)
    _whole(run_dir)
    assert len(rounds) >= 3
    filler.unlink()  # space again: the run goes on where it stopped
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] != "complete"
    meta["profile"]["rounds"] = len(rounds) + 2
    (run_dir / "meta.json").write_text(json.dumps(meta))
    again = subprocess.run([*CLI, "run", "--resume", str(run_dir), "--quiet", "--no-plots"], capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _rounds(run_dir) == list(range(len(rounds) + 2))
    _whole(run_dir)


# --- a device paused 8 s, in a whole run with the default liveness window (5 s) ----------------------------------

def test_a_device_paused_8_s_rejoins_the_run(micro_pair, tmp_path):
    """SIGSTOP of a device's process for 8 s (longer than heartbeat_s 1 x liveness 5), then SIGCONT: the edge
    ends its session, the other device goes on alone, and the same process registers again and takes part in
    rounds again. (The edge in the test's thread, a 4 s pause: tests/device/test_device_pause.py.)"""
    prof = _profile(tmp_path, micro_pair, rounds=100_000, heartbeat_s=1.0, liveness=5, deadline_s=1.0)
    proc = _start(prof, tmp_path / "runs")
    children: list[int] = []
    stopped = None
    timer = None
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        stopped = device_pid(children, "d1")
        os.kill(stopped, signal.SIGSTOP)
        r_stop = len(records_so_far(run_dir))
        timer = threading.Timer(8.0, os.kill, (stopped, signal.SIGCONT))  # the fault's length, not a wait
        timer.start()
        # While stopped: rounds without d1 (its session ended); then d1 served again in 3 rounds.
        wait_until(lambda: any("d1" not in r["devices"] for r in records_so_far(run_dir)[r_stop:]), 60,
                   "rounds without the stopped device")
        timer.join(20)
        r_cont = len(records_so_far(run_dir))
        print("stopped at", r_stop, "continued at", r_cont)

        def served_again():
            assert pid_alive(stopped), (run_dir / "logs" / "device-d1.log").read_text()[-500:]
            return sum("d1" in r["devices"] and not r["devices"]["d1"]["missed"]
                       for r in records_so_far(run_dir)[r_cont:]) >= 3

        wait_until(served_again, 60, "the paused device served again")
        assert pid_alive(stopped)  # the same process, not a restart
        _stop_run(proc)
        _gone(children)
    finally:
        if timer is not None:
            timer.cancel()
        if stopped is not None and pid_alive(stopped):
            os.kill(stopped, signal.SIGCONT)
        kill_all([proc, *children])
    _rounds(run_dir)
    _whole(run_dir)
    log = (run_dir / "logs" / "device-d1.log").read_text()
    assert "registering again" in log and "Traceback" not in log, log[-3000:]


# --- deadline 0.25 s, TDMA downlink, 4 devices: a device that misses a round gets `dropped` and serves on ------

def test_devices_that_miss_a_short_deadline_get_dropped_verdicts_and_serve_on(micro_pair, tmp_path):
    """deadline_s 0.25, `dl_access: tdma`, 4 devices, the emulator in the path. d3 is stopped for more than a
    deadline (twice): it misses rounds, takes the edge's `dropped` verdict for each and serves on; every device
    process stays up. (The edge in the test's thread, two devices, no emulator: tests/device/test_device_pause.py.)"""
    data = profile_data(micro_pair, rounds=100_000, deadline_s=0.25, max_misses=1000, channel={"mode": "real"})
    data["scenario"]["dl_access"] = "tdma"
    data["scenario"]["devices"] = [{"name": f"d{i}", "distance_m": 100 + 100 * i, "draft_time_s": 0.001,
                                    "acceptance": 0.6} for i in range(4)]
    data["prompts"] = ["def parse(text):", "import os", "class A:", "for x in"]
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(data))
    proc = _start(prof, tmp_path / "runs")
    children: list[int] = []
    stopped = None

    def recs():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return records_so_far(run_dir)

    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        assert len(children) == 5  # the emulator and four devices
        stopped = device_pid(children, "d3")
        for _ in range(2):
            n = len(recs())
            os.kill(stopped, signal.SIGSTOP)
            # Out of a round: missed (its draft late: a `dropped` verdict) or sitting out (its report late)
            wait_until(lambda n=n: any("d3" in r["missed"] or "d3" not in r["devices"] for r in recs()[n:]), 30,
                       "a round without d3")
            os.kill(stopped, signal.SIGCONT)
            n = len(recs())
            wait_until(lambda n=n: sum("d3" in r["devices"] and not r["devices"]["d3"]["missed"]
                                       for r in recs()[n:]) >= 3, 30, "d3 served again")
        stopped = None
        assert all(pid_alive(p) for p in children)  # no device left over its misses
        _stop_run(proc)
        _gone(children)
    finally:
        if stopped is not None and pid_alive(stopped):
            os.kill(stopped, signal.SIGCONT)
        kill_all([proc, *children])
    _rounds(run_dir)
    _whole(run_dir)
    records = records_so_far(run_dir)
    missed = [r["round"] for r in records if "d3" in r["missed"]]
    out = [r["round"] for r in records if "d3" not in r["devices"]]
    assert len(missed) + len(out) >= 2, (missed, out)
    log = (run_dir / "logs" / "device-d3.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert log.count("dropped by the edge") == len(missed), (missed, log[-3000:])  # one `dropped` per missed round


# --- kill -9 of a device in a whole run: restarted, it rejoins ---------------------------------------------------

def test_a_killed_device_restarted_rejoins_the_run(micro_pair, tmp_path):
    """kill -9 of d1's process; the same command started again (as a user or a supervisor would): the edge
    takes the name over once the dead session is silent for its window, and the new process serves rounds.
    (The edge in the test's thread with a fake verifier: tests/edge/test_edge_faults.py.)"""
    prof = _profile(tmp_path, micro_pair, rounds=100_000, heartbeat_s=0.5, liveness=4, deadline_s=1.0)
    proc = _start(prof, tmp_path / "runs")
    children: list[int] = []
    restarted = None
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        dead = device_pid(children, "d1")
        argv = [a.decode() for a in _cmdlines([dead])[dead] if a]
        environ = Path(f"/proc/{dead}/environ").read_text().split("\0")
        env = dict(line.split("=", 1) for line in environ if "=" in line)
        os.kill(dead, signal.SIGKILL)
        wait_until(lambda: not pid_alive(dead), 10, "the killed device gone")
        n = len(records_so_far(run_dir))
        log = open(tmp_path / "restarted-d1.log", "wb")
        restarted = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

        def served():
            assert restarted.poll() is None, (tmp_path / "restarted-d1.log").read_text()[-500:]
            return sum("d1" in r["devices"] and not r["devices"]["d1"]["missed"]
                       for r in records_so_far(run_dir)[n:]) >= 3

        wait_until(served, 90, "the restarted device served rounds")
        assert restarted.poll() is None
        _stop_run(proc)
        _gone(children)
        assert restarted.wait(30) is not None  # told by the edge's bye, or gone with its edge
    finally:
        kill_all([p for p in (proc, restarted) if p is not None] + children)
    _rounds(run_dir)
    _whole(run_dir)


# --- the table of docs/reliability.md and the tests agree ----------------------------------------------------------

TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`")


def _table_rows() -> list[tuple[str, list[tuple[str, str]]]]:
    """(fault, [(file, test)]) for each row of the table between the markers of docs/reliability.md."""
    text = DOC.read_text()
    table = text.split("<!-- faults: begin -->", 1)[1].split("<!-- faults: end -->", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| fault"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], TEST_REF.findall(cells[-1])))
    return rows


def test_every_test_the_reliability_table_names_exists():
    rows = _table_rows()
    assert len(rows) >= 12, [r[0] for r in rows]
    missing = []
    for fault, refs in rows:
        assert refs, f"row {fault!r} names no test"
        for path, name in refs:
            f = ROOT / path
            if not f.is_file():
                missing.append(f"{path} (no such file)")
                continue
            tree = ast.parse(f.read_text())
            names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if name not in names:
                missing.append(f"{path}::{name}")
    assert not missing, missing
    # And every test of this file is in the table (no promise tested here without its row).
    here = {n.name for n in ast.parse(Path(__file__).read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    named = {name for _, refs in rows for path, name in refs if path.endswith("test_reliability.py")}
    assert here - named == {"test_every_test_the_reliability_table_names_exists"}, here - named
