"""A flood of identities at the emulator's frontend (issue 35): 3,000 distinct identities connect, finish ZeroMQ's
handshake, send garbage and stay connected, against an emulator whose process may open 1,024 files (`ulimit -n
1024`). An honest device still registers within 5 s during the flood, and the emulator's open files stay bounded:
idle frontend connections are shut down past the cap, DEALERs of identities the edge never registered expire.
The attackers are raw tcp sockets speaking ZMTP 3.1 by hand (one file each on this side)."""

from __future__ import annotations

import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import zmq
from support import wait_until

from channel_emulator.proxy import ChannelControl
from testbed.run.launcher import child_env
from testbed.wire import messages as M
from testbed.wire.protocol import decode_header, encode_header

pytestmark = pytest.mark.live

FILES = 1024
ATTACKERS = 3000


def _zmtp_dealer(port: int, ident: bytes, body: bytes, timeout_s: float = 2.0) -> socket.socket | None:
    """A raw ZMTP 3.1 DEALER (NULL mechanism) under `ident` that sends one message `body` and stays connected."""
    s = socket.socket()
    s.settimeout(timeout_s)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    props = b""
    for name, value in ((b"Socket-Type", b"DEALER"), (b"Identity", ident)):
        props += bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    ready = b"\x05READY" + props
    try:  # the greeting, the server's, then the rest (libzmq refuses a READY in the greeting's read)
        s.sendall(greeting)
        got = b""
        while len(got) < 64:
            chunk = s.recv(64 - len(got))
            if not chunk:
                raise OSError("closed")
            got += chunk
        s.sendall(bytes([0x04, len(ready)]) + ready + bytes([0x00, len(body)]) + body)
    except OSError:
        s.close()
        return None
    return s


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def test_an_honest_device_registers_during_a_flood_of_identities_and_the_files_stay_bounded(tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    eps = {"front": f"tcp://127.0.0.1:{port}", "edge": f"ipc://{tmp_path}/edge", "ctl": f"ipc://{tmp_path}/ctl"}
    ctx = zmq.Context()
    edge = ctx.socket(zmq.ROUTER)
    edge.setsockopt(zmq.LINGER, 0)
    edge.bind(eps["edge"])
    stop = threading.Event()
    edge_got = {"n": 0}

    def serve_edge():  # a stand-in edge: answers a `register` with `registered`, drops everything else
        while not stop.is_set():
            if not edge.poll(50):
                continue
            frames = edge.recv_multipart()
            edge_got["n"] += 1
            try:
                h = decode_header(frames[1])
            except Exception:  # noqa: BLE001 - garbage
                continue
            if h.get("type") == "register":
                edge.send_multipart([frames[0], encode_header({"type": "registered", "session": "s"})])

    env = {k: v for k, v in child_env().items() if k != "MULTISPIN_CHANNEL_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "channel_emulator.proxy", "--frontend", eps["front"], "--edge", eps["edge"],
         "--control", eps["ctl"], "--unregistered-idle-s", "2"], stdout=open(tmp_path / "emu.log", "wb"),
        stderr=subprocess.STDOUT, env=env,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES)))
    ctl = ChannelControl(eps["ctl"], timeout_s=10, context=ctx)
    edge_thread = threading.Thread(target=serve_edge, daemon=True)
    attackers: list[socket.socket] = []
    half = threading.Event()

    def flood():
        for i in range(ATTACKERS):
            s = _zmtp_dealer(port, f"flood{i}".encode(), b"\x00garbage" * 4)
            if s is not None:
                attackers.append(s)
            if i == ATTACKERS // 3:
                half.set()
        half.set()

    fd_max = [0]

    def sample():
        while not stop.is_set():
            fd_max[0] = max(fd_max[0], _fds(proc.pid))
            time.sleep(0.05)

    honest = None
    try:
        ctl.stats()
        edge_thread.start()
        threading.Thread(target=sample, daemon=True).start()
        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        assert half.wait(60)
        honest = ctx.socket(zmq.DEALER)
        honest.setsockopt(zmq.ROUTING_ID, b"honest")
        honest.setsockopt(zmq.LINGER, 0)
        t0 = time.monotonic()
        honest.connect(eps["front"])
        registered_after = None
        while time.monotonic() - t0 < 5.0 and registered_after is None:
            honest.send_multipart(M.register("honest", 8, {"name": "honest"}))  # a device retries its register
            t_try = time.monotonic() + 0.5
            while (left := t_try - time.monotonic()) > 0 and honest.poll(int(left * 1000) + 1):
                if decode_header(honest.recv_multipart()[0])["type"] == "registered":
                    registered_after = time.monotonic() - t0
                    break
        flooding = flooder.is_alive()
        flooder.join(120)
        assert proc.poll() is None, (tmp_path / "emu.log").read_text()[-3000:]
        assert registered_after is not None and registered_after < 5.0, (tmp_path / "emu.log").read_text()[-3000:]
        stats = ctl.stats()
        print(f"honest registered after {registered_after:.3f} s (flood still connecting: {flooding}); "
              f"attackers connected: {len(attackers)}; emulator fds max {fd_max[0]}, now {_fds(proc.pid)}; "
              f"counters {stats['counters']}; connections {stats['connections']}")
        assert fd_max[0] < FILES
        assert stats["counters"]["connections_shut"] > 0
        # The honest device stays registered; the garbage identities' DEALERs expire (2 s idle).
        honest.send_multipart(M.heartbeat())
        wait_until(lambda: ctl.stats()["devices"] == ["honest"] or (
            honest.send_multipart(M.heartbeat()) and False), 15, "the unregistered identities expired", step_s=0.5)
        assert _fds(proc.pid) < 3 * 320 // 2
        log_text = (tmp_path / "emu.log").read_text()
        assert log_text.count("\n") < 200, "refusals are logged in aggregate"
    finally:
        stop.set()
        for s in attackers:
            s.close()
        try:
            ctl.stop()
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            ctl.close()
            if honest is not None:
                honest.close()
            edge.close()
            ctx.destroy(linger=0)
