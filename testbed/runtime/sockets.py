"""The hardening every ROUTER that faces devices gets (the edge's, the channel emulator's frontend).

A LAN is shared: a peer may send absurd messages, open raw TCP connections that never finish ZeroMQ's
handshake, vanish without a FIN, or try to take a live device's name. One function sets the same options on
every such socket, so the edge and the emulator refuse the same things."""

from __future__ import annotations

import math

import zmq

from testbed.wire import messages as M
from testbed.wire import protocol as P

# A connection that has not finished ZeroMQ's handshake within this is closed (libzmq's default is 30 s): a
# raw TCP peer, or a key the ZAP handler refuses, must not hold one of the process's open files for long.
HANDSHAKE_S = 5.0


def max_message_bytes(max_array_bytes: int = P.MAX_ARRAY_BYTES) -> int:
    """The largest message part a ROUTER admits: two array frames at the decoder's limit plus a header. The
    largest legitimate message, a UL-mode draft (draft length x vocabulary x bytes per probability, plus its
    tokens), stays below `max_array_bytes` (64 MiB: 16 draft tokens of a 152k vocabulary at 4 bytes are 9.7 MB)."""
    return 2 * max_array_bytes + P.MAX_HEADER_BYTES


def harden_router(sock: zmq.Socket, *, max_msg_bytes: int, heartbeat_s: float = M.DEFAULT_HEARTBEAT_S,
                  liveness: int = M.DEFAULT_LIVENESS, handshake_s: float = HANDSHAKE_S,
                  hwm: int | None = None) -> None:
    """Set the options of a device-facing ROUTER before it binds.

    No handover: a second connection under a connected name is ignored by ZeroMQ, so it cannot take a live
    device's messages; a crashed device's connection closes, which frees its name for the restart. TCP
    keepalive and a retransmission limit close a connection whose host vanished (no FIN ever comes), within
    the liveness window (a process that does not know the run's liveness, the emulator, takes the defaults).
    Not ZeroMQ's transport heartbeat: with it, libzmq 4.3.5 aborts the process when a
    peer hangs up with the receive queue full (stream_engine_base.cpp:310), which any peer can arrange.
    `hwm`: None keeps libzmq's high-water marks; 0 lifts them (a socket that must never drop a held message).
    """
    period = max(1, math.ceil(heartbeat_s))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, period)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, period)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, liveness)
    sock.setsockopt(zmq.TCP_MAXRT, max(1, int(liveness * heartbeat_s * 1000)))
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(handshake_s * 1000))
    # Refuse absurd messages at the transport (the peer is disconnected, the process goes on).
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
