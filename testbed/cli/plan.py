"""`multispin plan SCENARIO.yaml [--policy NAME] [--fixed-length N] [--json]`: one round's schedule;
`--channel-rounds R` plans R rounds of a run profile's channel state as the live controller would."""

from __future__ import annotations

import json
import math


def register(subparsers) -> None:
    from testbed.cli.run import add_profile_arguments
    from testbed.core.optimizer import POLICIES

    p = subparsers.add_parser(
        "plan", help="plan one round (modes, draft lengths, powers) for a scenario",
        description="Plan one round for a scenario and print the predicted goodput and per-device schedule. "
                    "Built-in policies: " + "; ".join(f"{k}: {v}" for k, v in POLICIES.items())
                    + ". Plug-in policies are accepted too: the name of an installed one (`multispin plugins` "
                      "lists them) or a Python path module:Class (docs/extending.md).")
    p.add_argument("scenario", nargs="?", default="emulation",
                   help="scenario YAML or a name in profiles/ (a run profile: its scenario: section; "
                        "default: emulation, the profile `multispin run` uses)")
    p.add_argument("--policy", default=None,
                   help=f"one of: {', '.join(POLICIES)} (default: a run profile's policy, --set policy=... included, "
                        "else proposed); or a plug-in: the name of an installed one (multispin plugins) or a Python "
                        "path module:Class (docs/extending.md)")
    p.add_argument("--fixed-length", type=int, default=None,
                   help="draft length of the fixed-length policy (default 4; clamped to max_draft_len)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-modes policy")
    p.add_argument("--channel-rounds", type=int, default=None, metavar="R",
                   help="a run profile with channel.state: plan rounds 0..R-1 on its channel source (a plug-in too) "
                        "as the live controller does (fallback included), the clock advancing by each planned "
                        "round time; prints one line per round")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    add_profile_arguments(p, set_help="override a field of the scenario or profile planned: dotted keys, list "
                                      "entries by index or device name, YAML values. A run profile takes its own "
                                      "keys (--set scenario.devices.dev0.distance_m=50) or its scenario's "
                                      "(--set devices.dev0.distance_m=50); a scenario file takes its keys "
                                      "(--set devices.d0.distance_m=50, a leading scenario. is dropped)")
    p.set_defaults(handler=run)


# Plan fields under the phase vocabulary of the round record and the report (edge_node.controller.PHASE_FIELDS):
# new name -> the plan's own name, which stays beside it (readers of `plan --json` exist). Note that the
# plan's `uplink_s` is the uplink *phase* (drafting included), not the air time: hence the new names.
DEVICE_ALIASES = {"ul_air_s": "tx_s", "uplink_phase_s": "uplink_s", "dl_air_s": "downlink_s"}


def with_vocabulary(d: dict) -> dict:
    """The plan dict in the records' vocabulary (seconds): per device ul_air_s, uplink_phase_s, dl_air_s
    replace the core's tx_s, uplink_s, downlink_s (whose `uplink_s` would clash with the records' legacy
    `uplink_s`, the air time); per round uplink_phase_s, verify_s, downlink_phase_s, round_s beside
    `phases_s` and `round_time_s`."""
    ph = d["phases_s"]
    out = {**d, "uplink_phase_s": ph["uplink"], "verify_s": ph["verify"], "downlink_phase_s": ph["downlink"],
           "round_s": d["round_time_s"]}
    out["devices"] = [{**{k: v for k, v in x.items() if k not in DEVICE_ALIASES.values()},
                       **{new: x[old] for new, old in DEVICE_ALIASES.items()}} for x in d["devices"]]
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"  # significant digits: a 10 us air time must not print as 0.0


