"""`multispin run [PROFILE]`: a live run (channel emulator, device processes, edge) into runs/<stamp>/.

Exit status: 0 complete (or degraded: complete, some rounds fell back; a warning line says how many); 1 the
run ended incomplete (every device left early; summary.json says why); 2 an error the user can fix (printed,
no traceback); 3 a plug-in (policy, channel source) raised during the run (`on_plugin_error: stop`; the line
names it, the round and the error, logs/plugin_error.log holds the traceback); 130 / 143 interrupted by
Ctrl-C / SIGTERM (the run directory says "interrupted"; `multispin run --resume RUN_DIR` continues it).
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
    add_profile_arguments(p)
    add_tag_arguments(p)
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or Python warnings; log warnings and errors only")
    add_live_view_argument(p)
    add_resume_argument(p, "run")
    p.set_defaults(handler=handle)


def add_live_view_argument(p) -> None:
    import argparse

    p.add_argument("--live-view", action=argparse.BooleanOptionalAction, default=None,
                   help="a live view of the run in the terminal (round, per-device mode, draft length and power, "
                        "measured vs predicted, throughput, request latency percentiles) instead of the progress "
                        "bar (default: on when stdout is a terminal and not --quiet)")


def live_view_wanted(args) -> bool:
    """--live-view / --no-live-view; by default on only at a terminal, never with --quiet."""
    chosen = getattr(args, "live_view", None)
    if chosen is not None:
        return chosen
    return sys.stdout.isatty() and not getattr(args, "quiet", False)


def add_tag_arguments(p) -> None:
    """--tag T (repeatable) and --note TEXT: stored in each new run's meta.json, listed by `multispin runs`,
    columns of the exports."""
    p.add_argument("--tag", action="append", default=[], metavar="T",
                   help="label the run (repeatable); stored in meta.json `tags`, shown by `multispin runs`, a column "
                        "of report --csv/--parquet and of a campaign's results.csv")
    p.add_argument("--note", default=None, metavar="TEXT", help="a free-text note stored in meta.json `note`")


def run_meta_from_args(args, **more) -> dict:
    """The meta.json fields of a new run from this command line (`testbed.run.live.run_meta`)."""
    from testbed.run.live import run_meta

    tags = [t.strip() for t in getattr(args, "tag", None) or [] if t.strip()]
    return run_meta(argv=getattr(args, "argv", None), overrides=[o.flag for o in overrides_from_args(args)],
                    tags=list(dict.fromkeys(tags)), note=getattr(args, "note", None), **more)


def add_resume_argument(p, command: str) -> None:
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue an interrupted run in RUN_DIR with its own profile snapshot, seeds and prompts: "
                        "rounds are numbered on from the last recorded one, records appended, and each device "
                        f"goes on from its prompt plus what it generated (multispin {command} --resume RUN_DIR)")


def overrides_from_args(args) -> list:
    """The command line's overrides in order (`--set` first, then the dedicated flags, which win), each
    remembering its flag: a bad value is reported as that flag's error, not the profile file's."""
    from testbed.run.config_override import Override, parse_set

    out = parse_set(getattr(args, "set", None))
    for key, attr, flag in (("rounds", "rounds", "--rounds"), ("policy", "policy", "--policy"),
                            ("channel.mode", "channel", "--channel"), ("seed", "seed", "--seed")):
        value = getattr(args, attr, None)
        if value is not None:
            out.append(Override(key, value, f"{flag} {value}"))
    return out


def load(args, policies: list[str] | None = None):
    """The profile of a command that takes one (PROFILE, --set, --rounds, ...); errors name the flag, and a
    `--set fixed_length=N` that the policies (default: the profile's) clamp or ignore is warned about."""
    from testbed.cli import warn
    from testbed.run.config_override import fixed_length_notes
    from testbed.run.profile import load_profile

    overrides = overrides_from_args(args)
    profile = load_profile(args.profile, overrides)
    given = [o for o in overrides if o.key == "fixed_length"]
    if given:
        lmax = profile.scenario_obj().max_draft_len
        for msg in fixed_length_notes(profile.fixed_length, policies or [profile.policy], lmax, given[-1].flag):
            warn(args.command, msg)
    return profile


def print_config(profile) -> int:
    """The resolved profile (file, then overrides, then defaults) as YAML on stdout; a mapping (the resolved
    scenario of `plan`) as it is."""
    import yaml

    data = profile if isinstance(profile, dict) else profile.snapshot()
    print(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110), end="")
    return 0


