"""One-shot measurement of a real link's rate, latency and jitter by size-swept ping-pong over TCP.

`multispin channel probe --serve tcp://0.0.0.0:PORT` runs the echo server on one end; `multispin channel
probe --connect tcp://HOST:PORT` measures from the other end and prints (and with ``--out`` saves) JSON.

Method. Every probe is one request/reply on one TCP connection (TCP_NODELAY), timed on the client's clock
alone, so no clocks are compared across hosts. A request carries ``n_up`` bytes and asks for ``n_down``
bytes back; its round trip is, for a link with rates r_up and r_down and a fixed cost a,

    RTT(n_up, n_down) = a + 8 n_up / r_up + 8 n_down / r_down.

- upload probes send s bytes and get a 1-byte reply: RTT(s) = a_up + 8 s / r_up, so the slope over s is
  1 / r_up;
- download probes send a header and ask for s bytes: RTT(s) = a_down + 8 s / r_down, slope 1 / r_down;
- a few tiny echoes give the latency (RTT percentiles) and the jitter (mean |RTT_i - RTT_i-1|, as RFC 3550
  smooths it, without the 1/16 filter).

For each direction the size grows (x2 to x16 per step) until one RTT reaches ``target_s``; then sizes from a
quarter of that to that are probed ``repeats`` times in shuffled order, and `fit_sweep` fits the line
through the per-size minimum RTTs (the minimum drops the queueing and scheduling noise, which only adds).
A token bucket in the path (tc tbf, a Wi-Fi aggregation burst) lets the first bytes through at line rate;
that shifts the intercept, not the slope, as long as every size exceeds the burst and the bucket refills
between probes (``gap_s``). The rate is what the application gets: the payload rate, below a shaper's
configured rate by the TCP/IP header share (1448 payload bytes in a 1514-byte frame on Ethernet: -4.4%).

Pure math (`fit_sweep`, `latency_stats`) is separate from the sockets (`ProbeServer`, `ProbeClient`,
`run_probe`), so it is unit-tested on synthetic round trips.
"""

from __future__ import annotations

import math
import random
import socket
import socketserver
import statistics
import struct
import time
from dataclasses import asdict, dataclass

from testbed.runtime.link_estimate import next_sweep_size

MAGIC = b"MSLP"
VERSION = 1
HEADER = struct.Struct("!4sBBQQ")  # magic, version, op, n_up, n_down
OP_PING = ord("P")
MAX_BYTES = 256 * 2 ** 20  # per request and direction: bounds the server's work for any client
CHUNK = 2 ** 20
_ZEROS = memoryview(bytes(CHUNK))


class ProbeError(RuntimeError):
    """The probe could not talk to the server (refused, timed out, closed, not a probe server)."""


# --- pure math ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SweepFit:
    """RTT(s) = intercept_s + 8 s / rate_bps fitted through the per-size minimum RTTs."""

    rate_bps: float | None  # None: no positive slope (the link is faster than these sizes can resolve)
    intercept_s: float
    slope_s_per_byte: float
    sizes_bytes: list[int]
    min_rtts_s: list[float]
    resid_rms_s: float
    r2: float
    n_samples: int

    def to_dict(self) -> dict:
        return asdict(self)


