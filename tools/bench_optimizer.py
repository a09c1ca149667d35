"""Time one `proposed` plan for N = 8, 32, 128, 512 random devices (spec section 5 drops).

Prints the median of several runs per N, the growth exponent of a log-log fit, and whether N = 128
meets the live controller's budget of 100 ms per plan. Run: python tools/bench_optimizer.py [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from testbed.core.optimizer import plan
from testbed.core.scenario import DropSpec, Scenario
from testbed.core.simulate import draw_devices

BUDGET_S = 0.100


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="8,32,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default="proposed")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    medians = []
    print(f"{'N':>6} {'median ms':>10} {'min ms':>8} {'K':>5} {'mean L':>7} {'evaluations':>12}")
    for n in sizes:
        sc = Scenario.from_dict(dict(devices=draw_devices(DropSpec(), n, (0, 0))))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            p = plan(sc, args.policy)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        medians.append(med)
        print(f"{n:>6} {med * 1e3:>10.1f} {min(times) * 1e3:>8.1f} {p.evaluation.num_ul_devices:>5} "
              f"{np.mean(p.draft_lens):>7.2f} {p.info['evaluations']:>12}")
    slope = np.polyfit(np.log(sizes), np.log(medians), 1)[0]
    print(f"growth exponent (log-log fit of median time vs N): {slope:.2f}")
    if 128 in sizes:
        t128 = medians[sizes.index(128)]
        verdict = "OK" if t128 < BUDGET_S else "OVER BUDGET"
        print(f"N=128: {t128 * 1e3:.1f} ms vs budget {BUDGET_S * 1e3:.0f} ms -> {verdict} "
              f"(ratio {t128 / BUDGET_S:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
