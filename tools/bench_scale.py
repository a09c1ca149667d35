"""Emulation at scale: `multispin run` with many devices on the micro pair, k devices per process
(`devices_per_process`), measuring the whole run's memory and how well each round's time was predicted.

    python tools/bench_scale.py [--devices 256] [--per-process 32] [--rounds 30] [--channel virtual]
                                [--pair micro|DIR] [--runs-dir DIR]

`--per-process` takes several values (e.g. 1,32) to compare them one after the other. Per run it prints:
processes started, peak memory of the run (`multispin run` and every process below it, sampled from /proc:
the sum of RSS, and the sum of PSS, which counts shared libraries once), the rounds per second, and the
round time predicted vs measured (median of |measured - predicted| / measured over the rounds, after the
first `--warmup` rounds, and the summary's own median error, relative to the prediction).
Devices cycle through the four shipped hardware profiles (edge-class, laptop, phone, phone-slow).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

HARDWARE = ("edge-class", "laptop", "phone", "phone-slow")
PAGE = os.sysconf("SC_PAGE_SIZE")


def pair_paths(which: str):
    from model_pairs.model_pair import MICRO_CONFIG, PairPaths, build_pair

    if which == "micro":
        root = Path(tempfile.gettempdir()) / "multispin-bench-micro"
        paths = PairPaths.under(root)
        return paths if paths.manifest.is_file() else build_pair(MICRO_CONFIG, root, progress=False)
    return PairPaths.under(Path(which))


def profile(pair, devices: int, per_process: int, rounds: int, channel: str, seed: int, on_air: int) -> dict:
    """profiles/emulation.yaml's channel, radio and hardware mix with `devices` devices on the micro pair."""
    names = [f"d{i:03d}" for i in range(devices)]
    return {
        "name": f"scale-{devices}x{per_process}", "deployment": "emulation", "seed": seed, "rounds": rounds,
        "policy": "proposed", "deadline_s": 60.0, "max_misses": 3, "wait_for_devices_s": 900.0,
        "devices_per_process": per_process, "on_air_vocab_size": on_air or None,
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer), "threads": 1},
        "channel": {"mode": channel, "spin_s": 0.0005,
                    "state": {"source": "model", "fading": "rayleigh", "path_loss_law": "3gpp_macro"}},
        "hardware": {n: HARDWARE[i % len(HARDWARE)] for i, n in enumerate(names)},
        "scenario": {
            "bits_per_prob": 16, "max_draft_len": 8, "uplink_bandwidth_hz": 2.0e6, "downlink_bandwidth_hz": 2.0e6,
            "downlink_power_w": 1.0, "verify_t0_s": 0.01, "verify_t1_s": 0.0005,
            "devices": [{"name": n, "distance_m": 50.0 + 400.0 * i / max(1, devices - 1), "max_power_w": 0.2,
                         "draft_time_s": 0.0005, "acceptance": 0.6} for i, n in enumerate(names)],
        },
    }