def fit_sweep(sizes_bytes, rtts_s) -> SweepFit:
    """Least-squares line through (size, min RTT at that size); needs at least two distinct sizes."""
    if len(sizes_bytes) != len(rtts_s):
        raise ValueError(f"fit_sweep: {len(sizes_bytes)} sizes but {len(rtts_s)} round trips")
    best: dict[int, float] = {}
    for s, r in zip(sizes_bytes, rtts_s):
        if not (math.isfinite(r) and r >= 0):
            raise ValueError(f"fit_sweep: round trip {r!r} s at {s} bytes; allowed: finite, >= 0")
        best[int(s)] = min(r, best.get(int(s), math.inf))
    if len(best) < 2:
        raise ValueError(f"fit_sweep: {len(best)} distinct size(s); a slope needs at least 2")
    xs = sorted(best)
    ys = [best[x] for x in xs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    resid = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    ss_res = sum(e * e for e in resid)
    ss_tot = sum((y - my) ** 2 for y in ys)
    return SweepFit(rate_bps=8.0 / slope if slope > 0 else None, intercept_s=intercept, slope_s_per_byte=slope,
                    sizes_bytes=xs, min_rtts_s=ys, resid_rms_s=math.sqrt(ss_res / len(xs)),
                    r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, n_samples=len(rtts_s))


def latency_stats(rtts_s) -> dict:
    """RTT percentiles and jitter (mean absolute difference of consecutive RTTs), in seconds."""
    r = list(rtts_s)
    if not r:
        raise ValueError("latency_stats: no round trips")
    srt = sorted(r)
    p95 = srt[min(len(srt) - 1, math.ceil(0.95 * len(srt)) - 1)]
    diffs = [abs(b - a) for a, b in zip(r, r[1:])]
    return {"n": len(r), "rtt_min_s": srt[0], "rtt_median_s": statistics.median(r), "rtt_p95_s": p95,
            "rtt_std_s": statistics.pstdev(r), "jitter_s": statistics.fmean(diffs) if diffs else 0.0}


def parse_endpoint(endpoint: str, *, any_port: bool = False) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (``[v6]`` hosts too) -> (host, port); ValueError naming what is allowed.
    ``any_port``: port 0 (the system picks a free one) is allowed, for a server."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint {endpoint!r} is invalid; allowed: tcp://HOST:PORT")
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    low = 0 if any_port else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) < 65536:
        raise ValueError(f"endpoint {endpoint!r} is invalid; allowed: tcp://HOST:PORT with a port {low}..65535")
    return host, int(port)


# --- the server ------------------------------------------------------------------------------------------

def _recv_exact(sock: socket.socket, n: int, buf: memoryview | None = None) -> bytes | None:
    """Receive n bytes (into buf when given, returning b''); None if the peer closed first."""
    out = bytearray() if buf is None else None
    got = 0
    while got < n:
        if buf is not None:
            k = sock.recv_into(buf[: min(len(buf), n - got)])
        else:
            chunk = sock.recv(n - got)
            k = len(chunk)
            out += chunk
        if k == 0:
            return None
        got += k
    return bytes(out) if out is not None else b""


def _send_zeros(sock: socket.socket, n: int) -> None:
    while n > 0:
        k = min(n, CHUNK)
        sock.sendall(_ZEROS[:k])
        n -= k


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sink = memoryview(bytearray(CHUNK))
        while True:
            head = _recv_exact(sock, HEADER.size)
            if head is None:
                return
            magic, version, op, n_up, n_down = HEADER.unpack(head)
            ours = magic == MAGIC and version == VERSION and op == OP_PING
            if not ours or n_up > MAX_BYTES or not 1 <= n_down <= MAX_BYTES:
                return  # not our protocol, or out of bounds: drop the connection, keep serving others
            if n_up and _recv_exact(sock, n_up, sink) is None:
                return
            _send_zeros(sock, n_down)


