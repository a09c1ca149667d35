"""`multispin simulate [PROFILE] --sweep KEY=V1,V2,... --out DIR`: the offline simulator."""

from __future__ import annotations

from pathlib import Path

from testbed import PROFILES_DIR

DEFAULT_PROFILE = PROFILES_DIR / "scenarios" / "default.yaml"
# What a simulation writes into --out: with --force exactly these are replaced, so that no plot of an
# earlier sweep (e.g. monte_carlo.png of a sweep with --monte-carlo) stays beside the new results.
OUTPUTS = ("results.csv", "goodput.png", "ul_devices.png", "monte_carlo.png", "meta.json")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="sweep a parameter over random drops and policies (analytic, optional Monte Carlo)",
        description="Offline simulator: for each sweep value and each seeded drop, plan every policy and "
                    "record the predicted goodput; writes results.csv, PNG plots and meta.json to --out.")
    p.add_argument("profile", nargs="?", default=None,
                   help="scenario with a `drop:` section, as a YAML path or a name in profiles/ (default "
                        "profiles/scenarios/default.yaml); a run profile's scenario: section is used")
    p.add_argument("--sweep", required=True,
                   help="KEY=V1,V2,... with KEY one of devices, dl_bandwidth (Hz), dl_power (W), ul_bandwidth "
                        "(Hz), bits_per_prob, acceptance, vocab_size, max_draft_len")
    p.add_argument("--drops", type=int, default=5, help="random drops per sweep point (default 5)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies (default: all but exhaustive)")
    p.add_argument("--fixed-length", type=int, default=None,
                   help="draft length of the fixed-length policy (default 4; clamped to max_draft_len)")
    p.add_argument("--monte-carlo", action="store_true", help="add a token-level simulation per plan")
    p.add_argument("--rounds", type=int, default=200, help="Monte Carlo rounds per plan (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (results.csv, *.png, meta.json)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out, replacing an earlier simulation's files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def check_out(out: Path, force: bool) -> None:
    """Refuse a non-empty output folder unless --force; with it, remove the files a simulation writes."""
    from testbed.cli import CliError

    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not force:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise CliError(f"--out {out}: not empty ({shown}); choose another folder, or --force to replace "
                       f"an earlier simulation's files there")
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from testbed.cli import CliError, warn
    from testbed.config_override import fixed_length_notes, policy_list
    from testbed.core.optimizer import OptimizerError
    from testbed.core.scenario import ScenarioError
    from testbed.core.simulate import DEFAULT_POLICIES, SimulationError, parse_sweep, run_sweep, summary_table
    from testbed.profile import load_plan_scenario
    from testbed.sim_plots import plot_sweep

    for flag, value in (("--rounds", args.rounds), ("--drops", args.drops)):
        if value < 1:
            raise CliError(f"{flag} {value}: must be >= 1")
    if args.fixed_length is not None and args.fixed_length < 1:
        raise CliError(f"--fixed-length {args.fixed_length}: must be >= 1")
    policies = policy_list(args.policies) if args.policies else list(DEFAULT_POLICIES)
    out = Path(args.out)
    try:
        base, note = load_plan_scenario(args.profile, DEFAULT_PROFILE)
        key, values = parse_sweep(args.sweep)
    except (ScenarioError, SimulationError) as exc:
        raise CliError(str(exc)) from None
    if note:
        print(note, file=sys.stderr)
    lmax = min(values) if key == "max_draft_len" else base.max_draft_len
    for msg in fixed_length_notes(args.fixed_length, policies, int(lmax)):
        warn("simulate", msg)
    check_out(out, args.force)  # after the arguments are known good: a typo costs no folder
    try:
        total = len(values) * args.drops * len(policies)
        with tqdm(total=total, desc=f"simulate {key}", unit="plan", disable=args.no_progress) as bar:
            rows = run_sweep(base, key, values, drops=args.drops, policies=policies, seed=args.seed,
                             monte_carlo_rounds=args.rounds if args.monte_carlo else 0,
                             fixed_length=args.fixed_length or 4, progress=bar.update)
    except (ScenarioError, SimulationError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    _write_csv(rows, out / "results.csv")
    paths = plot_sweep(rows, out)
    _write_meta(out / "meta.json", args, base, key, values, policies, len(rows))
    print(summary_table(rows))
    print(f"wrote {out / 'results.csv'} ({len(rows)} rows), " + ", ".join(str(p) for p in paths)
          + f", {out / 'meta.json'}")
    return 0


def _write_meta(path: Path, args, base, key: str, values: list, policies: list[str], rows: int) -> None:
    """What reproduces the results: the command line, seed, sweep, the scenario as planned, and the code
    (git revision when run from a checkout, the package version always) and when."""
    import json
    import sys
    from datetime import datetime, timezone

    from testbed import __version__
    from testbed.records import git_revision, package_versions

    meta = {"created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "argv": sys.argv,
            "command": "simulate", "version": __version__, "git_revision": git_revision(),
            "packages": package_versions(), "profile": str(args.profile or DEFAULT_PROFILE), "seed": args.seed,
            "sweep": {"key": key, "values": values}, "drops": args.drops, "policies": policies,
            "fixed_length": args.fixed_length or 4,
            "monte_carlo_rounds": args.rounds if args.monte_carlo else 0, "rows": rows,
            "scenario": base.model_dump(mode="json")}
    path.write_text(json.dumps(meta, indent=2) + "\n")


def _write_csv(rows: list[dict], path: Path) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


def plan_inputs(args, command: str = "plan") -> tuple:
    """(scenario, fixed length) for `multispin plan`: the policy checked (with a did-you-mean), the
    scenario resolved like every profile (a name in profiles/, a path; a run profile's scenario: section),
    and a warning when --fixed-length is clamped or ignored."""
    import sys

    from testbed.cli import CliError, warn
    from testbed.config_override import fixed_length_notes, policy_list
    from testbed.profile import load_plan_scenario

    policy_list(args.policy, "--policy")
    if args.fixed_length is not None and args.fixed_length < 1:
        raise CliError(f"--fixed-length {args.fixed_length}: must be >= 1")
    sc, note = load_plan_scenario(args.scenario)
    if note:
        print(note, file=sys.stderr)
    for msg in fixed_length_notes(args.fixed_length, [args.policy], sc.max_draft_len):
        warn(command, msg)
    return sc, args.fixed_length or 4
