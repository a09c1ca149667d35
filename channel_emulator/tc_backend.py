"""Optional kernel shaping of a LAN interface (Linux tc): a device's rate with tbf or htb.

This is an alternative to the emulator's hold for LAN deployments. It is not an accurate bits/rate model
(see TC_BACKEND.md for its measured accuracy): small messages pass in the token bucket's burst, large ones
pay TCP/IP header overhead. Delay (netem) is refused with a clear message when the kernel has no netem
qdisc, as on this testbed's kernel: use the emulator's ``base_latency_s`` instead.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import uuid

QDISCS = ("tbf", "htb")


class TcUnavailable(RuntimeError):
    """The kernel or the host cannot provide the requested shaping."""


def _run(cmd: list[str], netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TcUnavailable(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netem_available() -> tuple[bool, str]:
    """Probe for netem by adding it to the loopback of a throwaway network namespace (never the host's)."""
    if shutil.which("tc") is None or shutil.which("ip") is None:
        return False, "the `tc` and `ip` tools are not installed"
    ns = f"ms-netem-probe-{uuid.uuid4().hex[:8]}"
    made = _run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        return False, f"cannot create a network namespace to probe netem: {made.stderr.strip()}"
    try:
        _run(["ip", "link", "set", "lo", "up"], netns=ns, check=False)
        probe = _run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], netns=ns, check=False)
        if probe.returncode == 0:
            return True, "netem available"
        return False, f"this kernel has no netem qdisc (tc says: {probe.stderr.strip() or probe.returncode})"
    finally:
        _run(["ip", "netns", "del", ns], check=False)


class TcShaper:
    """Shape egress of one interface (optionally inside a network namespace) to a rate."""

    def __init__(self, interface: str, netns: str | None = None, qdisc: str = "tbf"):
        if qdisc not in QDISCS:
            raise ValueError(f"qdisc={qdisc!r} is invalid; allowed: {', '.join(QDISCS)}")
        if shutil.which("tc") is None:
            raise TcUnavailable("the `tc` tool (iproute2) is not installed; the tc backend is unavailable")
        self.interface, self.netns, self.qdisc = interface, netns, qdisc

    def set_rate(self, rate_bps: float, burst_bytes: int | None = None, latency_s: float = 0.05) -> list[str]:
        """Replace the root qdisc with a rate limit; returns the tc command that was run."""
        if not (math.isfinite(rate_bps) and rate_bps > 0):
            raise ValueError(f"rate_bps={rate_bps!r} is invalid; allowed: a finite rate in bit/s > 0")
        rate = f"{int(round(rate_bps))}bit"
        # The bucket must hold at least one MTU-sized packet plus what the timer granularity lets through.
        burst = int(burst_bytes or max(3200, rate_bps / 8 / 250))
        if self.qdisc == "tbf":
            cmd = ["tc", "qdisc", "replace", "dev", self.interface, "root", "tbf", "rate", rate,
                   "burst", str(burst), "latency", f"{int(latency_s * 1000)}ms"]
            _run(cmd, self.netns)
            return cmd
        self.clear()
        _run(["tc", "qdisc", "add", "dev", self.interface, "root", "handle", "1:", "htb", "default", "10"],
             self.netns)
        cmd = ["tc", "class", "add", "dev", self.interface, "parent", "1:", "classid", "1:10", "htb",
               "rate", rate, "ceil", rate, "burst", str(burst)]
        _run(cmd, self.netns)
        return cmd

    def set_delay(self, delay_s: float) -> None:
        ok, why = netem_available()
        if not ok:
            raise TcUnavailable(f"kernel delay emulation (netem) is unavailable: {why}; "
                                "use the channel emulator's base_latency_s instead")
        _run(["tc", "qdisc", "replace", "dev", self.interface, "root", "netem", "delay",
              f"{delay_s * 1000:.3f}ms"], self.netns)

    def clear(self) -> None:
        _run(["tc", "qdisc", "del", "dev", self.interface, "root"], self.netns, check=False)

    def show(self) -> str:
        return (_run(["tc", "qdisc", "show", "dev", self.interface], self.netns).stdout
                + _run(["tc", "class", "show", "dev", self.interface], self.netns).stdout)