def add_profile_arguments(p, *, print_config: bool = True, set_help: str | None = None) -> None:
    """--set and --print-config, the same in every command that takes a profile."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=set_help or "override any profile field: dotted keys, list entries by index or device "
                                    "name, YAML values, e.g. --set deadline_s=5 --set "
                                    "scenario.devices.dev0.distance_m=50")
    if print_config:
        p.add_argument("--print-config", action="store_true",
                       help="print the resolved profile (after --set and the flags) as YAML and exit")


def resume_target(args, profile_given: bool):
    """(profile, run_dir, resume) for --resume; options that would change the run are refused."""
    from testbed.cli import CliError
    from testbed.run.session import load_resume

    changed = [name for name, given in (("PROFILE", profile_given), ("--set", args.set), ("--rounds", args.rounds),
                                        ("--policy", args.policy), ("--channel", args.channel),
                                        ("--seed", args.seed), ("--tag", getattr(args, "tag", None)),
                                        ("--note", getattr(args, "note", None))) if given]
    if changed:
        raise CliError(f"--resume continues with the run's own profile snapshot; drop {', '.join(changed)}")
    profile, resume = load_resume(args.resume)
    return profile, Path(args.resume), resume


def handle(args) -> int:
    from testbed.run.launcher import require_edge_extra
    from testbed.runtime.records import new_run_dir

    if args.resume:
        require_edge_extra()
        profile, run_dir, resume = resume_target(args, profile_given=args.profile is not None)
        print(f"run directory: {run_dir} (resuming at round {resume.start_round} of {profile.rounds})")
    else:
        profile, resume = load(args), None
        if args.print_config:
            return print_config(profile)
        check_exposed(profile, profile.endpoints.edge_bind)
        require_edge_extra()  # before an empty run directory is left behind
        run_dir = new_run_dir(args.runs_dir, profile.policy)
        print(f"run directory: {run_dir}")
    if not (profile.start_devices and profile.deployment == "emulation"):
        # No device processes are started here: say what the run waits for, and where, before it waits.
        print(device_wait_message(profile, profile.endpoints.edge_bind), flush=True)
    if resume is not None:
        return execute(args, profile, run_dir, resume=resume)
    return execute(args, profile, run_dir, meta=run_meta_from_args(args))


def check_exposed(profile, bind: str | None) -> None:
    """Endpoints beyond the loopback need keys or `security: insecure`: refused before a run directory is
    made (the session checks again before it binds)."""
    from testbed.cli import CliError
    from testbed.runtime.security import SecurityError, require_keys_or_insecure

    if profile.keys_dir or profile.insecure:
        return
    ep = profile.endpoints
    exposed = [e for e in [bind] + ([ep.channel_frontend, ep.channel_control]
                                    if profile.channel.mode != "passthrough" else []) if e]
    try:
        require_keys_or_insecure(exposed, None, False, "edge")
    except SecurityError as exc:
        raise CliError(f"security: {exc}") from None


def device_wait_message(profile, bind: str | None) -> str:
    """What a run without its own device processes waits for: the endpoint the devices connect to, their
    names, the timeout, and for each device the complete command that starts it (`device_commands`)."""
    ep = profile.endpoints
    if profile.channel.mode == "passthrough":
        connect = ep.device_connect or bind
    else:
        connect = ep.device_connect or ep.channel_frontend
    names = profile.device_names()
    if not connect:
        return (f"waiting up to {profile.wait_for_devices_s:g} s for {len(names)} device(s) {', '.join(names)} to "
                "connect to a private ipc:// endpoint of this run")
    dialed = reachable_endpoint(connect)
    where = "" if dialed == connect else f" (from another host: {dialed})"
    files = "the draft ONNX file" + (" and its key folder" if profile.keys_dir else "")
    return (f"waiting up to {profile.wait_for_devices_s:g} s for {len(names)} device(s) {', '.join(names)} to "
            f"connect to {connect}{where}; on each device host ({files} copied to the same path, or the path "
            "changed):\n" + "\n".join("  " + c for c in device_commands(profile, dialed)))


def device_commands(profile, connect: str) -> list[str]:
    """`multispin device ...` for each device of `profile`, complete: its name, the drafter's ONNX file (an
    absolute path on this host), its key folder when the profile has keys, its hardware and link probe."""
    import shlex

    draft = draft_onnx_path(profile)
    out = []
    for name in profile.device_names():
        argv = ["multispin", "device", "--connect", connect, "--name", name, "--draft", draft]
        if profile.keys_dir:
            argv += ["--keys", str(Path(profile.keys_dir).expanduser().resolve() / "clients" / name)]
        if profile.hardware.get(name):
            argv += ["--hardware", str(profile.hardware[name])]
        if profile.link_probe.get(name, "none") != "none":
            argv += ["--link-probe", profile.link_probe[name], "--link-probe-period-s",
                     f"{profile.link_probe_period_s:g}"]
        out.append(shlex.join(argv))
    return out


def draft_onnx_path(profile) -> str:
    """The drafter a device loads: the profile's (`model.draft_onnx`), or where the default pair keeps it (it is
    unpacked or built there when the run starts, before any device can register)."""
    if profile.model.pair == "local":
        return str(Path(profile.model.draft_onnx).expanduser().resolve())
    from model_pairs.model_pair import DEFAULT_CONFIG, PairPaths, pair_dir

    return str(PairPaths.under(pair_dir(DEFAULT_CONFIG)).draft_onnx)


def reachable_endpoint(endpoint: str) -> str:
    """`endpoint` as another host dials it: a wildcard bind (0.0.0.0, *, ::) becomes this host's address."""
    import socket

    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host not in ("0.0.0.0", "*", "[::]", "::"):
        return endpoint
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # a documentation address: picks the outgoing interface, sends nothing
            address = s.getsockname()[0]
    except OSError:  # no route beyond the loopback
        address = "127.0.0.1"
    return f"tcp://{address}:{port}"


