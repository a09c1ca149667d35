"""`multispin run [PROFILE]`: a live run (channel emulator, device processes, edge) into runs/<stamp>/.

Exit status: 0 complete; 1 the run ended incomplete (every device left early; summary.json says why);
2 an error the user can fix (printed, no traceback); 130 / 143 interrupted by Ctrl-C / SIGTERM (the run
directory says "interrupted"; `multispin run --resume RUN_DIR` continues it).
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the live testbed (default: profiles/emulation.yaml)",
                              description="Start the channel emulator, one device process per device and the edge; "
                                          "run the rounds; write runs/<stamp>/ (records, outputs, summary, plots).")
    p.add_argument("profile", nargs="?", default=None, help="profile YAML or name in profiles/ (default: emulation)")
    p.add_argument("--rounds", type=int, default=None, help="override the profile's rounds")
    p.add_argument("--policy", default=None, help="override the profile's policy")
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None,
                   help="override the channel emulator mode")
    p.add_argument("--seed", type=int, default=None, help="override the profile's seed")
    p.add_argument("--runs-dir", default="runs", help="parent of the run directory (default: runs)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any profile field (dotted keys, YAML values), e.g. --set deadline_s=5")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_resume_argument(p, "run")
    p.set_defaults(handler=handle)


def add_resume_argument(p, command: str) -> None:
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue an interrupted run in RUN_DIR with its own profile snapshot, seeds and prompts: "
                        "rounds are numbered on from the last recorded one, records appended, and each device "
                        f"goes on from its prompt plus what it generated (multispin {command} --resume RUN_DIR)")


def overrides_from_args(args) -> dict:
    import yaml

    from testbed.cli import CliError

    out = {}
    for item in getattr(args, "set", []) or []:
        if "=" not in item:
            raise CliError(f"--set {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    for key, attr in (("rounds", "rounds"), ("policy", "policy"), ("channel.mode", "channel"), ("seed", "seed")):
        value = getattr(args, attr, None)
        if value is not None:
            out[key] = value
    return out


def load(args):
    from testbed.cli import CliError
    from testbed.profile import ProfileError, load_profile

    try:
        return load_profile(args.profile, overrides_from_args(args))
    except ProfileError as exc:
        raise CliError(str(exc)) from None


def resume_target(args, profile_given: bool):
    """(profile, run_dir, resume) for --resume; options that would change the run are refused."""
    from testbed.cli import CliError
    from testbed.session import load_resume

    changed = [name for name, given in (("PROFILE", profile_given), ("--set", args.set), ("--rounds", args.rounds),
                                        ("--policy", args.policy), ("--channel", args.channel),
                                        ("--seed", args.seed)) if given]
    if changed:
        raise CliError(f"--resume continues with the run's own profile snapshot; drop {', '.join(changed)}")
    profile, resume = load_resume(args.resume)
    return profile, Path(args.resume), resume


def handle(args) -> int:
    from testbed.launcher import require_edge_extra
    from testbed.records import new_run_dir

    if args.resume:
        require_edge_extra()
        profile, run_dir, resume = resume_target(args, profile_given=args.profile is not None)
        print(f"run directory: {run_dir} (resuming at round {resume.start_round} of {profile.rounds})")
    else:
        profile, resume = load(args), None
        require_edge_extra()  # before an empty run directory is left behind
        run_dir = new_run_dir(args.runs_dir, profile.policy)
        print(f"run directory: {run_dir}")
    return execute(args, profile, run_dir, resume=resume)


def execute(args, profile, run_dir: Path, **run_kw) -> int:
    """`run_live`, then the summary and the plots; how the run ended decides the exit status."""
    from testbed import report
    from testbed.errors import TestbedError
    from testbed.launcher import run_live
    from testbed.records import load_run

    try:
        summary = run_live(profile, run_dir, progress=not args.quiet, **run_kw)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the rounds so far are in {run_dir}; continue with: "
              f"multispin {args.command} --resume {run_dir}", file=sys.stderr)
        raise
    except TestbedError:
        print(f"run directory: {run_dir} (failed; see summary.json and logs/)", file=sys.stderr)
        raise
    print(report.format_summary(summary))
    if not getattr(args, "no_plots", False):
        _, records = load_run(run_dir)
        if records:
            paths = report.write_plots(records, Path(run_dir) / "plots")
            print("plots: " + ", ".join(str(p) for p in paths))
    print(f"run directory: {run_dir}")
    if summary.get("status", "complete") != "complete":
        print(f"run {summary['status']}: {summary.get('reason')}", file=sys.stderr)
        return 1
    return 0
