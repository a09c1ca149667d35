"""The `multispin` command line. Each subcommand lives in `testbed/commands/<name>.py` and exposes
``register(subparsers)``; heavy imports (torch, zmq, matplotlib) happen inside the handlers."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from testbed import __version__

# Order is the order `multispin --help` lists them.
COMMAND_MODULES = [
    "run", "plan", "simulate", "models", "edge", "device", "report", "compare", "channel",
]


class CliError(Exception):
    """An error the user can fix; printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multispin",
        description="Multi-device speculative inference testbed with uplink/downlink mode selection.",
    )
    parser.add_argument("--version", action="version", version=f"multispin {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"testbed.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"testbed.commands.{name}":
                continue  # subcommand not present in this checkout
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        result = args.handler(args)
    except CliError as exc:
        print(f"multispin {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    # Under `python -m testbed.cli` this file is `__main__`; run the package module so that the
    # subcommands' `from testbed.cli import CliError` is the class caught here.
    from testbed.cli import main as package_main

    sys.exit(package_main())
