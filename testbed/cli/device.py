"""`multispin device --connect tcp://HOST:PORT --name NAME --draft DRAFT.onnx [--hardware H]` (LAN)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from device_node.options import EPILOG, add_arguments

    p = subparsers.add_parser("device", help="run one device node (numpy + onnxruntime + pyzmq; no torch)",
                              description="Connect to an edge (or a channel emulator), register, and serve rounds "
                                          "until the edge ends the run.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)

    add_arguments(p)
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from device_node.node import run_from_args

    return run_from_args(args)