class ProbeServer(socketserver.ThreadingTCPServer):
    """The echo server: each request's ``n_up`` bytes are read and discarded, ``n_down`` zero bytes sent."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, endpoint: str):
        host, port = parse_endpoint(endpoint, any_port=True)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]


# --- the client ------------------------------------------------------------------------------------------

class ProbeClient:
    """One TCP connection to a probe server; `ping` returns one round trip in seconds."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0):
        host, port = parse_endpoint(endpoint)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ProbeError(f"cannot connect to {endpoint}: {exc.strerror or exc}; is "
                             f"`multispin channel probe --serve` running there?") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.endpoint = endpoint
        self._sink = memoryview(bytearray(CHUNK))
        self._payload = bytes(0)

    def ping(self, n_up: int, n_down: int = 1) -> float:
        if not (0 <= n_up <= MAX_BYTES and 1 <= n_down <= MAX_BYTES):
            raise ValueError(f"ping: n_up={n_up}, n_down={n_down}; allowed: 0..{MAX_BYTES} and 1..{MAX_BYTES}")
        if len(self._payload) < n_up:
            self._payload = bytes(n_up)  # allocated before the clock starts
        head = HEADER.pack(MAGIC, VERSION, OP_PING, n_up, n_down)
        try:
            t0 = time.perf_counter()
            if n_up <= 65536:  # one write: header and a small payload leave in the same segments
                self.sock.sendall(head + self._payload[:n_up])
            else:
                self.sock.sendall(head)
                self.sock.sendall(memoryview(self._payload)[:n_up])
            got = _recv_exact(self.sock, n_down, self._sink)
            t1 = time.perf_counter()
        except (OSError, TimeoutError) as exc:
            raise ProbeError(f"probe to {self.endpoint} failed: {exc}") from None
        if got is None:
            raise ProbeError(f"{self.endpoint} closed the connection (not a probe server, or it refused "
                             f"n_up={n_up}, n_down={n_down})")
        return t1 - t0

    def tcp_mss(self) -> int | None:
        try:
            return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
        except (OSError, AttributeError):
            return None

    def close(self) -> None:
        self.sock.close()


def sweep(ping, *, target_s: float, min_bytes: int, max_bytes: int, repeats: int, points: int, gap_s: float,
          deadline: float, rng: random.Random) -> tuple[list[int], list[float]]:
    """Grow the size until a round trip reaches ``target_s`` (or ``max_bytes``), then probe ``points`` sizes
    from a quarter of that size to it, ``repeats`` times each in shuffled order. ``ping(size) -> RTT``."""
    size = min_bytes
    while True:
        rtt = ping(size)
        time.sleep(gap_s)
        nxt = next_sweep_size(size, rtt, target_s, max_bytes)
        if nxt is None or time.monotonic() > deadline:
            break
        size = nxt
    top = size
    sizes = sorted({max(1, int(top * (0.25 + 0.75 * i / (points - 1)))) for i in range(points)})
    done_s: list[int] = []
    done_r: list[float] = []
    for _ in range(repeats):
        order = sizes[:]
        rng.shuffle(order)
        for s in order:
            if time.monotonic() > deadline and len(set(done_s)) >= 2:
                return done_s, done_r
            done_r.append(ping(s))
            done_s.append(s)
            time.sleep(gap_s)
    return done_s, done_r


