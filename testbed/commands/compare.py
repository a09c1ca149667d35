"""`multispin compare [PROFILE] --policies proposed,all-ul,all-dl`: the same run under several policies."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("compare", help="run the live testbed once per policy and compare goodput",
                              description="Same prompts, seeds and channel realizations per policy (the channel "
                                          "state is seeded per device and round). Writes one run directory per "
                                          "policy under runs/<stamp>-compare/ and a table of measured goodput.")
    p.add_argument("profile", nargs="?", default=None)
    p.add_argument("--policies", default="proposed,all-ul,all-dl", help="comma-separated policy names")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--channel", choices=["real", "virtual", "passthrough"], default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(handler=handle, policy=None)


def handle(args) -> int:
    import json

    from testbed.cli import CliError
    from testbed.commands.run import load
    from testbed.core.optimizer import POLICIES
    from testbed.launcher import require_edge_extra, resolve_pair, run_live
    from testbed.records import new_run_dir

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if not policies or bad:
        raise CliError(f"--policies: {bad or policies!r} not allowed; allowed: {', '.join(POLICIES)}")
    base = load(args)
    require_edge_extra()  # before an empty run directory is left behind
    parent = new_run_dir(args.runs_dir, "compare")
    pair = resolve_pair(base, progress=not args.quiet)
    rows = []
    for policy in policies:
        profile = base.model_copy(update={"policy": policy})
        run_dir = parent / policy
        print(f"== {policy}: {run_dir}")
        s = run_live(profile, run_dir, progress=not args.quiet, pair=pair)
        rows.append((policy, s))
    ref = rows[0][1].get("goodput_measured_tps") or 0.0
    lines = [f"{'policy':<20}{'rounds':>7}{'tokens':>8}{'time s':>9}{'meas tok/s':>11}{'pred tok/s':>11}"
             f"{'vs ' + policies[0]:>14}"]
    table = []
    for policy, s in rows:
        g = s.get("goodput_measured_tps") or 0.0
        ratio = g / ref if ref else float("nan")
        lines.append(f"{policy:<20}{s.get('rounds', 0):>7}{s.get('tokens', 0):>8}{s.get('time_s', 0):>9.2f}"
                     f"{g:>11.2f}{(s.get('goodput_predicted_tps') or 0):>11.2f}{ratio:>14.3f}")
        table.append({"policy": policy, "rounds": s.get("rounds"), "tokens": s.get("tokens"),
                      "time_s": s.get("time_s"), "goodput_measured_tps": g,
                      "goodput_predicted_tps": s.get("goodput_predicted_tps"), "ratio": ratio})
    text = "\n".join(lines)
    print(text)
    (parent / "compare.txt").write_text(text + "\n")
    (parent / "compare.json").write_text(json.dumps(table, indent=2))
    print(f"compare directory: {parent}")
    return 0
