"""`multispin edge --profile P --bind tcp://0.0.0.0:PORT`: the edge of a LAN run (devices connect to it)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("edge", help="run the edge node for a LAN deployment",
                              description="Load the target, bind the edge ROUTER, wait for the profile's devices "
                                          "(multispin device ... on each host), run the rounds, write runs/<stamp>/. "
                                          "With channel.mode real|virtual the channel emulator is started here too "
                                          "and devices connect to endpoints.channel_frontend instead.")
    p.add_argument("--profile", default="lan", help="profile YAML or name in profiles/ (default: lan)")
    p.add_argument("--bind", default=None, help="edge ROUTER endpoint, e.g. tcp://0.0.0.0:5555 "
                                                 "(default: endpoints.edge_bind of the profile)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--policy", default=None)
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from pathlib import Path

    from testbed import report
    from testbed.cli import CliError
    from testbed.commands.run import load
    from testbed.launcher import run_live
    from testbed.records import load_run, new_run_dir

    profile = load(args)
    bind = args.bind or profile.endpoints.edge_bind
    if not bind:
        raise CliError("no edge endpoint: pass --bind tcp://0.0.0.0:PORT or set endpoints.edge_bind")
    run_dir = new_run_dir(args.runs_dir, f"edge-{profile.policy}")
    connect = profile.endpoints.channel_frontend if profile.channel.mode != "passthrough" else bind
    print(f"edge at {bind}; devices connect to {connect} (replace 0.0.0.0 by this host's address); "
          f"waiting up to {profile.wait_for_devices_s:.0f} s for {', '.join(profile.device_names())}")
    summary = run_live(profile, run_dir, progress=not args.quiet, start_devices=False, bind=bind)
    print(report.format_summary(summary))
    _, records = load_run(run_dir)
    if records:
        report.write_plots(records, Path(run_dir) / "plots")
    print(f"run directory: {run_dir}")
    return 0