def format_plan(d: dict) -> str:
    """The plan as a table: phase names as in the round record, units in every header."""
    d = with_vocabulary(d)
    overhead = d["round_s"] - d["uplink_phase_s"] - d["verify_s"] - d["downlink_phase_s"]
    lines = [
        f"policy {d['policy']}: goodput {d['goodput_tps']:.2f} tok/s; round_s {_ms(d['round_s'])} ms = "
        f"uplink_phase_s {_ms(d['uplink_phase_s'])} + verify_s {_ms(d['verify_s'])} + "
        f"downlink_phase_s {_ms(d['downlink_phase_s'])} ms"
        + (f" + round overhead T_0 {_ms(overhead)} ms" if overhead > 1e-12 else "")
        + f"; {d['num_ul_devices']} of {len(d['devices'])} devices in UL mode",
        f"{'device':>10} {'mode':>4} {'L':>5} {'E_tokens':>8} {'goodput':>8} {'draft_s':>9} {'ul_air_s':>9} "
        f"{'uplink_phase_s':>14} {'dl_air_s':>9} {'UL rate':>9} {'DL rate':>9} {'p_UL':>6} {'p_DL':>6}",
        f"{'':>10} {'':>4} {'[tok]':>5} {'[tok]':>8} {'[tok/s]':>8} {'[ms]':>9} {'[ms]':>9} {'[ms]':>14} {'[ms]':>9} "
        f"{'[Mbit/s]':>9} {'[Mbit/s]':>9} {'[W]':>6} {'[W]':>6}",
    ]
    for x in d["devices"]:
        lines.append(
            f"{x['name']:>10} {x['mode']:>4} {x['draft_len']:>5} {x['expected_tokens']:>8.2f} "
            f"{x['goodput_tps']:>8.2f} {_ms(x['draft_s']):>9} {_ms(x['ul_air_s']):>9} "
            f"{_ms(x['uplink_phase_s']):>14} {_ms(x['dl_air_s']):>9} {x['ul_rate_bps'] / 1e6:>9.3g} "
            f"{x['dl_rate_bps'] / 1e6:>9.3g} {x['ul_power_w']:>6.3f} {x['dl_power_w']:>6.3f}")
    lines.append("uplink_phase_s = draft_s + ul_air_s; dl_air_s: DL air time (DL mode), the reply time c_r "
                 "(UL mode); E_tokens: expected output tokens per round; docs/system-model.md, section 5")
    scales = {n: x for n, x in (d.get("compute_scale") or {}).items() if x != 1.0}
    if scales:
        lines.append("draft_s: the prior drafting time x the device's hardware compute_scale, as a live run starts "
                     "from (" + ", ".join(f"{n} {x:g}" for n, x in scales.items()) + ")")
    pay = d.get("payload")
    if pay:  # the upload format chosen with the plan (topk_choices): every option's goodput
        opts = ", ".join(f"{'dense' if o['k'] is None else 'k=' + str(o['k'])} "
                         + ("infeasible" if o["goodput_tps"] is None else f"{o['goodput_tps']:.2f}")
                         for o in pay.get("options") or [])
        lines.append(f"upload: {'dense' if pay['k'] is None else 'top-k, k = ' + str(pay['k'])} (every device drafts "
                     f"from it); options [tok/s]: {opts}")
    return "\n".join(lines)


