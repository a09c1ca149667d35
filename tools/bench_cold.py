"""How much slower this host runs a small step right after a pause than back to back.

    python tools/bench_cold.py [--pauses 0,0.5,2,5,10] [--samples 200] [--json]

A pass-through round of the testbed is a dozen small steps on two processes besides drafting and verifying
(encode, send, decode, check; docs/performance.md), each run once after its process spent milliseconds on
something else (drafting, the forward pass, a busy-wait). On a shared virtual machine the caches and TLB a
step needs are partly gone by then, so it can take several times its back-to-back time; the in-process loop
has fewer such steps. This tool runs the testbed's own message steps of one round (L = 4, V = 4096, float16 q
rows, as the default pair's `tools/bench_overhead.py` round), each after a pause spent spinning (as a
busy-polling node waits, with no system call that could explain it), against the same step repeated at once:

  verdict encode   edge: the verdict with the next round's schedule inside (`messages.verdict`)
  verdict send     edge: its ROUTER send to a DEALER in another process (ipc), as every send below
  verdict parse    device: decode, `parse_verdict`, the schedule inside (`schedule_in`, `parse_schedule`)
  report send      device: the report encoded and sent
  draft encode     device: the draft upload encoded (`messages.draft`)
  draft send       device: its 32 KB sent
  draft parse      edge: decode and `parse_draft` (the q rows' checks)

Prints each step's median time for the first call after each pause, back to back, and their sum over the
round (the ZeroMQ trips between the processes are not in it). `tools/bench_overhead.py` prints the ratio of
the median step at 5 ms.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STEPS = ("verdict encode", "verdict send", "verdict parse", "report send", "draft encode", "draft send",
         "draft parse")

# The other process: a DEALER that takes the edge-side sends, a ROUTER that takes the device-side ones;
# both drained in a busy-poll, as a node with a core of its own waits.
_PEER = """
import os, sys, time, zmq
ctx = zmq.Context()
dealer, router = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
dealer.setsockopt(zmq.IDENTITY, b"peer")
router.bind(sys.argv[2])
dealer.connect(sys.argv[1])
dealer.send(b"hello")
poller = zmq.Poller()
poller.register(dealer, zmq.POLLIN)
poller.register(router, zmq.POLLIN)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    ready = dict(poller.poll(0))
    if router in ready:
        router.recv_multipart()
    if dealer in ready and dealer.recv_multipart()[0] == b"bye":
        break
    if not ready:
        os.sched_yield()
