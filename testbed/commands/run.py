"""`multispin run [PROFILE]`: a live run (channel emulator, device processes, edge) into runs/<stamp>/."""

from __future__ import annotations

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
    p.set_defaults(handler=handle)


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


def handle(args) -> int:
    from testbed import report
    from testbed.launcher import run_live
    from testbed.records import load_run, new_run_dir

    profile = load(args)
    run_dir = new_run_dir(args.runs_dir, profile.policy)
    print(f"run directory: {run_dir}")
    summary = run_live(profile, run_dir, progress=not args.quiet)
    print(report.format_summary(summary))
    if not args.no_plots:
        _, records = load_run(run_dir)
        if records:
            paths = report.write_plots(records, Path(run_dir) / "plots")
            print("plots: " + ", ".join(str(p) for p in paths))
    print(f"run directory: {run_dir}")
    return 0