def run_probe(endpoint: str, *, directions: tuple[str, ...] = ("up", "down"), target_s: float = 0.25,
              repeats: int = 3, points: int = 5, pings: int = 20, min_bytes: int = 16384,
              max_bytes: int = 64 * 2 ** 20, gap_s: float = 0.02, budget_s: float = 30.0, timeout_s: float = 10.0,
              seed: int = 0, progress=None) -> dict:
    """Measure latency, jitter and the rate of each direction; returns a JSON-ready dict."""
    if not 2 <= points <= 50 or repeats < 1 or pings < 2:
        raise ValueError(f"run_probe: points={points} (allowed 2..50), repeats={repeats} (>= 1), pings={pings} (>= 2)")
    if not (0 < target_s <= 60 and 1 <= min_bytes <= max_bytes <= MAX_BYTES):
        raise ValueError(f"run_probe: target_s={target_s} (allowed (0, 60]), min_bytes={min_bytes}, "
                         f"max_bytes={max_bytes} (allowed 1 <= min <= max <= {MAX_BYTES})")
    bad = sorted(set(directions) - {"up", "down"})
    if bad or not directions:
        raise ValueError(f"run_probe: directions={directions!r}; allowed: up, down")
    rng = random.Random(seed)
    start_wall, start = time.time(), time.monotonic()
    client = ProbeClient(endpoint, timeout_s)
    say = progress or (lambda msg: None)
    try:
        client.ping(0, 1)  # warm-up: connection set up, buffers allocated
        rtts = []
        for _ in range(pings):
            rtts.append(client.ping(0, 1))
            time.sleep(gap_s / 2)
        result = {"endpoint": endpoint, "started_unix_s": start_wall, "method": "size-swept ping-pong over TCP; "
                  "slope of the per-size minimum RTT (see channel_emulator/link_probe.py)",
                  "settings": {"target_s": target_s, "repeats": repeats, "points": points, "gap_s": gap_s,
                               "min_bytes": min_bytes, "max_bytes": max_bytes, "budget_s": budget_s},
                  "latency": latency_stats(rtts), "tcp_mss": client.tcp_mss()}
        say(f"latency: median RTT {1e3 * result['latency']['rtt_median_s']:.3f} ms, "
            f"jitter {1e3 * result['latency']['jitter_s']:.3f} ms")
        share = budget_s / len(directions)
        for d in directions:
            ping = (lambda s: client.ping(s, 1)) if d == "up" else (lambda s: client.ping(0, s))
            deadline = time.monotonic() + share
            sizes, rt = sweep(ping, target_s=target_s, min_bytes=min_bytes, max_bytes=max_bytes, repeats=repeats,
                              points=points, gap_s=gap_s, deadline=deadline, rng=rng)
            name = "uplink" if d == "up" else "downlink"
            try:
                fit = fit_sweep(sizes, rt)
                result[name] = {**fit.to_dict(), "rtts_s": rt, "all_sizes_bytes": sizes}
                rate = f"{fit.rate_bps / 1e6:.3f} Mbit/s" if fit.rate_bps else "not resolved (no positive slope)"
                say(f"{name}: {rate} (sizes {fit.sizes_bytes[0]}..{fit.sizes_bytes[-1]} bytes, r2 {fit.r2:.4f})")
            except ValueError as exc:
                result[name] = {"rate_bps": None, "error": str(exc), "rtts_s": rt, "all_sizes_bytes": sizes}
        result["duration_s"] = time.monotonic() - start
        return result
    finally:
        client.close()


def format_result(res: dict) -> str:
    """A few human-readable lines of a `run_probe` result."""
    lat = res["latency"]
    lines = [f"link probe {res['endpoint']} ({res.get('duration_s', 0):.1f} s)",
             f"  RTT min/median/p95: {1e3 * lat['rtt_min_s']:.3f} / {1e3 * lat['rtt_median_s']:.3f} / "
             f"{1e3 * lat['rtt_p95_s']:.3f} ms; jitter {1e3 * lat['jitter_s']:.3f} ms (n={lat['n']})"]
    for name in ("uplink", "downlink"):
        if name in res:
            r = res[name]
            if r.get("rate_bps"):
                lines.append(f"  {name}: {r['rate_bps'] / 1e6:.3f} Mbit/s (intercept {1e3 * r['intercept_s']:.2f} ms, "
                             f"r2 {r['r2']:.4f}, sizes {r['sizes_bytes'][0]}..{r['sizes_bytes'][-1]} B)")
            else:
                lines.append(f"  {name}: rate not resolved: {r.get('error', 'no positive slope')}")
    return "\n".join(lines)


def serve(endpoint: str, *, once: bool = False, ready=None) -> None:
    """Run the echo server until interrupted (``once``: until the first client disconnects)."""
    server = ProbeServer(endpoint)
    if ready:
        ready(server)
    try:
        if once:  # one client, served on this thread, then return
            request, addr = server.get_request()
            try:
                server.finish_request(request, addr)
            finally:
                server.shutdown_request(request)
        else:
            server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
