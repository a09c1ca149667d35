"""`multispin simulate [PROFILE] --sweep KEY=V1,V2,... --out DIR`: the offline simulator.

The sweep's tasks (one per point x drop, `testbed.core.simulate.run_task`) run here one after another
(`--jobs 1`), in a pool of processes (`--jobs N`), or as Ray tasks (`--ray [ADDRESS]`). A task's rows depend
only on its point, drop and seed, and the rows are written in the serial order, so the CSV is the same
byte for byte whichever way it ran.
"""

from __future__ import annotations

import os
from pathlib import Path

from testbed import PROFILES_DIR
from testbed.runtime.heap import keep_freed_memory
from testbed.runtime.ray_instance import import_ray, ray_instance

DEFAULT_PROFILE = PROFILES_DIR / "scenarios" / "default.yaml"
# What a simulation writes into --out: with --force exactly these are replaced, so that no plot of an
# earlier sweep (e.g. monte_carlo.png of a sweep with --monte-carlo) stays beside the new results.
OUTPUTS = ("results.csv", *(f"{fig}.{ext}" for fig in ("goodput", "ul_devices", "monte_carlo", "goodput_ul_share")
                            for ext in ("png", "pdf", "svg", "caption.txt")), "meta.json")


# Keys of a run profile that a campaign can sweep and the analytic model has no field for.
_RUN_ONLY = {"on_air_vocab_size": "the live vocabulary on the air; here sweep vocab_size (the scenario's V)"}


def parse_sweep(text: str) -> tuple[str, list]:
    """'KEY=V1,V2,...' -> (key, values), with clear errors (`SimulationError`). The strings of a campaign's
    --sweep work here too (`testbed.run.campaign.parse_sweep`): the same keys (devices, the simulator's keys,
    a scenario field with or without ``scenario.``), each value read as YAML (1e6 a number, fdma_shared a name)."""
    import yaml

    from testbed.core.scenario import Scenario
    from testbed.core.simulate import SWEEP_KEYS, SimulationError, sweep_key, sweep_values
    from testbed.run.config_override import split_key_value, split_values
    from testbed.run.profile import Profile

    given, rest = split_key_value(text, "--sweep", f"KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}",
                                  SimulationError)
    head = given.split(".")[0]
    scenario_keys = ("scenario", *Scenario.model_fields, *SWEEP_KEYS)
    if head in _RUN_ONLY or head in Profile.model_fields and head not in scenario_keys:
        why = _RUN_ONLY.get(head, "simulate plans a scenario: sweep its keys (scenario.*) or the simulator's")
        raise SimulationError(f"--sweep {text}: {given!r} is a run profile's key ({why})")
    key = sweep_key(given)
    items = []
    for item in split_values(rest):
        try:
            value = yaml.safe_load(item)
        except yaml.YAMLError:
            raise SimulationError(f"--sweep {text}: value {item!r} is not valid YAML") from None
        items.append(value if isinstance(value, (int, float)) and not isinstance(value, bool) else item)
    if not items:
        raise SimulationError(f"--sweep {text!r}: no values given")
    values = sweep_values(key, items)
    if len({repr(v) for v in values}) != len(values):
        raise SimulationError(f"--sweep {text}: a value is listed twice")
    return key, values


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
                        "(Hz per device), uplink_total_bandwidth_hz (Hz, a shared uplink's band), ul_access "
                        "(dedicated,fdma_shared), bits_per_prob, acceptance, vocab_size, max_draft_len, or any "
                        "scenario field (ul_min_share, drop.max_power_w; a campaign's scenario.KEY too); values "
                        "read as YAML, as `campaign --sweep` reads them")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a field of the scenario before the sweep (repeatable), as `plan --set`: a "
                        "scenario file's keys (--set ul_access=fdma_shared, a leading scenario. is dropped), a "
                        "run profile's or its scenario's")
    p.add_argument("--drops", type=int, default=5, help="random drops per sweep point (default 5)")
    p.add_argument("--policies", default=None,
                   help="comma-separated policies (default: all but exhaustive)")
    p.add_argument("--fixed-length", type=int, default=None,
                   help="draft length of the fixed-length policy (default 4; clamped to max_draft_len)")
    p.add_argument("--monte-carlo", action="store_true", help="add a token-level simulation per plan")
    p.add_argument("--rounds", type=int, default=200, help="Monte Carlo rounds per plan (default 200)")
    p.add_argument("--channel", action="store_true",
                   help="with --monte-carlo and a run profile with channel.state (a plug-in source too): every "
                        "Monte Carlo round takes its gains from that channel source and is planned anew by each "
                        "policy (the previous round as its context); the channel is seeded with --seed + drop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (results.csv, *.png, meta.json)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out, replacing an earlier simulation's files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"worker processes, one task (point x drop) at a time each; 1 runs in this process "
                        f"(default: the number of cores, here {default_jobs()}); with --ray and no address, "
                        f"the CPUs of the local Ray instance")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the tasks on Ray: on a new local instance, or on the cluster at ADDRESS (e.g. "
                        "auto, ray://HEAD:10001; its nodes need this package installed); needs the cluster "
                        "extra: pip install multispin-testbed[cluster]")
    from testbed.cli.report import add_figure_arguments, with_figures

    add_figure_arguments(p)  # --style, --format of every plot
    p.set_defaults(handler=with_figures(run))


