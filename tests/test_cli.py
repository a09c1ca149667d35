import subprocess
import sys

from testbed.cli import build_parser


def test_version_and_unknown_command():
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("multispin ")
    bad = subprocess.run([sys.executable, "-m", "testbed.cli", "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_every_registered_command_has_a_handler():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sub.choices, "no subcommands registered"
    for name, subparser in sub.choices.items():
        assert subparser.get_default("handler") is not None or subparser._subparsers is not None, name