"""


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def round_steps(router, dealer, ident: bytes) -> dict:
    """name -> a call doing that step of a round, on this pair's sizes (see the module's docstring)."""
    from testbed.wire import messages as M
    from testbed.wire import protocol as P

    L, V = 4, 4096
    rng = np.random.default_rng(0)
    q = rng.random((L, V))
    wire = (q / q.sum(axis=1, keepdims=True)).astype(np.float16)
    tokens = [int(np.argmax(row)) for row in wire]
    timings = {"draft_s": 0.003, "compute_s": 0.003, "emulated_extra_s": 0.0, "compute_scale": 1.0}
    nxt = M.schedule_fields(13, "UL", L, 0.2, 10.0, 1.5)

    def draft_frames():
        return M.draft(12, "UL", tokens, None, q_wire=wire, last_token=5, bits_per_prob=16, on_air_vocab=None,
                       timings=timings)

    def verdict_frames():
        return M.verdict(12, 3, 55, next_schedule=nxt)

    verdict_in = [bytes(f) for f in verdict_frames()]
    draft_in = [bytes(f) for f in draft_frames()]

    def verdict_parse():
        header, arrays = P.decode(verdict_in)
        M.parse_verdict(header, arrays, draft_len=L, vocab_size=V, bits_per_prob=16, on_air_vocab=None)
        M.parse_schedule(M.schedule_in(header), 8, V)  # schedule_in gives it its type

    def draft_parse():
        header, arrays = P.decode(draft_in)
        M.parse_draft(header, arrays, mode="UL", draft_len=L, vocab_size=V, bits_per_prob=16, on_air_vocab=None)

    return {"verdict encode": verdict_frames,
            "verdict send": lambda: router.send_multipart([ident, *verdict_in], copy=False),
            "verdict parse": verdict_parse,
            "report send": lambda: dealer.send_multipart(M.report(12, 55, 3, {"correction_s": 1e-5}, None)),
            "draft encode": draft_frames,
            "draft send": lambda: dealer.send_multipart(draft_in, copy=False),
            "draft parse": draft_parse}


def measure(pauses_ms: list[float], samples: int, peer_seconds: float = 120.0) -> dict:
    """{step: {pause_ms: (first-call median s, back-to-back median s)}}."""
    import zmq

    folder = tempfile.mkdtemp(prefix="ms-bench-cold-")
    to_peer, from_here = (f"ipc://{Path(folder) / name}" for name in ("edge.sock", "device.sock"))
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(to_peer)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, to_peer, from_here, str(peer_seconds)])
    try:
        if not router.poll(30_000):
            raise RuntimeError("the ZeroMQ peer process did not connect within 30 s")
        ident, _ = router.recv_multipart()
        dealer.connect(from_here)  # the peer bound it before it said hello
        steps = round_steps(router, dealer, ident)
        out: dict = {name: {} for name in steps}
        for pause in pauses_ms:
            firsts: dict = {name: [] for name in steps}
            seconds: dict = {name: [] for name in steps}
            for _ in range(samples):
                for name, step in steps.items():  # each step after its own pause
                    _spin(pause / 1000)
                    t0 = time.perf_counter()
                    step()
                    t1 = time.perf_counter()
                    step()
                    firsts[name].append(t1 - t0)
                    seconds[name].append(time.perf_counter() - t1)
            for name in steps:
                out[name][pause] = (float(np.median(firsts[name])), float(np.median(seconds[name])))
        router.send_multipart([ident, b"bye"])
        peer.wait(timeout=10)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        for sock in (router, dealer):
            sock.close(linger=0)
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def cold_ratio(result: dict, pause_ms: float) -> float:
    """The median over the steps of first-call / back-to-back time after `pause_ms`."""
    return float(np.median([result[name][pause_ms][0] / result[name][pause_ms][1] for name in result]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pauses", default="0,0.5,2,5,10", help="pauses before the first call, ms (comma-separated)")
    ap.add_argument("--samples", type=int, default=200, help="first calls per pause and step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        pauses = [float(p) for p in args.pauses.split(",")]
    except ValueError:
        ap.error(f"--pauses: {args.pauses!r} is not a comma-separated list of numbers")
    if any(p < 0 for p in pauses) or args.samples < 1:
        ap.error("--pauses must be >= 0 and --samples >= 1")
    result = measure(pauses, args.samples)
    if args.json:
        print(json.dumps({name: {str(p): {"first_s": f, "back_to_back_s": b} for p, (f, b) in by.items()}
                          for name, by in result.items()}, indent=2))
        return 0
    print(f"a round's message steps: the first call after a spinning pause / back to back (medians of "
          f"{args.samples}), us")
    print("  step            " + "".join(f"{f'{p:g} ms':>22s}" for p in pauses))
    for name in STEPS:
        print(f"  {name:15s} " + "".join(f"{1e6 * result[name][p][0]:8.0f} /{1e6 * result[name][p][1]:5.0f} "
                                        f"{result[name][p][0] / result[name][p][1]:4.1f}x" for p in pauses))
    totals = [(sum(result[n][p][0] for n in STEPS), sum(result[n][p][1] for n in STEPS)) for p in pauses]
    print(f"  {'round (sum)':15s} " + "".join(f"{1e6 * f:8.0f} /{1e6 * b:5.0f} {f / b:4.1f}x" for f, b in totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
