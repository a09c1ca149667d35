"""`multispin simulate --jobs N` and `--ray`: the same CSV, byte for byte, as the serial run."""

import json
import os
import signal
import sys

import pytest

from testbed import PROFILES_DIR
from testbed.cli import CliError, main
from testbed.cli.simulate import process_map
from testbed.core.simulate import run_sweep, sweep_tasks
from testbed.run.scenario_file import load_scenario

DEFAULT = PROFILES_DIR / "scenarios" / "default.yaml"
# Small but with every random stream in use: drawn devices, a seeded policy, Monte Carlo rounds.
SWEEP = ["simulate", str(DEFAULT), "--sweep", "devices=3,7", "--drops", "3", "--monte-carlo",
         "--policies", "proposed,random-modes,all-dl", "--rounds", "15", "--seed", "4", "--no-progress"]


def _simulate(tmp_path, name, *flags) -> bytes:
    out = tmp_path / name
    assert main([*SWEEP, "--out", str(out), *flags]) == 0
    return (out / "results.csv").read_bytes()


def test_rows_do_not_depend_on_the_order_tasks_run_in():
    base = load_scenario(DEFAULT)
    kw = dict(drops=3, policies=["proposed", "random-modes"], seed=2, monte_carlo_rounds=10)

    def backwards(task, tasks):  # runs the last task first, hands the results back in task order
        done = {i: task(*tasks[i]) for i in reversed(range(len(tasks)))}
        return [done[i] for i in range(len(tasks))]

    serial = run_sweep(base, "dl_power", [0.5, 4.0], **kw)
    assert run_sweep(base, "dl_power", [0.5, 4.0], map_tasks=backwards, **kw) == serial
    assert [(r["value"], r["drop"], r["policy"]) for r in serial] == [
        (v, d, p) for _, v, d in sweep_tasks([0.5, 4.0], 3) for p in ("proposed", "random-modes")]


def test_jobs_2_writes_the_serial_csv(tmp_path, capsys):
    serial = _simulate(tmp_path, "serial", "--jobs", "1")
    assert _simulate(tmp_path, "jobs2", "--jobs", "2") == serial
    assert serial.count(b"\n") == 1 + 2 * 3 * 3
    meta = json.loads((tmp_path / "jobs2" / "meta.json").read_text())
    assert meta["execution"] == {"jobs": 2}


def test_ray_local_instance_writes_the_serial_csv(tmp_path):
    ray = pytest.importorskip("ray", reason="the cluster extra (.ci/run installs it)")
    serial = _simulate(tmp_path, "serial", "--jobs", "1")
    # A local instance with 2 CPUs and no dashboard, shut down by the command that started it.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert _simulate(tmp_path, "ray", "--ray", "--jobs", "2") == serial
    assert not ray.is_initialized()
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # Ray's SIGTERM handler does not stay
    meta = json.loads((tmp_path / "ray" / "meta.json").read_text())
    assert meta["execution"] == {"ray": "local", "num_cpus": 2}


def test_a_workers_error_is_the_users_error(tmp_path, capsys):
    # exhaustive refuses 30 devices inside the worker; the message comes back as a plain CLI error.
    rc = main(["simulate", str(DEFAULT), "--sweep", "devices=30,31", "--drops", "1", "--policies", "exhaustive",
               "--jobs", "2", "--out", str(tmp_path / "x"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exhaustive search needs" in err and "Traceback" not in err


def test_bad_jobs_and_missing_ray_are_clear_errors(tmp_path, capsys, monkeypatch):
    assert main([*SWEEP, "--out", str(tmp_path / "a"), "--jobs", "0"]) == 2
    assert "--jobs 0: must be >= 1" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    assert main([*SWEEP, "--out", str(tmp_path / "b"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "--ray needs Ray" in err and "pip install multispin-testbed[cluster]" in err
    assert not (tmp_path / "b").exists()  # refused before --out is touched


class _Bar:
    def update(self, n):
        pass


def _crash(point, value, drop):
    os._exit(3)  # a worker that dies (killed, out of memory) rather than raising


def test_the_pool_refuses_what_cannot_travel_and_reports_a_dead_worker():
    tasks = sweep_tasks([1, 2], 2)
    with pytest.raises(CliError, match="cannot be sent to worker processes .*--jobs 1 runs it"):
        process_map(2, _Bar())(lambda point, value, drop: [], tasks)
    with pytest.raises(CliError, match="a worker process failed"):
        process_map(2, _Bar())(_crash, tasks)
