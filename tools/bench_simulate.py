"""Time a `multispin simulate` sweep serially and with a pool of worker processes (`--jobs 2`), side by side.

Prints the median wall time of each (runs alternated so that both see the same machine load; the pool's
start-up, spawned processes importing the simulator, is inside its time) and CPU time, their ratio, whether
both gave the same rows, and the load average (on a shared machine other work takes from the pool's share).
Then one drop of 1,000 devices (`--big`) planned by `proposed`: its time and the peak memory Python
allocated for it (tracemalloc), the figure issue 12 asks for.

Run: python tools/bench_simulate.py [--sweep devices=20,50,100,200] [--drops 4] [--policies a,b]
     [--jobs 2] [--repeats 3] [--rounds 0] [--big 1000]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

from bench_common import interleaved_medians  # tools/ is on sys.path when a script here runs

from testbed import PROFILES_DIR
from testbed.cli.simulate import parse_sweep, process_map
from testbed.core.optimizer import plan
from testbed.core.simulate import DEFAULT_POLICIES, point_scenario, run_sweep
from testbed.run.scenario_file import load_scenario


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (a pool's workers, once shut down)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class _NoBar:
    def update(self, n: int) -> None:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(PROFILES_DIR / "scenarios" / "default.yaml"))
    ap.add_argument("--sweep", default="devices=20,50,100,200")
    ap.add_argument("--drops", type=int, default=4)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=0, help="Monte Carlo rounds per plan (0: none)")
    ap.add_argument("--big", type=int, default=1000, help="devices in the one-drop timing (0: skip it)")
    args = ap.parse_args(argv)

    base = load_scenario(Path(args.profile))
    key, values = parse_sweep(args.sweep)
    kw = dict(drops=args.drops, policies=args.policies.split(","), monte_carlo_rounds=args.rounds)
    results, cpu = {}, {"serial": [], "pool": []}

    def timed(name, map_tasks):
        def once():
            c0 = _cpu_s()
            t0 = time.perf_counter()
            results[name] = run_sweep(base, key, values, map_tasks=map_tasks, **kw)
            dt = time.perf_counter() - t0
            cpu[name].append(_cpu_s() - c0)
            return dt
        return once

    serial, pooled = interleaved_medians(timed("serial", None), timed("pool", process_map(args.jobs, _NoBar())),
                                         args.repeats)
    tasks = len(values) * args.drops
    print(f"sweep {args.sweep}, {args.drops} drops, {len(kw['policies'])} policies ({tasks} tasks), "
          f"median of {args.repeats}:")
    print(f"  serial   {serial:8.2f} s   (CPU {statistics.median(cpu['serial']):.2f} s)")
    print(f"  --jobs {args.jobs} {pooled:8.2f} s   (CPU {statistics.median(cpu['pool']):.2f} s, workers included)   "
          f"serial/jobs = {serial / pooled:.2f}x   same rows: {results['serial'] == results['pool']}")
    print(f"  load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: other work on the cores "
          f"takes from the pool's share")
    if args.big:
        sc = point_scenario(base, "devices", args.big, 0, 0)
        tracemalloc.start()
        t0 = time.perf_counter()
        p = plan(sc, "proposed", seed=0)
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"one drop of {args.big} devices, proposed: {dt:.2f} s, peak allocation {peak / 1e6:.0f} MB, "
              f"K* = {p.evaluation.num_ul_devices}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