def execute(args, profile, run_dir: Path, **run_kw) -> int:
    """`run_live`, then the summary and the plots; how the run ended decides the exit status."""
    from testbed.analysis import report
    from testbed.analysis.runs_index import plot_title
    from testbed.run.live import run_live
    from testbed.runtime.errors import TestbedError
    from testbed.runtime.plugins import PluginFailure
    from testbed.runtime.records import load_run

    try:
        if live_view_wanted(args):  # the view replaces the progress bar
            from testbed.analysis.live_view import LiveView

            with LiveView(f"{profile.name} [{profile.policy}]", profile.rounds) as view:
                summary = run_live(profile, run_dir, progress=False, on_round=view.on_round, **run_kw)
        else:
            summary = run_live(profile, run_dir, progress=not args.quiet, **run_kw)
    except PluginFailure as exc:
        print(f"multispin {args.command}: error: {exc}\nrun directory: {run_dir} (failed; the traceback is in "
              f"{Path(run_dir) / 'logs' / 'plugin_error.log'})", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print(f"\ninterrupted: the rounds so far are in {run_dir}; continue with: "
              f"multispin {args.command} --resume {run_dir}", file=sys.stderr)
        raise
    except TestbedError as exc:  # one line says it all (`multispin run: error: ...`), the run directory in it
        if str(run_dir) in str(exc):
            raise
        raise TestbedError(f"{exc} (run directory: {run_dir}; see summary.json and logs/)") from None
    print(report.format_summary(summary))
    if not getattr(args, "no_plots", False):
        _, records = load_run(run_dir)
        if records:
            paths = report.write_plots(records, Path(run_dir) / "plots", title=plot_title(run_dir))
            print("plots: " + ", ".join(str(p) for p in paths))
    print(f"run directory: {run_dir}")
    if summary.get("status") == "degraded":  # every round ran; some on a fallback (no silent fallback)
        print(f"run degraded: {summary.get('reason')}", file=sys.stderr)
        return 0
    if summary.get("status", "complete") != "complete":
        print(f"run {summary['status']}: {summary.get('reason')}", file=sys.stderr)
        return 1
    return 0
