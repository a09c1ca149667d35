"""Command-line options of a device node, shared by `multispin device` and `python -m device_node.node`
(a module of its own so that building the `multispin` parser imports no zmq or onnxruntime)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, help="edge (or channel emulator) endpoint, tcp://HOST:PORT")
    parser.add_argument("--name", required=True, help="device name (its ZeroMQ identity; one of the profile's devices)")
    parser.add_argument("--draft", required=True, help="path to the draft model's ONNX file")
    parser.add_argument("--hardware", default=None, help="hardware profile name or YAML path (default: edge-class)")
    parser.add_argument("--register-timeout", type=float, default=120.0, help="seconds to wait for the edge")
    parser.add_argument("--no-tx-marker", action="store_true", help="do not send tx_start markers")