_RECEIVER = """
import json, sys, time, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind(sys.argv[1])
while True:
    ident, *frames = s.recv_multipart()
    t = time.monotonic()
    if frames[0] == b"stop":
        break
    s.send_multipart([ident, json.dumps({"t_recv": t, "bytes": sum(len(f) for f in frames)}).encode()])
"""

_SENDER = """
import json, sys, time, zmq
ep, sizes, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.connect(ep)
s.send(b"warmup"); s.recv()
out = []
for size in sizes:
    payload = bytes(size)
    for _ in range(repeats):
        time.sleep(0.05)  # let the token bucket refill, as between rounds
        t0 = time.monotonic(); s.send(payload); reply = json.loads(s.recv())
        out.append({"size": size, "achieved_s": reply["t_recv"] - t0})
print(json.dumps(out))
"""


def measure_accuracy(rates=(1e6, 10e6, 100e6), sizes=(1_000, 10_000, 100_000, 1_000_000), repeats: int = 3,
                     qdisc: str = "tbf", max_modeled_s: float = 3.0) -> list[dict]:
    """tc shaping against bits/rate for pyzmq over TCP across a veth pair (two namespaces on this host).

    The sender's egress is shaped; achieved = receiver's arrival - sender's send, both read from this host's
    one monotonic clock (valid only because both namespaces share it; this is a measurement, not the
    emulator, which never compares clocks)."""
    import json
    import sys

    from channel_emulator.netns import VethPair

    rows = []
    with VethPair.create() as veth:
        ep = f"tcp://{veth.addr_a}:5700"
        recv = subprocess.Popen(veth.exec_args(veth.ns_a, sys.executable, "-c", _RECEIVER, ep),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            shaper = TcShaper(veth.if_b, netns=veth.ns_b, qdisc=qdisc)
            for rate in rates:
                todo = [s for s in sizes if 8 * s / rate <= max_modeled_s]
                if not todo:
                    continue
                shaper.set_rate(rate)
                out = subprocess.run(veth.exec_args(veth.ns_b, sys.executable, "-c", _SENDER, ep, json.dumps(todo),
                                                    str(repeats)), capture_output=True, text=True, timeout=300)
                if out.returncode != 0:
                    raise RuntimeError(f"tc measurement sender failed: {out.stderr.strip()}")
                samples = json.loads(out.stdout)
                for size in todo:
                    got = sorted(x["achieved_s"] for x in samples if x["size"] == size)
                    modeled = 8 * size / rate
                    med = got[len(got) // 2]
                    rows.append({"qdisc": qdisc, "rate_bps": rate, "size_bytes": size, "modeled_s": modeled,
                                 "achieved_median_s": med, "median_error": med / modeled - 1})
            shaper.clear()
            stop = subprocess.run(veth.exec_args(veth.ns_b, sys.executable, "-c",
                                                 "import sys,zmq; s=zmq.Context().socket(zmq.DEALER); "
                                                 "s.connect(sys.argv[1]); s.send(b'stop'); s.close(linger=1000)", ep),
                                  capture_output=True, timeout=30)
            del stop
            recv.wait(timeout=10)
        finally:
            if recv.poll() is None:
                recv.kill()  # started here: ended by its handle
                recv.wait()
    return rows


if __name__ == "__main__":
    ok, why = netem_available()
    print(f"netem: {why}")
    for q in QDISCS:
        for r in measure_accuracy(qdisc=q):
            print(f"{r['qdisc']} {r['rate_bps'] / 1e6:>6g} Mbit/s {r['size_bytes']:>8} B"
                  f"  modeled {r['modeled_s']:.4g} s  achieved {r['achieved_median_s']:.4g} s"
                  f"  error {100 * r['median_error']:+.1f}%")
