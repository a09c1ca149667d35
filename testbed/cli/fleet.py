"""`multispin fleet up|check|down FLEET.yaml`: device hosts on a LAN, prepared, checked, started and stopped
over SSH (testbed/fleet; docs/lan-walkthrough.md)."""

from __future__ import annotations

import argparse

EPILOG = """exit codes:
  0  done: every check passed (check, up), everything stopped (down)
  1  a check failed (up then starts nothing), or a process did not stop
  2  a bad fleet file (the message names the key)"""


def register(subparsers) -> None:
    p = subparsers.add_parser("fleet", help="device hosts on a LAN over SSH: up, check, down",
                              description="Bring up, check and stop the device hosts a fleet file lists. `up` "
                                          "copies keys and the drafter when changed, checks or makes the host's "
                                          "venv, runs `check`, starts the devices under a supervisor that "
                                          "restarts them; `down` stops exactly what `up` started.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="fleet_command", metavar="ACTION")
    sub.required = True
    for action, text in (("up", "copy, install, check, start the devices under a supervisor"),
                         ("check", "one table: endpoints, versions, drafter, keys, clocks, link; each fix"),
                         ("down", "stop the supervisors and devices `up` started")):
        a = sub.add_parser(action, help=text, description=text)
        a.add_argument("fleet_file", metavar="FLEET.yaml", help="the fleet file (docs/lan-walkthrough.md)")
        if action == "up":
            a.add_argument("--follow", action="store_true",
                           help="after starting, stream the devices' logs (host/device | line) until Ctrl-C; "
                                "the devices keep running")
        a.set_defaults(handler=handle)


def handle(args) -> int:
    import asyncio
    import logging
    import sys

    import asyncssh

    from testbed.fleet import control
    from testbed.fleet.remote import HostError
    from testbed.fleet.schema import load_fleet

    logging.getLogger("asyncssh").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    fleet, base = load_fleet(args.fleet_file)
    fw = control.Fleetwide.load(fleet, base, args.fleet_file, compare=args.fleet_command != "down")
    action = {"check": lambda: control.check(fw), "up": lambda: control.up(fw, args.follow),
              "down": lambda: control.down(fw)}[args.fleet_command]
    try:
        return asyncio.run(action())
    except KeyboardInterrupt:
        if not getattr(args, "follow", False):
            raise
        print(f"stopped following; the devices keep running (multispin fleet down {args.fleet_file} stops them)",
              file=sys.stderr)
        return 0
    except HostError as exc:  # a host that failed mid-way (a copy, a start): what happened and what to do
        print(f"multispin fleet {args.fleet_command}: {exc} (fix: {exc.fix})", file=sys.stderr)
        return 1
    except (OSError, asyncssh.Error) as exc:
        print(f"multispin fleet {args.fleet_command}: the SSH connection failed: {exc}", file=sys.stderr)
        return 1
