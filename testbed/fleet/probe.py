"""What `fleet check` learns on a host: run there as `python -c <this file's text> MODE REQUEST_JSON`, so it
imports nothing of the project at the top (the host may not have it yet) and only the standard library.

inspect: the fleet folder, sha256 of the named files, the public keys and names of the key bundles, and per endpoint a
  few timed TCP connects (reachability and a short link probe), as one JSON line.
project: the interpreter, and the project's and the wire protocol's versions as it imports them, and which
  of a device's modules it cannot import (run by the Python that will run the devices).
follow: the new lines of the named log files as "NAME<TAB>LINE", until stdin closes (the SSH channel ends).
clock: one line per line read: the host's time.time(), for the NTP-style exchange of `testbed.fleet.clock`.
  Tests plant a clock offset with MULTISPIN_TEST_CLOCK_SKEW_S (seconds added to the host's time); nothing
  but the test SSH server sets it.
"""

import hashlib
import importlib
import json
import os
import re
import socket
import sys
import time

DEVICE_MODULES = ("numpy", "zmq", "onnxruntime", "yaml", "pydantic", "device_node.node", "testbed.fleet.supervisor")
SKEW_ENV = "MULTISPIN_TEST_CLOCK_SKEW_S"


def sha256(path):
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") else \
                hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return "error: " + exc.strerror


def read_key(path):
    """(public key z85, metadata name) of a ZeroMQ certificate file; None if it is missing."""
    try:
        text = open(path).read()
    except OSError:
        return None
    key = re.search(r'public-key\s*=\s*"([^"]+)"', text)
    name = re.search(r'^\s*name\s*=\s*"([^"]*)"', text, re.M)
    return {"public": key.group(1) if key else None, "name": name.group(1) if name else None,
            "secret": os.path.exists(path + "_secret")}


def project():
    out = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        testbed = importlib.import_module("testbed")
        out["version"] = testbed.__version__
        out["protocol"] = importlib.import_module("testbed.wire.protocol").PROTOCOL_VERSION
    except Exception as exc:  # the host's Python has no (or a broken) project: reported, not raised
        out["error"] = f"{type(exc).__name__}: {exc}"
    missing = []
    for name in DEVICE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    out["missing"] = missing
    return out


def connects(host, port, n, wait_s=0.0, timeout_s=2.0):
    """n timed TCP connects; a refused first one is retried for up to wait_s (an edge still loading)."""
    times, error = [], None
    end = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            break
        except ConnectionRefusedError:
            if time.monotonic() >= end:
                break
            time.sleep(0.25)
        except OSError:
            break
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                times.append(time.perf_counter() - t0)
        except OSError as exc:
            error = exc.strerror or (f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError)
                                     else type(exc).__name__)
            break
    return {"connect_s": times, "error": error}


def inspect(req):
    root = os.path.abspath(os.path.expanduser(req["dir"]))
    at = lambda rel: os.path.join(root, rel)  # noqa: E731
    return {
        "dir": root,
        "files": {label: sha256(at(rel)) for label, rel in req.get("files", {}).items()},
        "keys": {dev: {"client": read_key(at(rel + "/client.key")), "server": read_key(at(rel + "/server.key"))}
                 for dev, rel in req.get("keys", {}).items()},
        "endpoints": {label: connects(h, p, req.get("probes", 5), req.get("wait_s", 0.0)) for label, (h, p) in
                      req.get("endpoints", {}).items()},
    }


def clock():
    skew = float(os.environ.get(SKEW_ENV) or 0.0)
    for _ in sys.stdin:
        sys.stdout.write(repr(time.time() + skew) + "\n")
        sys.stdout.flush()


def follow(files):
    """Stream the lines of {name: [path, offset]} from `offset` on; a file may appear later."""
    import select

    handles, partial = {}, {}
    while True:
        for name, (path, offset) in files.items():
            if name not in handles:
                try:
                    handles[name] = open(path, errors="replace")
                except FileNotFoundError:
                    continue
                handles[name].seek(offset)
                partial[name] = ""
            chunk = handles[name].read()
            if chunk:
                lines = (partial[name] + chunk).split("\n")
                partial[name] = lines.pop()
                for line in lines:
                    sys.stdout.write(f"{name}\t{line}\n")
                sys.stdout.flush()
        ready, _, _ = select.select([sys.stdin], [], [], 0.2)
        if ready and not sys.stdin.buffer.read1(4096):
            return


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "clock":
        clock()
    elif mode == "follow":
        follow(json.loads(sys.argv[2]))
    elif mode == "project":
        print(json.dumps(project()))
    else:
        print(json.dumps(inspect(json.loads(sys.argv[2]))))
