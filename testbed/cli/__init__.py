"""The `multispin` command line. Each subcommand lives in `testbed/cli/<name>.py` and exposes
``register(subparsers)``; heavy imports (torch, zmq, matplotlib) happen inside the handlers."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import signal
import sys

from testbed import __version__
from testbed.runtime.errors import TestbedError

# Order is the order `multispin --help` lists them.
COMMAND_MODULES = [
    "run", "rerun", "plan", "simulate", "models", "edge", "device", "runs", "report", "compare", "campaign", "channel",
    "keys", "fleet", "plugins", "export",
]


class CliError(TestbedError):
    """A bad command-line argument; like any TestbedError, printed without a traceback."""


def warn(command: str, message: str) -> None:
    """A flag that is clamped or ignored: one line on stderr (not a log record: it shows under --quiet too)."""
    print(f"multispin {command}: warning: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multispin",
        description="Multi-device speculative inference testbed with uplink/downlink mode selection.",
    )
    parser.add_argument("--version", action="version", version=f"multispin {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging (here or anywhere after the command's name)")
    parser.add_argument("--quiet", action="store_true",
                        help="warnings and errors only, no progress bars (here or anywhere after the command's name)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"testbed.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"testbed.cli.{name}":
                continue  # subcommand not present in this checkout
            raise
        module.register(sub)
    return parser


def quiet_mode() -> None:
    """--quiet: no progress bars (ours, tqdm's anywhere, the model loaders'), logging at WARNING, and no Python
    warnings in this process (a library's RuntimeWarning or DeprecationWarning; `-v` shows them). Set in the
    environment before the heavy imports, so that child processes (devices, the emulator) inherit it; their
    output, warnings included, goes to the run's logs/ and never to the terminal."""
    import warnings

    warnings.simplefilter("ignore")
    os.environ["TQDM_DISABLE"] = "1"  # tqdm >= 4.66 reads its defaults from TQDM_* variables
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' "Loading weights" bar
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "transformers" in sys.modules:  # imported already: its flags were read at import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


# Flags every command takes, before or after its name (`multispin campaign -v`, `multispin --quiet report R`).
GLOBAL_FLAGS = {"-v": "verbose", "--verbose": "verbose", "--quiet": "quiet"}


def split_global_flags(argv: list[str]) -> tuple[list[str], set[str]]:
    """(argv without the global flags, the names of those given); after `--` nothing is a flag."""
    end = argv.index("--") if "--" in argv else len(argv)
    given = {GLOBAL_FLAGS[a] for a in argv[:end] if a in GLOBAL_FLAGS}
    return [a for a in argv[:end] if a not in GLOBAL_FLAGS] + argv[end:], given


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given_argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    rest, flags = split_global_flags(given_argv)
    args, extra = parser.parse_known_args(rest)
    args.verbose = args.verbose or "verbose" in flags
    if "quiet" in flags:
        args.quiet = True
    # argparse cannot take positionals on both sides of an option (`report A --no-plots B`); the runs
    # after it are more runs, anything else is the usual error.
    if extra and isinstance(getattr(args, "more_runs", None), list) and not any(x.startswith("-") for x in extra):
        args.more_runs += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = given_argv  # as given: meta.json's command line
    quiet = bool(getattr(args, "quiet", False)) and not args.verbose
    if quiet:
        quiet_mode()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if quiet:  # basicConfig leaves a root logger that has handlers already (an embedding program) as it is
        logging.getLogger().setLevel(logging.WARNING)
    # Started in the background of a non-interactive shell (`cmd &`, nohup in a script, some CI runners), a
    # process inherits SIGINT ignored and Python installs no handler: Ctrl-C or `kill -INT` then did nothing
    # (the flaky `channel validate` test, run under such a pytest). Every command promises to stop on it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = args.handler(args)
    except TestbedError as exc:  # the library's and the commands' errors alike (CliError is one)
        print(f"multispin {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP during a run (testbed.run.launcher.RunInterrupted)
        print("interrupted", file=sys.stderr)
        # The interpreter's last garbage collection over a loaded model's objects takes seconds (2.5-4 s seen
        # after a run): what is left is freed by the exit itself, so Ctrl-C ends the command within 5 s.
        gc.freeze()
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except BrokenPipeError:
        return broken_pipe()
    try:
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at interpreter exit
    except BrokenPipeError:
        return broken_pipe()
    return int(result or 0)


def broken_pipe() -> int:
    """The reader of stdout went away (`multispin report RUN | head`): stop quietly, as a shell tool does.
    stdout is pointed at /dev/null so that the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + signal.SIGPIPE

