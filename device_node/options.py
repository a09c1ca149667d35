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


TRANSPORTS = ("tcp", "ipc", "inproc")


def endpoint(text: str) -> str:
    """--connect: a ZeroMQ endpoint with its transport. Without one (`127.0.0.1:5600`) ZeroMQ fails deep in
    connect() with a bare "Invalid argument"; here the user reads what to write instead."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        example = f"tcp://{text}" if ":" in text else f"tcp://{text}:PORT"
        raise argparse.ArgumentTypeError(f"{text!r} has no transport: use tcp://HOST:PORT (here: {example})")
    if scheme not in TRANSPORTS:
        raise argparse.ArgumentTypeError(f"{text!r}: transport {scheme!r} is not supported: use tcp://HOST:PORT "
                                         f"(or ipc://PATH on one host)")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"{text!r}: use tcp://HOST:PORT with a port 1..65535")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, type=endpoint, metavar="tcp://HOST:PORT",
                        help="edge (or channel emulator) endpoint, tcp://HOST:PORT")
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
    parser.add_argument("--link-probe", default="none", metavar="SPEC",
                        help="measure the radio link and send the edge the latest reading with each report: "
                             "linux-wireless[:IFACE] | file:PATH | command:CMD | none (default: none)")
    parser.add_argument("--link-probe-period-s", type=float, default=1.0, metavar="S",
                        help="seconds between two link measurements (default: 1)")
    parser.add_argument("--serve-runs", action="store_true",
                        help="after the edge ends a run, wait for SIGUSR1 and register again for the next run "
                             "instead of exiting (the warm trials of `multispin compare` and `campaign`)")
    parser.add_argument("--busy-poll", action="store_true",
                        help="busy-poll the socket instead of sleeping while waiting for the edge: no kernel "
                             "wake-up per message (0.3-0.5 ms on a virtual machine), at the cost of a core")