_TASK = None  # in a pool worker: the sweep's task function, set by _init_worker


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _init_worker(task) -> None:
    """A pool worker keeps the sweep's task function (the base scenario in it) once, not per task, and
    leaves Ctrl-C to the parent, which cancels the rest of the sweep."""
    import signal

    global _TASK
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()  # as the parent: a spawned process starts with glibc's defaults
    _TASK = task


def _run_indexed(index: int, t: tuple) -> tuple[int, list]:
    return index, _TASK(*t)


def process_map(jobs: int, bar):
    """A `map_tasks` for `run_sweep` on `jobs` fresh (spawned) processes; the bar advances by a task's rows
    (plans) as each finishes, and the results come back in the order of the tasks."""
    def map_tasks(task, tasks: list) -> list:
        import multiprocessing
        import pickle
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool

        from testbed.cli import CliError

        try:  # a lambda or a closure in the task (a policy, a channel) cannot travel to another process
            pickle.dumps(task)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise CliError(f"--jobs {jobs}: the sweep cannot be sent to worker processes ({exc}); "
                           f"--jobs 1 runs it in this process") from None
        results: list = [None] * len(tasks)
        # spawn, not fork: a fork of this process would copy its threads' state (tqdm's monitor, BLAS).
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_init_worker, initargs=(task,)) as pool:
            futures = [pool.submit(_run_indexed, i, t) for i, t in enumerate(tasks)]
            try:
                for fut in as_completed(futures):
                    i, rows = fut.result()
                    results[i] = rows
                    bar.update(len(rows))
            except BrokenProcessPool:
                raise CliError(f"--jobs {jobs}: a worker process failed (its error is above); --jobs 1 runs "
                               f"the sweep in this process") from None
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # the running tasks finish, none starts
                raise
        return results
    return map_tasks


def _apply(task, t: tuple) -> list:
    """One Ray task: the rows of one point x drop."""
    keep_freed_memory()  # once per Ray worker process (idempotent)
    return task(*t)


def ray_map(address: str, jobs: int, bar):
    """A `map_tasks` for `run_sweep` on Ray: one Ray task per point x drop, on a new local instance with
    `jobs` CPUs (address "") or on the cluster at `address`. An instance started here is shut down here."""
    def map_tasks(task, tasks: list) -> list:
        from testbed.cli import CliError

        with ray_instance(address, jobs, CliError) as ray:
            return _ray_results(ray, task, tasks, bar)
    return map_tasks


