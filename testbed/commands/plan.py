"""`multispin plan SCENARIO.yaml [--policy NAME] [--fixed-length N] [--json]`: one round's schedule."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    from testbed.core.optimizer import POLICIES

    p = subparsers.add_parser(
        "plan", help="plan one round (modes, draft lengths, powers) for a scenario",
        description="Plan one round for a scenario and print the predicted goodput and per-device schedule. "
                    "Policies: " + "; ".join(f"{k}: {v}" for k, v in POLICIES.items()))
    p.add_argument("scenario", help="scenario YAML (see profiles/scenarios/)")
    p.add_argument("--policy", default="proposed", help=f"one of: {', '.join(POLICIES)} (default proposed)")
    p.add_argument("--fixed-length", type=int, default=4, help="draft length of the fixed-length policy")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-modes policy")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(handler=run)


def format_plan(d: dict) -> str:
    ph = d["phases_s"]
    lines = [
        f"policy {d['policy']}: goodput {d['goodput_tps']:.2f} tokens/s, round {d['round_time_s'] * 1e3:.1f} ms "
        f"(uplink {ph['uplink'] * 1e3:.1f} + verify {ph['verify'] * 1e3:.1f} "
        f"+ downlink {ph['downlink'] * 1e3:.1f} ms), "
        f"{d['num_ul_devices']} of {len(d['devices'])} devices in UL mode",
        f"{'device':>10} {'mode':>4} {'L':>3} {'E[tok]':>7} {'tok/s':>7} {'draft ms':>9} {'uplink ms':>10} "
        f"{'downlink ms':>12} {'UL Mb/s':>8} {'DL Mb/s':>8} {'p_UL W':>7} {'p_DL W':>7}",
    ]
    for x in d["devices"]:
        lines.append(
            f"{x['name']:>10} {x['mode']:>4} {x['draft_len']:>3} {x['expected_tokens']:>7.2f} "
            f"{x['goodput_tps']:>7.2f} {x['draft_s'] * 1e3:>9.1f} {x['uplink_s'] * 1e3:>10.1f} "
            f"{x['downlink_s'] * 1e3:>12.1f} {x['ul_rate_bps'] / 1e6:>8.2f} {x['dl_rate_bps'] / 1e6:>8.2f} "
            f"{x['ul_power_w']:>7.3f} {x['dl_power_w']:>7.3f}")
    return "\n".join(lines)


def run(args) -> int:
    from testbed.cli import CliError
    from testbed.core.optimizer import OptimizerError, plan
    from testbed.core.scenario import ScenarioError
    from testbed.scenario_file import load_scenario

    try:
        sc = load_scenario(args.scenario)
        result = plan(sc, args.policy, fixed_length=args.fixed_length, seed=args.seed)
    except (ScenarioError, OptimizerError) as exc:
        raise CliError(str(exc)) from None
    d = result.to_dict()
    print(json.dumps(d) if args.json else format_plan(d))
    return 0
