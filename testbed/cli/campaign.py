"""`multispin campaign [PROFILE] --sweep KEY=V1,V2,... [--sweep ...] --policies a,b,c [--repeats R] [--jobs N]`:
the live testbed once per sweep point (a grid's: every combination) x policy x repeat, a tidy results.csv and
goodput against the swept key; the same command with the same --out resumes it (`testbed.run.campaign`), and
`multispin campaign extend DIR` grows it (`testbed.run.campaign_grow`)."""

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
                    "and resumes an interrupted one. Several --sweep flags make a grid of every combination. "
                    "`multispin campaign extend DIR [--sweep KEY=NEW,...] [--repeats N]` adds values or repeats to "
                    "the campaign in DIR with its stored settings (and resumes what is unfinished); `multispin "
                    "report DIR` reports it from its folder.")
    p.add_argument("profile", nargs="?", default=None,
                   help="profile YAML or name in profiles/ (default: emulation); or `extend`: `multispin campaign "
                        "extend DIR [--sweep KEY=NEW,...] [--repeats N]` grows the finished campaign in DIR")
    p.add_argument("campaign_dir", nargs="?", default=None, metavar="DIR", help="with extend: the campaign folder")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="(required, but for --print-config and extend; repeatable: a grid over several keys) "
                        "KEY=V1,V2,...: devices (the profile's first N devices, copied in turn beyond its list), "
                        "dl_bandwidth (Hz), dl_power (W), ul_bandwidth (Hz), bits_per_prob, max_draft_len, "
                        "vocab_size (the on-air vocabulary), or any dotted profile key (as --set); with extend: "
                        "more values of a key the campaign sweeps")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs at once, each in its own worker process with its own edge, emulator and devices "
                        "(default 1); refused above the host's cores or the memory N runs need")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run each run as a Ray task (its processes on the task's node): on a new local instance "
                        "with --jobs CPUs, or on the cluster at ADDRESS (the campaign folder on a shared file "
                        "system); needs the cluster extra: pip install multispin-testbed[cluster]")
    p.add_argument("--policies", default="proposed,all-ul,all-dl",
                   help="comma-separated policy names: built in, or plug-ins (multispin plugins lists them)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per point and policy (repeat r: seed + r; default 1); with extend: the new total")
    p.add_argument("--rounds", type=int, default=None, help="override the profile's rounds (per run)")
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None)
    p.add_argument("--seed", type=int, default=None, help="override the profile's seed (of the first repeat)")
    p.add_argument("--out", default=None,
                   help="campaign folder (default runs/<stamp>-campaign-<key>); an existing campaign folder with the "
                        "same settings is resumed")
    add_profile_arguments(p)  # --print-config: the campaign's base profile (before the sweep)
    add_tag_arguments(p)
    p.add_argument("--no-plots", action="store_true", help="skip the per-run, per-point and campaign plots")
    p.add_argument("--cold", action="store_true",
                   help="start every process and load the target again for every run (default: warm trials: a "
                        "run's target, emulator and device processes serve the next run of the same device set in "
                        "the same process or worker, each with fresh state)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or Python warnings; log warnings and errors only")
    from testbed.cli.run import add_live_view_argument

    add_live_view_argument(p)  # runs in this process only (not --jobs, --ray)
    from testbed.cli.report import add_figure_arguments, with_figures

    add_figure_arguments(p)  # --style, --format of every plot
    p.set_defaults(handler=with_figures(handle), policy=None, more_runs=[])  # more_runs: `extend --x DIR`


def handle(args) -> int:
    from pathlib import Path

    from testbed.cli import CliError
    from testbed.cli.run import load, print_config, run_meta_from_args
    from testbed.run.campaign import parse_sweeps, plan_campaign
    from testbed.run.config_override import policy_list
    from testbed.runtime.records import new_run_dir

    if args.profile == "extend":
        return extend(args)
    if args.campaign_dir is not None or args.more_runs:
        raise CliError(f"unexpected argument {(args.campaign_dir or args.more_runs[0])!r}: one PROFILE, or "
                       f"`extend DIR`")
    policies = policy_list(args.policies)
    repeats = 1 if args.repeats is None else args.repeats
    if not args.sweep and not args.print_config:
        raise CliError("--sweep KEY=V1,V2,... is required (e.g. --sweep devices=2,4,8)")
    sweep = parse_sweeps(args.sweep) if args.sweep else None
    base = load(args, policies)
    if args.print_config:  # the base every point starts from (after --set and the flags, before the sweep)
        if sweep is not None:
            plan_campaign(Path(args.out or "campaign"), base, sweep, policies, repeats)  # every point checked
        return print_config(base)
    camp = plan_campaign(Path(args.out or "campaign"), base, sweep, policies, repeats)  # every point checked
    out = Path(args.out) if args.out else new_run_dir(
        "runs", "campaign-" + "-".join(s.key.replace(".", "-") for s in sweep.sweeps))
    camp = camp.moved(out)
    camp.meta = run_meta_from_args(args)
    return launch(args, camp, base)