def _ray_results(ray, task, tasks: list, bar) -> list:
    pending: list = []
    try:
        remote = ray.remote(_apply)
        task_ref = ray.put(task)  # the base scenario travels once
        refs = [remote.remote(task_ref, t) for t in tasks]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list = [None] * len(tasks)
        pending = refs
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref, rows in zip(ready, ray.get(ready)):
                results[index[ref]] = rows
                bar.update(len(rows))
        return results
    except ray.exceptions.RayTaskError as exc:
        # The task's own error (a bad sweep point, an infeasible plan) as if it had run here.
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ValueError):
            raise cause from None
        raise
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise


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

    from testbed.analysis.sim_plots import plot_sweep
    from testbed.cli import CliError, warn
    from testbed.core import payload
    from testbed.core.optimizer import OptimizerError
    from testbed.core.scenario import ScenarioError
    from testbed.core.simulate import (
        DEFAULT_POLICIES,
        SimulationError,
        point_scenario,
        run_sweep,
        summary_table,
    )
    from testbed.run.config_override import OverrideError, fixed_length_notes, parse_set, policy_list
    from testbed.run.profile import ProfileError, resolve_plan_source

    keep_freed_memory()  # the serial sweep plans here (`testbed.runtime.heap`); workers call it themselves
    for flag, value in (("--rounds", args.rounds), ("--drops", args.drops)):
        if value < 1:
            raise CliError(f"{flag} {value}: must be >= 1")
    if args.fixed_length is not None and args.fixed_length < 1:
        raise CliError(f"--fixed-length {args.fixed_length}: must be >= 1")
    if args.jobs is not None and args.jobs < 1:
        raise CliError(f"--jobs {args.jobs}: must be >= 1")
    if args.ray is not None:
        import_ray(CliError)
        if args.ray and args.jobs is not None:
            warn("simulate", f"--jobs {args.jobs} is ignored with --ray {args.ray}: the cluster's CPUs decide")
    jobs = args.jobs or default_jobs()
    policies = policy_list(args.policies) if args.policies else list(DEFAULT_POLICIES)
    out = Path(args.out)
    try:
        src = resolve_plan_source(args.profile, parse_set(args.set), DEFAULT_PROFILE)
        base, note = src.scenario, src.note
        base, args.compute_scale = profile_scaled(src.profile, base)
        key, values = parse_sweep(args.sweep)
        for value in values:  # a bad point fails here, before --out is touched or a worker started
            point_scenario(base, key, value, 0, args.seed)
    except (ScenarioError, SimulationError, ProfileError, OverrideError) as exc:
        raise CliError(str(exc)) from None
    if note:
        print(note, file=sys.stderr)
    if payload.unmodelled_note(base):
        warn("simulate", payload.unmodelled_note(base))
    channel = channel_gains(args) if args.channel else None
    lmax = min(values) if key == "max_draft_len" else base.max_draft_len
    for msg in fixed_length_notes(args.fixed_length, policies, int(lmax)):
        warn("simulate", msg)
    check_out(out, args.force)  # after the arguments are known good: a typo costs no folder
    try:
        total = len(values) * args.drops * len(policies)
        with tqdm(total=total, desc=f"simulate {key}", unit="plan", disable=args.no_progress) as bar:
            if args.ray is not None:
                map_tasks = ray_map(args.ray, jobs, bar)
            elif jobs > 1 and len(values) * args.drops > 1:
                map_tasks = process_map(jobs, bar)
            else:
                map_tasks = None  # here, plan by plan
            rows = run_sweep(base, key, values, drops=args.drops, policies=plugged(policies), seed=args.seed,
                             monte_carlo_rounds=args.rounds if args.monte_carlo else 0,
                             fixed_length=args.fixed_length or 4, progress=bar.update, map_tasks=map_tasks,
                             channel=channel)
    except (ScenarioError, SimulationError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    _write_csv(rows, out / "results.csv")
    paths = plot_sweep(rows, out)
    _write_meta(out / "meta.json", args, base, key, values, policies, len(rows), jobs)
    print(summary_table(rows))
    print(f"wrote {out / 'results.csv'} ({len(rows)} rows), " + ", ".join(str(p) for p in paths)
          + f", {out / 'meta.json'}")
    return 0


def profile_scaled(profile, base) -> tuple:
    """(scenario, scales): a run profile's devices with their prior drafting time x their hardware profile's
    `compute_scale`, as `multispin plan` and a live run start from (`testbed.run.planning.scaled_scenario`);
    a scenario file, or devices drawn per drop, as they are. scales: device -> factor, those != 1 only."""
    from testbed.cli import CliError
    from testbed.run.planning import hardware_scales, scaled_scenario

    if profile is None:
        return base, {}
    try:
        scales = hardware_scales(profile, [d.name for d in base.devices])
    except ValueError as exc:
        raise CliError(f"hardware: {exc}") from None
    return scaled_scenario(base, scales), {n: x for n, x in scales.items() if x != 1.0}


def channel_gains(args):
    """`--channel`: the run profile's channel.state as a `ChannelGains` (checked now: the source loads and
    builds for the profile's devices)."""
    from testbed.cli import CliError
    from testbed.run.profile import ProfileError, find_profile, load_profile
    from testbed.runtime.plugins import ChannelGains, channel_state_from_config

    if not args.monte_carlo:
        raise CliError("--channel needs --monte-carlo: the channel drives the Monte Carlo rounds")
    path = find_profile(args.profile, DEFAULT_PROFILE)
    try:
        state = load_profile(path).channel.state
    except ProfileError as exc:
        raise CliError(f"--channel needs a run profile with channel.state: {exc}") from None
    if state is None:
        raise CliError(f"--channel: {path} has no channel.state")
    try:
        channel_state_from_config({**state, "seed": state.get("seed", args.seed)},
                                  list(load_profile(path).scenario["devices"]))
    except ValueError as exc:
        raise CliError(f"{path}: channel.state: {exc}") from None
    args.channel_state = state
    return ChannelGains(dict(state), args.seed)


def plugged(policies: list[str]) -> list:
    """The policies for `run_sweep`: built-in names as they are, a plug-in as its loaded object (labelled by
    the name given; it travels to the workers by its module:Class)."""
    from testbed.core.optimizer import POLICIES
    from testbed.runtime.plugins import load_policy

    return [p if p in POLICIES else load_policy(p) for p in policies]


def _write_meta(path: Path, args, base, key: str, values: list, policies: list[str], rows: int,
                jobs: int) -> None:
    """What reproduces the results: the command line, seed, sweep, the scenario as planned, and the code
    (git revision when run from a checkout, the package version always) and when."""
    import sys
    from datetime import datetime, timezone

    from testbed import __version__
    from testbed.runtime.records import git_revision, json_text, package_versions

    meta = {"created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "argv": sys.argv,
            "command": "simulate", "version": __version__, "git_revision": git_revision(),
            "packages": package_versions(), "profile": str(args.profile or DEFAULT_PROFILE), "seed": args.seed,
            "sweep": {"key": key, "values": values, "given": args.sweep}, "set": list(args.set or []),
            "drops": args.drops, "policies": policies,
            "fixed_length": args.fixed_length or 4,
            "monte_carlo_rounds": args.rounds if args.monte_carlo else 0, "rows": rows,
            "channel": (getattr(args, "channel_state", None) if args.channel else None),
            "compute_scale": getattr(args, "compute_scale", {}),  # a run profile's hardware, in `scenario`
            # how it ran (the results do not depend on it)
            "execution": ({"ray": args.ray or "local", **({} if args.ray else {"num_cpus": jobs})}
                          if args.ray is not None else {"jobs": jobs}),
            "scenario": base.model_dump(mode="json")}
    path.write_text(json_text(meta, indent=2) + "\n")


def _write_csv(rows: list[dict], path: Path) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


def plan_inputs(args, command: str = "plan") -> tuple:
    """(scenario, fixed length, resolved config) for `multispin plan`: the policy checked (with a
    did-you-mean), the scenario resolved like every profile (a name in profiles/, a path; a run profile's
    scenario: section) with the `--set` overrides, and a warning when --fixed-length is clamped or ignored."""
    import sys

    from testbed.cli import CliError, warn
    from testbed.run.config_override import fixed_length_notes, parse_set, policy_list
    from testbed.run.profile import resolve_plan_source

    policy_list(args.policy, "--policy")
    if args.fixed_length is not None and args.fixed_length < 1:
        raise CliError(f"--fixed-length {args.fixed_length}: must be >= 1")
    overrides = parse_set(getattr(args, "set", None))
    src = resolve_plan_source(args.scenario, overrides)
    sc = src.scenario
    if src.note:
        print(src.note, file=sys.stderr)
    # The draft length: --fixed-length, else a run profile's fixed_length (--set fixed_length=N), else 4.
    fixed_length, given = args.fixed_length, None
    set_fl = [o for o in overrides if o.key == "fixed_length"]
    if fixed_length is None and src.profile is not None:
        fixed_length, given = src.profile.fixed_length, set_fl[-1].flag if set_fl else None
    for msg in fixed_length_notes(fixed_length if args.fixed_length is not None or given else None, [args.policy],
                                  sc.max_draft_len, given):
        warn(command, msg)
    return sc, fixed_length or 4, src.config
