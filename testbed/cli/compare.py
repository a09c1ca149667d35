"""`multispin compare [PROFILE] --policies proposed,all-ul,all-dl [--repeats R]`: the same run under several
policies, repeated, with the spread per policy and its plots."""

from __future__ import annotations

import contextlib

from testbed.run.compare import policy_profile, run_name, run_policy, write_comparison


def register(subparsers) -> None:
    from testbed.cli.run import add_profile_arguments, add_tag_arguments

    p = subparsers.add_parser("compare", help="run the live testbed once (or R times) per policy and compare goodput",
                              description="Same prompts, seeds and channel realizations per policy (the channel "
                                          "state is seeded per device and round). Writes one run directory per "
                                          "policy and repeat under runs/<stamp>-compare/, a table of measured and "
                                          "predicted goodput (mean ± std over the repeats) and plots/ with a bar "
                                          "chart. `multispin report` on that directory shows it again.")
    p.add_argument("profile", nargs="?", default=None, help="profile YAML or name in profiles/ (default: emulation)")
    p.add_argument("--policies", default="proposed,all-ul,all-dl",
                   help="comma-separated policies: built-in names, installed plug-ins (multispin plugins) or Python "
                        "paths module:Class")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per policy; repeat r uses seed + r (prompts, sampling and channel draws change), "
                        "the policies of one repeat share it (default 1)")
    p.add_argument("--rounds", type=int, default=None, help="override the profile's rounds")
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None)
    p.add_argument("--seed", type=int, default=None, help="override the profile's seed (of the first repeat)")
    p.add_argument("--runs-dir", default="runs")
    add_profile_arguments(p)
    add_tag_arguments(p)
    p.add_argument("--no-plots", action="store_true", help="skip the per-run and comparison plots")
    p.add_argument("--cold", action="store_true",
                   help="start every process and load the target again for every run (default: warm trials: the "
                        "first run's target, emulator and device processes serve the next runs, each with fresh "
                        "state)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or Python warnings; log warnings and errors only")
    from testbed.cli.run import add_live_view_argument

    add_live_view_argument(p)  # every run of the comparison in turn, in one view
    from testbed.cli.report import add_figure_arguments, with_figures

    add_figure_arguments(p)  # --style, --format of every plot
    p.set_defaults(handler=with_figures(handle), policy=None)


def handle(args) -> int:
    from testbed.cli import CliError
    from testbed.cli.run import live_view_wanted, load, print_config, run_meta_from_args
    from testbed.run.config_override import policy_list
    from testbed.run.launcher import require_edge_extra, resolve_pair
    from testbed.run.warm import WarmPool
    from testbed.runtime.records import new_run_dir

    policies = policy_list(args.policies)
    if args.repeats < 1:
        raise CliError(f"--repeats {args.repeats}: must be >= 1")
    base = load(args, policies)
    if args.print_config:
        return print_config(base)
    require_edge_extra()  # before an empty run directory is left behind
    parent = new_run_dir(args.runs_dir, "compare")
    print(f"compare directory: {parent} ({len(policies)} policies x {args.repeats} repeat(s))")
    pair = resolve_pair(base, progress=not args.quiet)
    infos = []
    # Warm trials (`testbed.run.warm`): the target, the emulator and the device processes of the first run serve
    # the next ones, each with fresh state; --cold starts everything for every run.
    pool = None if args.cold else WarmPool(say=None if not args.quiet else lambda text: None)
    view = None
    if live_view_wanted(args):  # the runs one after another in one view, each under its own title
        from testbed.analysis.live_view import LiveView

        view = LiveView(f"compare {parent.name}", base.rounds)
    try:
        with view if view is not None else contextlib.nullcontext():
            # Repeat-major: the policies of one repeat run back to back, so a slow drift of the host (load,
            # thermal) lands on every policy alike instead of on the last one.
            for r in range(args.repeats):
                for policy in policies:
                    profile = policy_profile(base, policy, r)
                    run_dir = parent / run_name(policy, r, args.repeats)
                    label = f"{policy}" + (f", repeat {r + 1}/{args.repeats} (seed {profile.seed})"
                                           if args.repeats > 1 else "")
                    print(f"== {label}: {run_dir}", flush=True)
                    if view is not None:
                        view.start_run(f"compare {label}", profile.rounds)
                    meta = run_meta_from_args(args, compare={"dir": str(parent), "policy": policy, "repeat": r})
                    infos.append(run_policy(profile, run_dir, pair, progress=not args.quiet and view is None,
                                            plots=not args.no_plots, title=f"{parent.name}/{run_dir.name}", meta=meta,
                                            pool=pool, on_round=view.on_round if view is not None else None))
    finally:
        if pool is not None:
            pool.close()
    _, text, paths = write_comparison(parent, policies, args.repeats, infos, plots=not args.no_plots)
    print(text)
    if paths:
        print("plots: " + ", ".join(str(p) for p in paths))
    print(f"compare directory: {parent} (multispin report {parent})")
    return 0
