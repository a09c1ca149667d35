"""`multispin run`: until the live testbed lands, the offline simulator on the default scenario."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the main job on a profile (offline simulation for now)")
    p.add_argument("profile", nargs="?", default=None, help="scenario profile (default profiles/scenarios/default.yaml)")
    p.add_argument("--out", default="runs/simulate-devices", help="output directory")
    p.set_defaults(handler=run)


def run(args) -> int:
    from testbed.commands import simulate

    print("multispin run: the live testbed is not in this build; running the offline simulator: "
          "goodput of every policy vs the number of devices (5 drops per point)")
    sim_args = argparse.Namespace(
        profile=args.profile or str(simulate.DEFAULT_PROFILE), sweep="devices=5,10,20,30,50", drops=5,
        policies=None, fixed_length=4, monte_carlo=False, rounds=200, seed=0, out=args.out, no_progress=False)
    return simulate.run(sim_args)
