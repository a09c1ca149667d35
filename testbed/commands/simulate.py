"""`multispin simulate [PROFILE] --sweep KEY=V1,V2,... --out DIR`: the offline simulator."""

from __future__ import annotations

from pathlib import Path

from testbed import PROFILES_DIR

DEFAULT_PROFILE = PROFILES_DIR / "scenarios" / "default.yaml"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="sweep a parameter over random drops and policies (analytic, optional Monte Carlo)",
        description="Offline simulator: for each sweep value and each seeded drop, plan every policy and "
                    "record the predicted goodput; writes results.csv and PNG plots to --out.")
    p.add_argument("profile", nargs="?", default=str(DEFAULT_PROFILE),
                   help="scenario profile with a `drop:` section (default profiles/scenarios/default.yaml)")
    p.add_argument("--sweep", required=True,
                   help="KEY=V1,V2,... with KEY one of devices, dl_bandwidth, dl_power, ul_bandwidth, "
                        "bits_per_prob, acceptance, vocab_size, max_draft_len")
    p.add_argument("--drops", type=int, default=5, help="random drops per sweep point (default 5)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies (default: all but exhaustive)")
    p.add_argument("--fixed-length", type=int, default=4, help="draft length of the fixed-length policy")
    p.add_argument("--monte-carlo", action="store_true", help="add a token-level simulation per plan")
    p.add_argument("--rounds", type=int, default=200, help="Monte Carlo rounds per plan (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (results.csv, *.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def run(args) -> int:
    from tqdm import tqdm

    from testbed.cli import CliError
    from testbed.core.optimizer import OptimizerError
    from testbed.core.scenario import ScenarioError
    from testbed.core.simulate import DEFAULT_POLICIES, SimulationError, parse_sweep, run_sweep, summary_table
    from testbed.scenario_file import load_scenario
    from testbed.sim_plots import plot_sweep

    try:
        base = load_scenario(args.profile)
        key, values = parse_sweep(args.sweep)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else DEFAULT_POLICIES
        if args.rounds < 1:
            raise SimulationError(f"--rounds: {args.rounds} is not allowed: must be >= 1")
        out = Path(args.out)
        total = len(values) * args.drops * len(policies)
        with tqdm(total=total, desc=f"simulate {key}", unit="plan", disable=args.no_progress) as bar:
            rows = run_sweep(base, key, values, drops=args.drops, policies=policies, seed=args.seed,
                             monte_carlo_rounds=args.rounds if args.monte_carlo else 0,
                             fixed_length=args.fixed_length, progress=bar.update)
    except (ScenarioError, SimulationError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    _write_csv(rows, out / "results.csv")
    paths = plot_sweep(rows, out)
    print(summary_table(rows))
    print(f"wrote {out / 'results.csv'} ({len(rows)} rows), " + ", ".join(str(p) for p in paths))
    return 0


def _write_csv(rows: list[dict], path: Path) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