def extend(args) -> int:
    """`campaign extend DIR`: the stored campaign with more values and repeats; what is finished stays."""
    from testbed.cli import CliError
    from testbed.run.campaign import parse_sweeps
    from testbed.run.campaign_grow import extend_campaign
    from testbed.run.live import run_meta

    target = args.campaign_dir or (args.more_runs[0] if args.more_runs else None)
    if target is None:
        raise CliError("extend: name the campaign folder (multispin campaign extend DIR [--sweep KEY=NEW,...] "
                       "[--repeats N])")
    fixed = [f for f, v in (("--set", args.set), ("--rounds", args.rounds), ("--channel", args.channel),
                            ("--seed", args.seed), ("--out", args.out)) if v]
    if fixed or args.tag or args.note:
        raise CliError(f"extend: {', '.join(fixed + (['--tag/--note'] if args.tag or args.note else []))} cannot "
                       f"change a campaign: it keeps the settings it was started with")
    added = parse_sweeps(args.sweep) if args.sweep else None
    camp, what = extend_campaign(target, added, args.repeats, argv=["multispin", *args.argv])
    print(f"campaign {target}: added {what}", flush=True)
    command = run_meta(argv=args.argv)  # this command line; tags, note and overrides stay the campaign's
    camp.meta = {**camp.meta, "argv": command["argv"], "command": command["command"]}
    return launch(args, camp, camp.base)


def launch(args, camp, base) -> int:
    """Run what the campaign lacks (resuming the interrupted), with the bar or quietly."""
    import logging
    import os

    from tqdm.contrib.logging import logging_redirect_tqdm

    from testbed.cli.run import live_view_wanted
    from testbed.run.campaign import open_campaign, run_campaign
    from testbed.run.campaign_jobs import check_jobs, parallel
    from testbed.run.launcher import require_edge_extra, resolve_pair

    require_edge_extra()  # before a folder is made
    if args.ray is None:
        check_jobs(args.jobs, camp.runs)  # before a folder is made (the pair's size is checked below)
    out = camp.out
    done = open_campaign(camp)  # a folder of another campaign is refused here
    n = len(camp.sweep.values)
    print(f"campaign folder: {out} ({n} points x {len(camp.policies)} policies x {camp.repeats} "
          f"repeat(s) = {len(camp.runs)} runs" + (f", {done} complete already" if done else "") + ")", flush=True)
    pair = resolve_pair(base, progress=not args.quiet)
    if args.ray is None and args.jobs > 1:
        check_jobs(args.jobs, camp.runs, pair)
        from testbed.cli import warn
        from testbed.run.campaign_jobs import busy_note

        if busy_note(args.jobs):
            warn("campaign", busy_note(args.jobs))
    if not args.verbose:
        # The campaign's bar is the display: the runs' info lines and the model loader's bars would scroll it
        # away (the devices' and the emulator's logs stay in each run's logs/ folder).
        logging.getLogger().setLevel(logging.WARNING)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when transformers is imported (the first run)
    try:
        with logging_redirect_tqdm():
            warm = not getattr(args, "cold", False)  # `extend` has no --cold: warm
            runner = parallel(args.jobs, args.ray, warm) if args.jobs > 1 or args.ray is not None else None
            if runner is None and live_view_wanted(args):
                _with_live_view(camp, pair, plots=not args.no_plots, warm=warm)
            else:
                run_campaign(camp, pair, plots=not args.no_plots, progress=not args.quiet, runner=runner, warm=warm)
    except KeyboardInterrupt:
        print(f"\ninterrupted; the complete runs are in {out}; continue with `multispin campaign extend {out}`",
              file=sys.stderr)
        raise
    print(f"results: {out / 'results.csv'}; the report: multispin report {out}; per point: multispin report "
          f"{out}/<point>")
    return 0


def _with_live_view(camp, pair: dict, *, plots: bool, warm: bool) -> None:
    """The campaign's runs one after another in one live view (round, devices, measured against predicted),
    each run under its own title; the view replaces the progress bar."""
    from testbed.analysis.live_view import LiveView
    from testbed.run.campaign import run_campaign, trial_label

    view = LiveView("campaign", camp.base.rounds)
    shown: list = [None]

    def on_round(record: dict, run) -> None:
        if shown[0] is not run:
            shown[0] = run
            view.start_run(f"campaign {trial_label(camp, run)}", camp.base.rounds)
        view.update(record)

    with view:
        run_campaign(camp, pair, plots=plots, progress=False, on_round=on_round, warm=warm)
