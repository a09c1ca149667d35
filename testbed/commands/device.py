"""`multispin device --connect tcp://HOST:PORT --name NAME --draft DRAFT.onnx [--hardware H]` (LAN)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("device", help="run one device node (numpy + onnxruntime + pyzmq; no torch)",
                              description="Connect to an edge (or a channel emulator), register, and serve rounds "
                                          "until the edge ends the run.")
    # Same options as `python -m device_node.node` (kept here so building the parser imports no zmq).
    p.add_argument("--connect", required=True, help="edge (or channel emulator) endpoint, tcp://HOST:PORT")
    p.add_argument("--name", required=True, help="device name (its ZeroMQ identity; one of the profile's devices)")
    p.add_argument("--draft", required=True, help="path to the draft model's ONNX file")
    p.add_argument("--hardware", default=None, help="hardware profile name or YAML path (default: edge-class)")
    p.add_argument("--register-timeout", type=float, default=120.0, help="seconds to wait for the edge")
    p.add_argument("--no-tx-marker", action="store_true", help="do not send tx_start markers")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from device_node.node import run_from_args

    return run_from_args(args)
