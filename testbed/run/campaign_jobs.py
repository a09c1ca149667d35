"""A campaign's runs side by side: `--jobs N` worker processes on this host, or `--ray [ADDRESS]` Ray tasks.

Runs are independent: each starts its own edge, emulator and devices, on ipc:// sockets in a private temp
folder (a profile with fixed TCP endpoints cannot run twice at once and is refused). A worker runs one run
at a time with `testbed.run.campaign.run_trial`, as the serial loop does; this process writes results.csv
and the point's compare files as each run ends. A Ray task is one run: its processes start where the task
runs, so a run's edge, emulator and devices share one node.

Runs side by side share the host's cores: their measured times include that contention (meta.json and
results.csv say how many ran at once: `jobs`). `check_jobs` refuses more runs at once than cores, or than the
memory left holds.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from testbed.runtime.errors import TestbedError
from testbed.runtime.ray_instance import ray_instance

# Resident memory of one run's processes on the default pair (measured: edge ~560 MB with the target model
# loaded, emulator ~45 MB, a device process ~90 MB), rounded up.
EDGE_MB, EMULATOR_MB, DEVICE_MB = 700, 60, 100


class JobsError(TestbedError):
    """--jobs or --ray that this host or this campaign cannot honour."""


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_mb() -> float | None:
    """MemAvailable of /proc/meminfo in MB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def run_mb(profile, pair: dict | None = None) -> float:
    """Resident memory one run needs: its processes, plus the target model's files (loaded by the edge)."""
    target = Path(str((pair or {}).get("target") or ""))
    files = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) if target.is_dir() else 0
    n = len(profile.device_names())
    return EDGE_MB + EMULATOR_MB + DEVICE_MB * n + files / 2**20


