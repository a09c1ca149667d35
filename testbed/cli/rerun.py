"""`multispin rerun RUN_DIR`: the same run again into a new run directory: the resolved profile of RUN_DIR
(meta.json `profile`: its seed, policy, prompts, channel and every other setting), its overrides and tags on
record, and `rerun_of` naming RUN_DIR. At temperature 0 (`sampling.temperature: 0`) the tokens are the same."""

from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    from testbed.cli.run import add_tag_arguments

    p = subparsers.add_parser("rerun", help="run a past run again (its resolved profile and seed) into a new directory",
                              description="Load RUN_DIR's resolved profile (meta.json `profile`, also profile.yaml) "
                                          "and run it again as `multispin run` does, into a new run directory "
                                          "under --runs-dir; its meta.json says `rerun_of: RUN_DIR` and keeps "
                                          "RUN_DIR's overrides and tags (--tag adds more, --note replaces the note). "
                                          "Same seed, policy and prompts: at temperature 0 the same tokens.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by run, edge, compare or campaign")
    p.add_argument("--runs-dir", default="runs", help="parent of the new run directory (default: runs)")
    add_tag_arguments(p)
    p.add_argument("--print-config", action="store_true", help="print the profile it would run as YAML and exit")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or Python warnings; log warnings and errors only")
    from testbed.cli.run import add_live_view_argument

    add_live_view_argument(p)
    p.set_defaults(handler=handle)


def load_rerun(run_dir: str | Path):
    """(profile, meta) of a past run; a CliError says why it cannot be run again."""
    from testbed.cli import CliError
    from testbed.run.profile import ProfileError, load_profile
    from testbed.runtime.records import read_meta

    run_dir = Path(run_dir)
    what = f"rerun {run_dir}"
    meta = read_meta(run_dir, what)
    if not isinstance(meta.get("profile"), dict):
        raise CliError(f"{what}: meta.json holds no profile snapshot") from None
    try:
        profile = load_profile(meta["profile"])
    except ProfileError as exc:
        raise CliError(f"{what}: its profile no longer loads: {exc}") from None
    return profile, meta


def handle(args) -> int:
    from testbed.cli.run import check_exposed, device_wait_message, execute, print_config
    from testbed.run.launcher import require_edge_extra
    from testbed.run.live import run_meta
    from testbed.runtime.records import new_run_dir

    profile, old = load_rerun(args.run_dir)
    if args.print_config:
        return print_config(profile)
    check_exposed(profile, profile.endpoints.edge_bind)
    require_edge_extra()  # before an empty run directory is left behind
    run_dir = new_run_dir(args.runs_dir, profile.policy)
    tags = list(dict.fromkeys([*(old.get("tags") or []), *(t.strip() for t in args.tag if t.strip())]))
    meta = run_meta(argv=args.argv, overrides=old.get("overrides") or [], tags=tags,
                    note=args.note if args.note is not None else old.get("note"),
                    rerun_of=str(Path(args.run_dir).resolve()),
                    **{k: old[k] for k in ("sweep", "compare", "campaign") if k in old})
    print(f"run directory: {run_dir} (rerun of {args.run_dir}: seed {profile.seed}, policy {profile.policy})")
    if not (profile.start_devices and profile.deployment == "emulation"):
        print(device_wait_message(profile, profile.endpoints.edge_bind), flush=True)
    return execute(args, profile, run_dir, meta=meta)
