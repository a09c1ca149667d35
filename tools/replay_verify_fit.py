"""Replay recorded runs' verification times through the edge's online verification fit, as it is now.

    python tools/replay_verify_fit.py RUN_DIR [RUN_DIR ...]

For each run: the controller starts from the run's calibration (meta.json `calibration`, else the profile's
t0, t1), then round by round predicts the verification of the round's batch (its drafted positions and any
prompt prefill) and observes the measured time, as `edge_node.controller.Controller.observe_verify` does live.
Prints, per run and over all, the median |error| of the verification and of the round time with that
verification in place of the recorded one (the other phases as recorded). A change to the fit can then be
judged on real runs before a live one: docs/models.md has the figures that chose the current rule."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from edge_node.controller import Controller
from testbed.run.scenario_file import load_scenario


def replay(run: Path, fit_after: int | None = None) -> tuple[list[float], list[float]]:
    """(verification errors, round-time errors), predicted / measured - 1, round by round; `fit_after`: the
    rounds before the fit (default: the controller's current default, not the run's recorded setting)."""
    meta = json.loads((run / "meta.json").read_text())
    scenario = meta["profile"]["scenario"]
    kw = {} if fit_after is None else {"fit_verify_after": fit_after}
    ctl = Controller(load_scenario({**scenario, "devices": scenario["devices"][:1]}), **kw)
    ctl.calibrate = True
    ctl.calibrate_verify(meta.get("calibration"))
    verify_err, round_err = [], []
    for line in (run / "rounds.jsonl").read_text().splitlines():
        r = json.loads(line)
        measured = r["measured"].get("verify_s")
        if not measured:
            continue
        positions = sum(d["draft_len"] + 1 for d in r["devices"].values() if not d["missed"])
        prefill = (r.get("verify_model") or {}).get("prefill_positions", 0)
        predicted = ctl.t0 + ctl.t1 * (positions + prefill)
        verify_err.append(predicted / measured - 1)
        rest = r["predicted"]["round_s"] - r["predicted"]["verify_s"]
        round_err.append((rest + predicted) / r["measured"]["round_s"] - 1)
        ctl.observe_verify(positions, measured, prefill_positions=prefill)
    return verify_err, round_err


def median_abs(xs: list[float]) -> float:
    return 100 * statistics.median(abs(x) for x in xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--fit-after", type=int, default=None,
                    help="rounds before the online fit (default: the controller's current default)")
    args = ap.parse_args()
    all_v, all_r, above = [], [], 0
    for run in args.runs:
        if not (run / "rounds.jsonl").is_file():
            print(f"{run}: no rounds.jsonl", file=sys.stderr)
            continue
        v, r = replay(run, args.fit_after)
        if not r:
            continue
        all_v += v
        all_r += r
        above += median_abs(r) > 10
        print(f"{run}: {len(r)} rounds, round 0 {100 * r[0]:+.1f}%, median |round error| {median_abs(r):.1f}%, "
              f"median |verification error| {median_abs(v):.1f}%")
    if not all_r:
        print("no run with verified rounds", file=sys.stderr)
        return 1
    print(f"all {len(all_r)} rounds: median |round error| {median_abs(all_r):.1f}%, median |verification error| "
          f"{median_abs(all_v):.1f}%; runs above 10%: {above}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
