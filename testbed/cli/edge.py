"""`multispin edge --profile P --bind tcp://0.0.0.0:PORT`: the edge of a LAN run (devices connect to it)."""

from __future__ import annotations

from testbed.cli.run import add_profile_arguments, add_resume_argument, add_tag_arguments


def register(subparsers) -> None:
    p = subparsers.add_parser("edge", help="run the edge node for a LAN deployment",
                              description="Load the target, bind the edge ROUTER, wait for the profile's devices "
                                          "(multispin device ... on each host), run the rounds, write runs/<stamp>/. "
                                          "With channel.mode real|virtual the channel emulator is started here too "
                                          "and devices connect to endpoints.channel_frontend instead. "
                                          "Endpoints beyond the loopback need `security: {keys: DIR}` "
                                          "(multispin keys generate) or `security: insecure` in the profile.")
    p.add_argument("--profile", default=None, help="profile YAML or name in profiles/ (default: lan)")
    p.add_argument("--bind", default=None, help="edge ROUTER endpoint, e.g. tcp://0.0.0.0:5555 "
                                                 "(default: endpoints.edge_bind of the profile)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--policy", default=None)
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--runs-dir", default="runs")
    add_profile_arguments(p)
    add_tag_arguments(p)
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or Python warnings; log warnings and errors only")
    from testbed.cli.run import add_live_view_argument

    add_live_view_argument(p)
    add_resume_argument(p, "edge")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from testbed.cli import CliError
    from testbed.cli.run import (
        check_exposed,
        device_wait_message,
        execute,
        load,
        print_config,
        resume_target,
        run_meta_from_args,
    )
    from testbed.run.launcher import require_edge_extra
    from testbed.runtime.records import new_run_dir

    if args.resume:
        require_edge_extra()
        profile, run_dir, resume = resume_target(args, profile_given=args.profile is not None)
    else:
        args.profile = args.profile or "lan"
        profile, resume = load(args), None
        if args.print_config:
            return print_config(profile)
    bind = args.bind or profile.endpoints.edge_bind
    if not bind:
        raise CliError("no edge endpoint: pass --bind tcp://0.0.0.0:PORT or set endpoints.edge_bind")
    check_exposed(profile, bind)  # refused before a run directory is made
    if resume is None:
        require_edge_extra()  # before an empty run directory is left behind
        run_dir = new_run_dir(args.runs_dir, f"edge-{profile.policy}")
    print(f"edge at {bind}; " + device_wait_message(profile, bind)
          + (f"; resuming {run_dir} at round {resume.start_round}" if resume else ""), flush=True)
    extra = {"resume": resume} if resume is not None else {"meta": run_meta_from_args(args)}
    return execute(args, profile, run_dir, start_devices=False, bind=bind, **extra)
