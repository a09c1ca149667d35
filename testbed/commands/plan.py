"""`multispin plan SCENARIO.yaml [--policy NAME] [--fixed-length N] [--json]`: one round's schedule."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    from testbed.core.optimizer import POLICIES

    p = subparsers.add_parser(
        "plan", help="plan one round (modes, draft lengths, powers) for a scenario",
        description="Plan one round for a scenario and print the predicted goodput and per-device schedule. "
                    "Policies: " + "; ".join(f"{k}: {v}" for k, v in POLICIES.items()))
    p.add_argument("scenario", help="scenario YAML or a name in profiles/ (a run profile: its scenario: section)")
    p.add_argument("--policy", default="proposed", help=f"one of: {', '.join(POLICIES)} (default proposed)")
    p.add_argument("--fixed-length", type=int, default=None,
                   help="draft length of the fixed-length policy (default 4; clamped to max_draft_len)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-modes policy")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(handler=run)


# Plan fields under the phase vocabulary of the round record and the report (testbed.controller.PHASE_FIELDS):
# new name -> the plan's own name, which stays beside it (readers of `plan --json` exist). Note that the
# plan's `uplink_s` is the uplink *phase* (drafting included), not the air time: hence the new names.
DEVICE_ALIASES = {"ul_air_s": "tx_s", "uplink_phase_s": "uplink_s", "dl_air_s": "downlink_s"}


def with_vocabulary(d: dict) -> dict:
    """The plan dict with the vocabulary's names added beside its own (seconds): per device ul_air_s,
    uplink_phase_s, dl_air_s; per round uplink_phase_s, verify_s, downlink_phase_s, round_s."""
    ph = d["phases_s"]
    out = {**d, "uplink_phase_s": ph["uplink"], "verify_s": ph["verify"], "downlink_phase_s": ph["downlink"],
           "round_s": d["round_time_s"]}
    out["devices"] = [{**x, **{new: x[old] for new, old in DEVICE_ALIASES.items()}} for x in d["devices"]]
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
    return "\n".join(lines)


def run(args) -> int:
    from testbed.cli import CliError
    from testbed.commands.simulate import plan_inputs  # profile resolution, flag checks and warnings
    from testbed.core.optimizer import OptimizerError, plan
    from testbed.core.scenario import ScenarioError

    try:
        sc, fixed_length = plan_inputs(args)
        result = plan(sc, args.policy, fixed_length=fixed_length, seed=args.seed)
    except (ScenarioError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    d = result.to_dict()
    print(json.dumps(with_vocabulary(d)) if args.json else format_plan(d))
    return 0