def check_jobs(jobs: int, runs: list, pair: dict | None = None, *, cores: int | None = None,
               memory_mb: float | None = None) -> None:
    """Refuse --jobs N that the host cannot hold: more than its cores, or N of the campaign's largest runs
    beyond the memory available; and any N > 1 when the runs bind fixed endpoints."""
    if jobs < 1:
        raise JobsError(f"--jobs {jobs}: must be >= 1")
    cores = host_cores() if cores is None else cores
    if jobs > cores:
        raise JobsError(f"--jobs {jobs}: this host has {cores} core(s) for this process; at most --jobs {cores} "
                        f"(each run also starts an emulator and a process per device)")
    if jobs == 1 or not runs:
        return
    fixed = [f for f in ("edge_bind", "channel_frontend", "channel_control")
             if getattr(runs[0].profile.endpoints, f, None)]
    if fixed:
        names = ", ".join("endpoints." + f for f in fixed)
        raise JobsError(f"--jobs {jobs}: the profile binds fixed endpoints ({names})"
                        f", which two runs at once cannot share; leave them unset (private ipc:// sockets) or use "
                        f"--jobs 1")
    need = max(run_mb(r.profile, pair) for r in runs)
    have = available_mb() if memory_mb is None else memory_mb
    if have is not None and jobs * need > have:
        most = max(1, int(have // need))
        raise JobsError(f"--jobs {jobs}: {jobs} runs at once need about {jobs * need:.0f} MB and {have:.0f} MB is "
                        f"available; at most --jobs {most}")


def busy_note(jobs: int) -> str | None:
    """A warning when the host's load leaves fewer idle cores than `jobs` (runs at once would slow each other,
    and their measured times would carry it)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    idle = host_cores() - load
    if jobs > 1 and idle < jobs:
        return (f"--jobs {jobs}: the host is busy (load {load:.1f} on {host_cores()} cores): runs side by side will "
                f"be slower than one at a time, and their measured times include the contention")
    return None


def parallel(jobs: int, ray: str | None = None, warm: bool = True):
    """A `runner` for `testbed.run.campaign.run_campaign`: `jobs` runs at once here, or Ray tasks (`ray`: an
    address, "" for a new local instance); with `warm`, each worker process runs its runs as warm trials
    (`testbed.run.warm`; a Ray task is one run)."""
    import functools

    return functools.partial(run_parallel, jobs=jobs, ray=ray, warm=warm)


def run_parallel(camp, todo: list, pair: dict, *, plots: bool, bar, jobs: int, ray: str | None,
                 warm: bool = True) -> list[tuple]:
    """The runs of `todo` ((index, run) pairs) `jobs` at a time; the failed ones as (run, why)."""
    from testbed.run.campaign import trial_done, trial_line

    failed: list[tuple] = []

    def ended(k, run, info, error):
        if error is not None:
            failed.append((run, error))
        bar.write(trial_line(camp, k, run, info, error))
        trial_done(camp, run, plots=plots)
        bar.update(1)

    from testbed.run.launcher import interrupt_signals

    camp.meta = {**camp.meta, "jobs": jobs if ray is None else f"ray:{ray or 'local'}"}
    with interrupt_signals():  # SIGTERM and SIGHUP stop the workers' runs as Ctrl-C does
        if ray is not None:
            _ray_runs(camp, todo, pair, plots, jobs, ray, ended)
        else:
            _process_runs(camp, todo, pair, plots, jobs, ended, bar, warm)
    return failed


def _trial_in_worker(run, meta: dict, pair: dict, plots: bool, title: str, pool=None):
    """A worker's run: (its RunInfo, None) or (None, the error a TestbedError gave); `pool`: the worker's
    `testbed.run.warm.WarmPool` (warm trials)."""
    from testbed.run.campaign import run_trial

    try:
        return run_trial(run, meta, pair, plots=plots, title=title, pool=pool), None
    except TestbedError as exc:
        return None, str(exc)


def _worker_main(conn, warm: bool = True) -> None:
    """A spawned worker process: runs one after another as they come over `conn` (imports and the model
    loader's caches are paid once per worker, not per run; with `warm` the target and the processes too: warm
    trials), each outcome sent back; None ends it."""
    import logging

    from testbed.run.warm import WarmPool

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pool = WarmPool(say=logging.getLogger("multispin.warm").info) if warm else None
    try:
        while (task := conn.recv()) is not None:
            conn.send(_trial_in_worker(*task, pool=pool))
    except KeyboardInterrupt:  # Ctrl-C or the parent's SIGINT: the run recorded itself as interrupted
        conn.send((None, "interrupted"))
    except EOFError:  # the parent went away
        pass
    finally:
        if pool is not None:
            pool.close()
        conn.close()


def _title(camp, run) -> str:
    return f"{camp.out.name}/{run.label}/{run.run_dir.name}"


def _process_runs(camp, todo: list, pair: dict, plots: bool, jobs: int, ended, bar, warm: bool = True) -> None:
    """`jobs` spawned worker processes, each given the next run as it finishes one; Ctrl-C (or SIGTERM) stops
    every busy worker by its id with SIGINT, so that its run records itself as interrupted (resumable)."""
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")  # not fork: this process holds threads (tqdm, BLAS)
    queue = list(todo)
    workers = []
    for _ in range(min(jobs, len(todo))):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(theirs, warm))
        proc.start()
        theirs.close()
        workers.append((proc, mine))
    busy: dict = {}  # connection -> (process, index, run)
    try:
        while queue or busy:
            for proc, conn in workers:
                if conn not in busy and queue:
                    k, run = queue.pop(0)
                    conn.send((run, camp.run_meta(run), pair, plots, _title(camp, run)))
                    busy[conn] = (proc, k, run)
            bar.set_postfix_str("running: " + "; ".join(f"{r.label} {r.policy}" for _, _, r in busy.values()),
                                refresh=True)
            for conn in wait(list(busy)):
                proc, k, run = busy.pop(conn)
                try:
                    info, error = conn.recv()
                except EOFError:
                    info, error = None, f"its worker process died (exit status {proc.exitcode})"
                    workers = [(p, c) for p, c in workers if c is not conn]
                    if not workers:
                        queue = []  # nothing left to run them on
                ended(k, run, info, error)
    except BaseException:
        for proc, _, _ in busy.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)
        raise
    finally:
        for _, conn in workers:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc, _ in workers:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _ray_runs(camp, todo: list, pair: dict, plots: bool, jobs: int, address: str, ended) -> None:
    """One Ray task per run (one CPU each; its processes start on the task's node). The campaign folder must
    be at the same path on every node (a shared file system) for a cluster: a run whose folder is not here
    afterwards is reported as failed with that reason."""
    with ray_instance(address, jobs, JobsError) as ray:
        _ray_wait(ray, camp, todo, pair, plots, ended)


def _ray_wait(ray, camp, todo: list, pair: dict, plots: bool, ended) -> None:
    pending: list = []
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(_trial_in_worker)
        refs = {remote.remote(run, camp.run_meta(run), pair, plots, _title(camp, run)): (k, run) for k, run in todo}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            k, run = refs[ready[0]]
            try:
                info, error = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                info, error = None, f"its Ray task failed: {str(exc).splitlines()[0]}"
            if error is None and not (run.run_dir / "meta.json").is_file():
                info, error = None, (f"ran on another node, and {run.run_dir} is not on this host: put the campaign "
                                     f"folder on a file system every node shares")
            ended(k, run, info, error)
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise
