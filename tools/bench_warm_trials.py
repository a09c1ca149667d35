"""Start time of a trial, cold against warm (`testbed.run.warm.WarmPool`), on the default pair.

    python tools/bench_warm_trials.py [--profile emulation] [--trials 3] [--rounds 3] [--json]

Runs `--trials` short live runs of the profile (the policies of `multispin compare` in turn) one after another
twice: cold (every run loads the target and starts the emulator and the device processes, as before warm
trials) and warm (one pool: the first run starts them, the next runs reuse them). A trial's start is the time
from the end of the trial before it (the return of `run_live`; for the first, its call) to the start of its
round 0 (the end of round 0 less its measured round time); its gap is the time from the last round of the
trial before to its round 0 (the end of that run, its files and the stopping of its processes included). Prints
both side by side per trial, the medians of the trials after the first and their ratio. Plots are not made
(`compare --no-plots`): they are the same work cold or warm. The target of issue 30: after the first trial,
under 2 s from one trial's end to the next one's round 0 (the gap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

POLICIES = ("proposed", "all-ul", "all-dl")


def run_trials(base, pair, out: Path, trials: int, pool) -> tuple[list[float], list[float]]:
    """Each trial's start and gap (s), as the module docstring defines them."""
    from testbed.run.compare import policy_profile
    from testbed.run.live import run_live

    starts: list[float] = []
    gaps: list[float] = []
    first_round: list[float] = []
    last_round = [time.monotonic()]

    def on_round(rec, server, launcher) -> None:
        now = time.monotonic()
        if not first_round:
            first_round.append(now - rec["measured"]["round_s"])
        last_round[0] = now

    ended = time.monotonic()
    for k in range(trials):
        first_round.clear()
        previous_last = last_round[0] if k else ended
        profile = policy_profile(base, POLICIES[k % len(POLICIES)], 0)
        summary = run_live(profile, out / f"trial{k}", progress=False, pair=pair, on_round=on_round, pool=pool,
                           say=lambda text: None)
        if summary.get("status") not in ("complete", "degraded") or not first_round:
            raise SystemExit(f"trial {k} did not complete: {summary.get('status')}: {summary.get('reason')}")
        starts.append(first_round[0] - ended)
        gaps.append(first_round[0] - previous_last)
        ended = time.monotonic()
    return starts, gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="emulation", help="profile name or YAML (default: emulation)")
    ap.add_argument("--trials", type=int, default=3, help="trials per set (default 3; at least 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per trial (default 3)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    if args.trials < 2:
        ap.error("--trials: at least 2 (the first trial of a pool is cold)")

    import logging

    logging.basicConfig(level=logging.WARNING)
    from testbed.run.launcher import resolve_pair
    from testbed.run.profile import load_profile
    from testbed.run.warm import WarmPool

    base = load_profile(args.profile).model_copy(update={"rounds": args.rounds})
    pair = resolve_pair(base, progress=True)
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        cold, cold_gap = run_trials(base, pair, Path(tmp) / "cold", args.trials, None)
        with WarmPool(say=lambda text: None) as pool:
            warm, warm_gap = run_trials(base, pair, Path(tmp) / "warm", args.trials, pool)
    cold_med, warm_med = statistics.median(cold[1:]), statistics.median(warm[1:])
    gap_cold, gap_warm = statistics.median(cold_gap[1:]), statistics.median(warm_gap[1:])
    figures = {"profile": args.profile, "rounds": args.rounds, "cold_start_s": cold, "warm_start_s": warm,
               "cold_gap_s": cold_gap, "warm_gap_s": warm_gap,
               "cold_after_first_median_s": cold_med, "warm_after_first_median_s": warm_med,
               "cold_gap_after_first_median_s": gap_cold, "warm_gap_after_first_median_s": gap_warm,
               "ratio": cold_med / warm_med if warm_med > 0 else None}
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"start of a trial ({args.profile}, {args.rounds} rounds each): end of the trial before -> its round 0")
    print("(gap: from the last round of the trial before, its end of run and stop included)")
    print(f"{'trial':>5}  {'cold s':>8}  {'warm s':>8}  {'cold gap s':>10}  {'warm gap s':>10}")
    for k in range(len(cold)):
        print(f"{k + 1:>5}  {cold[k]:8.2f}  {warm[k]:8.2f}  {cold_gap[k]:10.2f}  {warm_gap[k]:10.2f}"
              + ("   (a pool's first trial is cold)" if k == 0 else ""))
    print(f"after the first: median start cold {cold_med:.2f} s, warm {warm_med:.2f} s ({figures['ratio']:.1f}x); "
          f"median gap cold {gap_cold:.2f} s, warm {gap_warm:.2f} s (target: warm < 2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
