"""`multispin device --connect tcp://HOST:PORT --name NAME --draft DRAFT.onnx [--hardware H]` (LAN)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("device", help="run one device node (numpy + onnxruntime + pyzmq; no torch)",
                              description="Connect to an edge (or a channel emulator), register, and serve rounds "
                                          "until the edge ends the run.")
    from device_node.options import add_arguments

    add_arguments(p)
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from device_node.node import run_from_args

    return run_from_args(args)
