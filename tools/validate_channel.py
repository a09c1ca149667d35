"""Run `multispin channel validate` without the rest of the CLI (only pyzmq + the standard library needed).

    python tools/validate_channel.py [--sizes ...] [--rates ...] [--repeats R] [--lead auto|A,B] [--json]
"""

import argparse
import sys

from testbed.cli import channel
from testbed.runtime.errors import TestbedError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="validate_channel")
    channel.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["channel", "validate", *argv])
    try:
        return int(args.handler(args) or 0)
    except TestbedError as exc:  # the command's CliError is one
        print(f"validate_channel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
