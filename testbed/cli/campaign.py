"""`multispin campaign [PROFILE] --sweep KEY=V1,V2,... --policies a,b,c [--repeats R]`: the live testbed once
per sweep point x policy x repeat, a tidy results.csv and goodput against the swept key; the same command
with the same --out resumes it (`testbed.run.campaign`)."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    from testbed.cli.run import add_profile_arguments, add_tag_arguments

    p = subparsers.add_parser(
        "campaign", help="run the live testbed per sweep point x policy x repeat; CSV and goodput plot; resumable",
        description="For every value of --sweep, every policy and every repeat: one live run (repeat r uses seed + "
                    "r for every policy and point: the same prompts, sampling and channel draws). Writes a compare "
                    "directory per point, results.csv (one row per run: measured and predicted goodput, energy), "
                    "summary.txt (the policies ordered by measured and by predicted goodput at each point) and "
                    "plots/goodput.png. Started again with the same --out and settings it skips the complete runs "
                    "and resumes an interrupted one.")
    p.add_argument("profile", nargs="?", default=None, help="profile YAML or name in profiles/ (default: emulation)")
    p.add_argument("--sweep", default=None,
                   help="(required, but for --print-config) KEY=V1,V2,...: devices (the profile's first N devices, "
                        "copied in turn beyond its list), "
                        "dl_bandwidth (Hz), dl_power (W), ul_bandwidth (Hz), bits_per_prob, max_draft_len, "
                        "vocab_size (the on-air vocabulary), or any dotted profile key (as --set)")
    p.add_argument("--policies", default="proposed,all-ul,all-dl",
                   help="comma-separated policy names: built in, or plug-ins (multispin plugins lists them)")
    p.add_argument("--repeats", type=int, default=1, help="runs per point and policy (repeat r: seed + r; default 1)")
    p.add_argument("--rounds", type=int, default=None, help="override the profile's rounds (per run)")
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None)
    p.add_argument("--seed", type=int, default=None, help="override the profile's seed (of the first repeat)")
    p.add_argument("--out", default=None,
                   help="campaign folder (default runs/<stamp>-campaign-<key>); an existing campaign folder with the "
                        "same settings is resumed")
    add_profile_arguments(p)  # --print-config: the campaign's base profile (before the sweep)
    add_tag_arguments(p)
    p.add_argument("--no-plots", action="store_true", help="skip the per-run, per-point and campaign plots")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or Python warnings; log warnings and errors only")
    from testbed.cli.report import add_figure_arguments, with_figures

    add_figure_arguments(p)  # --style, --format of every plot
    p.set_defaults(handler=with_figures(handle), policy=None)


def handle(args) -> int:
    import logging
    import os
    from pathlib import Path

    from tqdm.contrib.logging import logging_redirect_tqdm

    from testbed.cli import CliError
    from testbed.cli.run import load, print_config, run_meta_from_args
    from testbed.run.campaign import open_campaign, parse_sweep, plan_campaign, run_campaign
    from testbed.run.config_override import policy_list
    from testbed.run.launcher import require_edge_extra, resolve_pair
    from testbed.runtime.records import new_run_dir

    policies = policy_list(args.policies)
    if args.sweep is None and not args.print_config:
        raise CliError("--sweep KEY=V1,V2,... is required (e.g. --sweep devices=2,4,8)")
    sweep = parse_sweep(args.sweep) if args.sweep is not None else None
    base = load(args, policies)
    if args.print_config:  # the base every point starts from (after --set and the flags, before the sweep)
        if sweep is not None:
            plan_campaign(Path(args.out or "campaign"), base, sweep, policies, args.repeats)  # every point checked
        return print_config(base)
    camp = plan_campaign(Path(args.out or "campaign"), base, sweep, policies, args.repeats)  # every point checked
    require_edge_extra()  # before a folder is made
    out = Path(args.out) if args.out else new_run_dir("runs", f"campaign-{sweep.key.replace('.', '-')}")
    camp = camp.moved(out)
    camp.meta = run_meta_from_args(args)
    done = open_campaign(camp)  # a folder of another campaign is refused here
    print(f"campaign folder: {out} ({len(sweep.values)} points x {len(policies)} policies x {args.repeats} "
          f"repeat(s) = {len(camp.runs)} runs" + (f", {done} complete already" if done else "") + ")", flush=True)
    pair = resolve_pair(base, progress=not args.quiet)
    if not args.verbose:
        # The campaign's bar is the display: the runs' info lines and the model loader's bars would scroll it
        # away (the devices' and the emulator's logs stay in each run's logs/ folder).
        logging.getLogger().setLevel(logging.WARNING)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when transformers is imported (the first run)
    try:
        with logging_redirect_tqdm():
            run_campaign(camp, pair, plots=not args.no_plots, progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"\ninterrupted; the complete runs are in {out}; continue with the same command and --out {out}",
              file=sys.stderr)
        raise
    print(f"results: {out / 'results.csv'}; per point: multispin report {out}/<point>")
    return 0
