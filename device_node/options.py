"""Command-line options and exit codes of a device node, shared by `multispin device` and
`python -m device_node.node` (a module of its own so that building the `multispin` parser imports no zmq or
onnxruntime)."""

from __future__ import annotations

import argparse
import enum


class ExitCode(enum.IntEnum):
    """Exit status of a device process: the launcher records it in meta.json, a LAN script can act on it."""

    OK = 0
    USAGE = 2
    NO_EDGE = 3
    REFUSED = 4
    EDGE_SILENT = 5
    EDGE_FATAL = 6
    EDGE_GONE = 7


# What each code means, for the --help epilog (1 is Python's own status for an uncaught exception).
EXIT_HELP = {
    ExitCode.OK: "the edge ended the run",
    ExitCode.USAGE: "bad arguments: keys; hardware profile or draft ONNX file (the edge is told why)",
    ExitCode.NO_EDGE: "no answer from the edge within --register-timeout",
    ExitCode.REFUSED: "registration refused (wrong name or vocabulary size; see the log)",
    ExitCode.EDGE_SILENT: "no message from the edge for the idle timeout (an edge without heartbeats)",
    ExitCode.EDGE_FATAL: "the edge reported a fatal error",
    ExitCode.EDGE_GONE: "the edge stopped answering (no heartbeat for its liveness window; see --reconnect)",
}

_ALL_EXITS = sorted([(int(code), text) for code, text in EXIT_HELP.items()] + [(1, "an unexpected error (traceback)")])
EPILOG = "exit codes:\n" + "\n".join(f"  {code}  {text}" for code, text in _ALL_EXITS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, help="edge (or channel emulator) endpoint, tcp://HOST:PORT")
    parser.add_argument("--name", required=True, help="device name (its ZeroMQ identity; one of the profile's devices)")
    parser.add_argument("--draft", required=True, help="path to the draft model's ONNX file")
    parser.add_argument("--hardware", default=None, help="hardware profile name or YAML path (default: edge-class)")
    parser.add_argument("--register-timeout", type=float, default=120.0,
                        help="seconds to keep registering (resent every 1-8 s) before giving up")
    parser.add_argument("--reconnect", action="store_true",
                        help="when the edge goes silent, reconnect and register again until it returns "
                             "(default: exit with status 7)")
    parser.add_argument("--keys", default=None, metavar="DIR",
                        help="this device's key bundle (DIR/client.key_secret, DIR/server.key) from "
                             "`multispin keys generate`: CURVE-encrypted, authenticated link")
    parser.add_argument("--no-tx-marker", action="store_true", help="do not send tx_start markers")