def run(args) -> int:
    from testbed.cli import CliError, warn
    from testbed.cli.run import print_config
    from testbed.cli.simulate import plan_inputs  # profile resolution, flag checks and warnings
    from testbed.core import payload
    from testbed.core.optimizer import OptimizerError, plan
    from testbed.core.scenario import ScenarioError
    from testbed.run.planning import scaled_scenario
    from testbed.runtime.heap import keep_freed_memory
    from testbed.runtime.plugins import load_policy
    from testbed.runtime.records import json_text

    keep_freed_memory()  # the optimizer's large temporaries (`testbed.runtime.heap`)

    try:
        profile = run_profile(args)
    except (ScenarioError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    if args.policy is None:  # as `multispin run`: --policy, else the profile's (its file, then --set policy=)
        args.policy = profile.policy if profile is not None else "proposed"
    if args.channel_rounds is not None:
        return channel_rounds(args)
    try:
        sc, fixed_length, config = plan_inputs(args)
        if args.print_config:
            return print_config(config)
        scales = {}
        if profile is not None:  # each device's prior drafting time x its hardware's compute_scale, as live
            scales = profile_scales(profile, [d.name for d in sc.devices])
            sc = scaled_scenario(sc, scales)
        result = plan(sc, load_policy(args.policy), fixed_length=fixed_length, seed=args.seed)
        if payload.unmodelled_note(sc):
            warn("plan", payload.unmodelled_note(sc))
    except (ScenarioError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    d = result.to_dict()
    if scales:
        d["compute_scale"] = scales
    print(json_text(with_vocabulary(d)) if args.json else format_plan(d))
    return 0


def run_profile(args):
    """The run profile planned (with --set), or None for a scenario file."""
    from testbed.run.config_override import parse_set
    from testbed.run.profile import resolve_plan_source

    return resolve_plan_source(args.scenario, parse_set(args.set)).profile


def profile_scales(profile, names: list[str]) -> dict[str, float]:
    """Device -> its hardware profile's compute_scale (`profiles/hardware/`); a CliError names a bad one."""
    from testbed.cli import CliError
    from testbed.run.planning import hardware_scales

    try:
        return hardware_scales(profile, names)
    except ValueError as exc:
        raise CliError(f"hardware: {exc}") from None


def channel_rounds(args) -> int:
    """`--channel-rounds R`: the live controller (`edge_node.controller.Controller`) plans R rounds on the
    profile's channel state, with its priors as estimates (nothing is measured) and the clock advancing by
    each planned round time."""
    import sys

    from testbed.cli import CliError, warn
    from testbed.cli.run import print_config
    from testbed.run.config_override import fixed_length_notes, parse_set, policy_list
    from testbed.run.planning import make_controller
    from testbed.run.profile import find_profile, resolve_plan_source

    if args.channel_rounds < 1:
        raise CliError(f"--channel-rounds {args.channel_rounds}: must be >= 1")
    policy_list(args.policy, "--policy")
    path = find_profile(args.scenario)
    src = resolve_plan_source(path, parse_set(args.set))
    profile = src.profile
    if profile is None:  # a scenario file: it has no channel
        raise CliError(f"--channel-rounds needs a run profile with channel.state: {path} is a scenario file, not a "
                       "run profile (no scenario: section)")
    if args.print_config:
        return print_config(profile)
    state = profile.channel.state
    if state is None:
        raise CliError(f"--channel-rounds: {path} has no channel.state; give a run profile with one (e.g. "
                       "examples/ge_threshold/profile.yaml)")
    sc = profile.scenario_obj()
    fixed_length = args.fixed_length or profile.fixed_length
    for msg in fixed_length_notes(args.fixed_length, [args.policy], sc.max_draft_len):
        warn("plan", msg)
    scales = profile_scales(profile, [d.name for d in sc.devices])
    try:  # the live run's controller (testbed.run.planning): its priors, hardware scales and channel state
        ctl = make_controller(profile, sc, scales, policy=args.policy, seed=args.seed, fixed_length=fixed_length)
    except ValueError as exc:
        raise CliError(f"{path}: channel.state: {exc}") from None
    cs = ctl.channel_state
    names, t, rounds = [d.name for d in sc.devices], 0.0, []
    for r in range(args.channel_rounds):
        try:
            rp = ctl.plan_round(r, names, t)
        except ValueError as exc:  # the channel source's own error for this round
            raise CliError(f"round {r}: {exc}") from None
        rounds.append({"round": r, "t_s": t, "gains_db": {n: e["gain_db"] for n, e in rp.estimates.items()},
                       "sat_out": rp.sat_out, **with_vocabulary(rp.plan)} if rp.devices else
                      {"round": r, "t_s": t, "sat_out": rp.sat_out})
        t += rp.plan.get("round_time_s") or 0.0
    planned = [x for x in rounds if "goodput_tps" in x]
    mean = sum(x["goodput_tps"] for x in planned) / len(planned) if planned else None
    fallbacks = sum(1 for x in planned if x.get("fallback"))
    stderr = (math.sqrt(sum((x["goodput_tps"] - mean) ** 2 for x in planned) / (len(planned) - 1) / len(planned))
              if len(planned) > 1 else None)
    if args.json:
        print(json.dumps({"policy": args.policy, "channel_source": cs.source, "mean_goodput_tps": mean,
                          "stderr_goodput_tps": stderr, "fallback_rounds": fallbacks, "compute_scale": scales,
                          "rounds": rounds}))
        return 0
    print(f"policy {args.policy} on channel source {cs.source!r} ({path}): {args.channel_rounds} rounds",
          file=sys.stderr)
    print(f"{'round':>5} {'t_s':>8} {'goodput':>8} {'UL':>3}  per device: gain dB, mode, L")
    for x in rounds:
        if "goodput_tps" not in x:
            print(f"{x['round']:>5} {x['t_s']:>8.3f} {'-':>8} {'-':>3}  every device sat out")
            continue
        devs = "  ".join(f"{d['name']} {x['gains_db'][d['name']]:.1f} {d['mode']} {d['draft_len']}"
                         for d in x["devices"])
        note = f"  [fallback to {x['fallback']['policy']}: {x['fallback']['reason'][:60]}]" if x.get("fallback") else ""
        print(f"{x['round']:>5} {x['t_s']:>8.3f} {x['goodput_tps']:>8.2f} {x['num_ul_devices']:>3}  {devs}{note}")
    if mean is not None:
        print(f"mean predicted goodput {mean:.2f}" + (f" +- {stderr:.2f}" if stderr is not None else "")
              + f" tok/s (+- its standard error) over {len(planned)} planned rounds"
              + (f"; {fallbacks} fell back to the safe policy" if fallbacks else ""))
    return 0
