"""The figures of docs/where-each-mode-wins.md: where UL mode, DL mode and a mix of both win on a shared uplink.

Runs `multispin simulate` (in this process, as the command line would) once per figure on the default scenario
(profiles/scenarios/default.yaml) with `--set ul_access=fdma_shared`, every policy of the comparison, and draws
each sweep as two panels: the goodput per policy and the share of devices in UL mode
(`testbed.analysis.sim_plots.plot_modes`), into OUT/<figure>.png and .svg. It also writes OUT/tables.md: per
figure, the mean goodput per policy per point, K/N of `proposed` and proposed / the best other policy, and the
command that made it.

Run: python tools/make_mode_figures.py [--out docs/figures] [--drops 10] [--jobs 1] [--only NAME,...] [--quick]
     --quick: two points per sweep and one drop (a check that everything runs, not figures to publish)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["proposed", "all-ul", "all-dl", "common-length", "multispin-homogeneous", "multispin-heterogeneous"]
SHARED = ["--set", "ul_access=fdma_shared"]
N20 = ["--set", "drop.num_devices=20"]

# name -> (sweep, more flags of `simulate`, what the figure shows). The devices sweeps stay at N <= 60: up to
# 64 devices `proposed` on a shared band has multispin-heterogeneous among its starts (system-model.md).
FIGURES = {
    "mode_vs_devices": ("devices=5,10,20,30,40,50,60", [],
                        "N devices, the shared band growing with N (B^U = N x 1 MHz, the dedicated bands' spectrum)"),
    "mode_vs_devices_fixed_band": ("devices=5,10,20,30,40,50,60", ["--set", "uplink_total_bandwidth_hz=4e7"],
                                   "N devices sharing one 40 MHz uplink"),
    "mode_vs_ul_band": ("uplink_total_bandwidth_hz=5e6,1e7,2e7,5e7,1e8,2e8", N20,
                        "the shared uplink's total band B^U, N = 20"),
    "mode_vs_dl_band": ("dl_bandwidth=1e6,2e6,5e6,1e7,2e7,5e7,1e8", N20, "the downlink band B^D, N = 20"),
    "mode_vs_vocab": ("vocab_size=8000,16000,32000,64000,151936,256000", N20, "the vocabulary size V, N = 20"),
}


def simulate_args(name: str, out: Path, drops: int, jobs: int, quick: bool) -> list[str]:
    """The `multispin simulate` arguments of one figure."""
    sweep, flags, _ = FIGURES[name]
    if quick:
        key, _, values = sweep.partition("=")
        sweep = f"{key}={','.join(values.split(',')[:2])}"
    return ["simulate", *SHARED, *flags, "--sweep", sweep, "--policies", ",".join(POLICIES), "--drops", str(drops),
            "--seed", "0", "--jobs", str(jobs), "--no-progress", "--force", "--out", str(out)]


def read_rows(path: Path) -> list[dict]:
    """results.csv of `simulate` with the columns the figures and tables use typed."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            try:
                value = float(r["value"])
                value = int(value) if value.is_integer() and r["sweep_key"] in ("devices", "vocab_size") else value
            except ValueError:
                value = r["value"]
            rows.append({**r, "value": value, "drop": int(r["drop"]), "num_devices": int(r["num_devices"]),
                         "num_ul_devices": int(r["num_ul_devices"]), "goodput_tps": float(r["goodput_tps"])})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: per point the mean goodput of each policy, K/N of proposed, the best other and the ratio."""
    import numpy as np

    key = rows[0]["sweep_key"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    values = list(dict.fromkeys(r["value"] for r in rows))
    head = [key, *policies, "K/N (proposed)", "best other", "proposed / best other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in values:
        mean = {p: float(np.mean([r["goodput_tps"] for r in rows if r["value"] == v and r["policy"] == p]))
                for p in policies}
        share = float(np.mean([r["num_ul_devices"] / r["num_devices"] for r in rows
                               if r["value"] == v and r["policy"] == "proposed"]))
        best = max((p for p in policies if p != "proposed"), key=mean.get)
        shown = f"{v:g}" if isinstance(v, (int, float)) else str(v)
        cells = [shown, *(f"**{mean[p]:.2f}**" if mean[p] >= max(mean.values()) - 1e-9 else f"{mean[p]:.2f}"
                          for p in policies), f"{share:.2f}", best, f"{mean['proposed'] / mean[best]:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="folder of the figures (docs/figures)")
    parser.add_argument("--drops", type=int, default=10, help="random drops per sweep point (default 10)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes of each simulation (default 1)")
    parser.add_argument("--only", default=None, help=f"comma-separated figures (default all: {', '.join(FIGURES)})")
    parser.add_argument("--quick", action="store_true", help="two points per sweep, one drop: a smoke test")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "multispin"  # the same SVG ids every time: diffs show real changes

    from testbed.analysis.sim_plots import plot_modes
    from testbed.cli import main as multispin

    names = [n.strip() for n in args.only.split(",")] if args.only else list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        parser.error(f"--only: unknown figure {unknown[0]!r} (figures: {', '.join(FIGURES)})")
    drops = 1 if args.quick else args.drops
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = []
    with tempfile.TemporaryDirectory(prefix="mode-figures-") as tmp:
        for name in names:
            sim = simulate_args(name, Path(tmp) / name, drops, args.jobs, args.quick)
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # its table: the one below has more
                rc = multispin(sim)
            if rc != 0:
                print(f"{name}: multispin simulate failed", file=sys.stderr)
                return 1
            wall = time.perf_counter() - start
            rows = read_rows(Path(tmp) / name / "results.csv")
            what = FIGURES[name][2]
            paths = plot_modes(rows, out / name, formats=("png", "svg"),
                               title=f"Shared uplink (fdma_shared): goodput and UL-mode share vs {what}, "
                                     f"{drops} drops")
            shown = " ".join(shlex.quote(a) for a in sim if a not in ("--force", "--no-progress"))
            shown = shown.replace(str(Path(tmp) / name), f"/tmp/{name}")
            sections.append(f"### {name}: {what}\n\n`multispin {shown}` ({wall:.1f} s)\n\n{table(rows)}\n")
            print(f"{name}: {wall:.1f} s, " + ", ".join(str(p) for p in paths), flush=True)
    (out / "tables.md").write_text("Mean goodput (tokens/s) per policy per point; the best in bold.\n\n"
                                   + "\n".join(sections))
    print(f"wrote {out / 'tables.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