def _tree(root: int) -> list[int]:
    """`root` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _memory(pids: list[int], pss: bool) -> tuple[int, int]:
    """(sum of RSS, sum of PSS or 0) in bytes."""
    rss = prop = 0
    for pid in pids:
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            if pss:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        prop += int(line.split()[1]) * 1024
                        break
        except (OSError, IndexError, ValueError):
            continue
    return rss, prop


def run_once(pair, args, per_process: int, work: Path) -> dict:
    prof = work / f"scale-{args.devices}x{per_process}.yaml"
    prof.write_text(yaml.safe_dump(profile(pair, args.devices, per_process, args.rounds, args.channel, args.seed,
                                           args.on_air_vocab)))
    runs = work / f"runs-{per_process}"
    cmd = [sys.executable, "-c", "import sys; from testbed.cli import main; sys.exit(main(sys.argv[1:]))",
           "run", str(prof), "--runs-dir", str(runs), "--quiet", "--no-plots"]
    t0 = time.monotonic()
    # Its output goes to a file: a pipe nobody reads while the memory is sampled fills at 64 KiB, and the
    # summary of a 1,024-device run (a line per device) then blocked the run at its last print.
    log_path = work / f"run-{args.devices}x{per_process}.out"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    peak_rss = peak_pss = 0
    procs = 0
    try:
        while proc.poll() is None:
            pids = _tree(proc.pid)
            procs = max(procs, len(pids))
            rss, pss = _memory(pids, pss=True)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(args.sample_s)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    out = log_path.read_text()
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"multispin run failed ({proc.returncode}):\n{out[-4000:]}")
    run_dir = next(p for p in runs.iterdir() if p.is_dir())
    summary = json.loads((run_dir / "summary.json").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    kept = records[args.warmup:]
    pred = np.array([r["predicted"]["round_s"] for r in kept], float)
    meas = np.array([r["measured"]["round_s"] for r in kept], float)
    wall = sum(r["measured"].get("wall_round_s") or 0.0 for r in records)
    missed = sum(len(r["missed"]) for r in records)
    device_procs = [k for k in meta["processes"] if k != "channel"]
    return {
        "per_process": per_process, "device_processes": len(device_procs), "processes_seen": procs,
        "peak_rss_gb": peak_rss / 1e9, "peak_pss_gb": peak_pss / 1e9, "rounds": len(records),
        "rounds_per_s": len(records) / wall if wall else None, "run_s": elapsed, "missed": missed,
        "median_abs_err_vs_measured": float(np.median(np.abs(meas - pred) / meas)),
        "median_err_vs_measured": float(np.median((meas - pred) / meas)),
        "summary_round_error": summary.get("phase_errors", {}).get("round_s"),
        "median_round_s": {"measured": float(np.median(meas)), "predicted": float(np.median(pred))},
        "time_base": summary.get("time_base"), "run_dir": str(run_dir),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=256)
    ap.add_argument("--per-process", default="32", help="devices per process; several, comma-separated: 1,32")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="first rounds left out of the prediction error")
    ap.add_argument("--channel", choices=["virtual", "real"], default="real",
                    help="real (default, as profiles/emulation.yaml): messages held for their air time")
    ap.add_argument("--on-air-vocab", type=int, default=151936,
                    help="distributions padded to this many entries on the air (default: Qwen2.5's 151,936, the "
                         "paper's scale, as profiles/emulation.yaml); 0: the micro pair's own 320")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pair", default="micro", help="micro | a pair directory")
    ap.add_argument("--runs-dir", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--sample-s", type=float, default=0.5, help="seconds between two memory samples")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    pair = pair_paths(args.pair)
    work = Path(args.runs_dir or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for k in (int(x) for x in args.per_process.split(",")):
        res = run_once(pair, args, k, work)
        results.append(res)
        if not args.json:
            mr = res["median_round_s"]
            err = res["summary_round_error"] or {}
            print(f"{args.devices} devices, {k} per process: {res['device_processes']} device processes "
                  f"({res['processes_seen']} in the run's tree)\n"
                  f"  peak memory: sum of RSS {res['peak_rss_gb']:.2f} GB, sum of PSS {res['peak_pss_gb']:.2f} GB\n"
                  f"  {res['rounds']} rounds ({args.channel} channel, time base {res['time_base']}), "
                  f"{res['rounds_per_s']:.3f} rounds/s on the edge's clock, whole run {res['run_s']:.0f} s, "
                  f"{res['missed']} device-rounds missed\n"
                  f"  round time: median measured {1e3 * mr['measured']:.1f} ms, predicted {1e3 * mr['predicted']:.1f}"
                  f" ms; median |meas - pred| / meas {res['median_abs_err_vs_measured']:.1%} (signed "
                  f"{res['median_err_vs_measured']:+.1%}) after {args.warmup} warm-up rounds; summary (all rounds, "
                  f"vs predicted): median |error| {err.get('median_abs_error', float('nan')):.1%}\n"
                  f"  run directory: {res['run_dir']}", flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
