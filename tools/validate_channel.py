"""Run `multispin channel validate` without the rest of the CLI (only pyzmq + the standard library needed).

    python tools/validate_channel.py [--sizes ...] [--rates ...] [--repeats R] [--lead auto|A,B] [--json]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed.cli import CliError  # noqa: E402
from testbed.commands import channel  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="validate_channel")
    channel.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["channel", "validate", *argv])
    try:
        return int(args.handler(args) or 0)
    except CliError as exc:
        print(f"validate_channel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
