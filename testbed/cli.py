"""The `multispin` command line. Each subcommand lives in `testbed/commands/<name>.py` and exposes
``register(subparsers)``; heavy imports (torch, zmq, matplotlib) happen inside the handlers."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

from testbed import __version__
from testbed.errors import TestbedError

# Order is the order `multispin --help` lists them.
COMMAND_MODULES = [
    "run", "plan", "simulate", "models", "edge", "device", "report", "compare", "channel", "keys",
]


class CliError(TestbedError):
    """A bad command-line argument; like any TestbedError, printed without a traceback."""


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
    except TestbedError as exc:  # the library's and the commands' errors alike (CliError is one)
        print(f"multispin {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP during a run (testbed.launcher.RunInterrupted)
        print("interrupted", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    return int(result or 0)


if __name__ == "__main__":
    # Under `python -m testbed.cli` the commands' `testbed.cli.CliError` is a second class (this file is
    # `__main__`), but both derive from testbed.errors.TestbedError, the class caught in main.
    sys.exit(main())
