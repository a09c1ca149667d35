"""Flood recovery (issue 35): rounds/s before, during and after a flood, and the edge's memory growth.

A live run of the micro pair on loopback TCP (`multispin run`, channel emulator in `real` mode, two honest device
processes d0 and d1). Phases, each timed on this clock while rounds.jsonl's lines are counted every 0.1 s:

1. baseline: rounds/s over `--baseline-s` after a warm-up;
2. flood: `--messages` malformed or hostile messages at the edge's ROUTER, as many at the emulator's frontend
   (many identities, bursts), then a hostile *registered* device d2 for `--hostile-s`: it registers, answers every
   schedule with a draft whose distributions are not distributions (refused by the edge's validation), and
   registers again whenever its session is ended for it;
3. after: the first moment from the flood's end at which rounds/s over a 2 s window is back to >= 90% of the
   baseline (`recovery_s`, target <= 10 s), rounds/s over the 10 s after the end, and the edge's (the run
   process's) RSS growth from the end of the baseline to 10 s after the flood (target < 10 MB).

Prints one JSON object. Usage: `python tools/bench_flood.py [--pair DIR] [--hostile-s 60]`."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.wire import messages as M  # noqa: E402
from testbed.wire import protocol as P  # noqa: E402

RECOVERED = 0.9  # of the baseline's rounds/s
WINDOW_S = 2.0   # rounds/s over this window, for the recovery


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def micro_pair(root: Path):
    from model_pairs.model_pair import MICRO_CONFIG, PairPaths, build_pair

    paths = PairPaths.under(root)
    return paths if paths.manifest.is_file() else build_pair(MICRO_CONFIG, root, progress=False)


def profile(pair, endpoints: dict) -> dict:
    devices = [{"name": f"d{i}", "distance_m": 100 + 150 * i, "draft_time_s": 0.001, "acceptance": 0.6}
               for i in range(3)]
    return {"name": "flood", "rounds": 10_000_000, "seed": 7, "deadline_s": 3.0, "max_misses": 2,
            "prompts": ["def parse(text):", "import os", "class A:"], "start_devices": False,
            "wait_for_devices_s": 10, "channel": {"mode": "real"}, "endpoints": endpoints,
            # Requests of 32 tokens, each a fresh session: the edge's KV caches and the verification's cost stay
            # level (one endless generation grows both with every round, which no flood is to blame for).
            "requests": {"arrival": "closed", "count": 5000, "max_new_tokens": 32},
            "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                      "tokenizer": str(pair.tokenizer)},
            "scenario": {"bits_per_prob": 16, "max_draft_len": 4, "uplink_bandwidth_hz": 2e6,
                         "downlink_bandwidth_hz": 3e6, "downlink_power_w": 1.0, "devices": devices}}


class Sampler:
    """(time, rounds recorded, edge RSS in kB) every 0.1 s."""

    def __init__(self, runs: Path, pid: int):
        self.runs, self.pid, self.samples, self.stop = runs, pid, [], threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def rounds(self) -> int:
        files = list(self.runs.glob("*/rounds.jsonl"))
        return files[0].read_bytes().count(b"\n") if files else 0

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                self.samples.append((time.monotonic(), self.rounds(), self.rss_kb()))
            except OSError:
                return

    def rate(self, t0: float, t1: float) -> float:
        """Rounds/s between t0 and t1 (the samples nearest inside)."""
        inside = [(t, n) for t, n, _ in self.samples if t0 <= t <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return 0.0
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def index_at(self, t: float) -> int:
        return min(self.samples, key=lambda s: abs(s[0] - t))[1]

    def verify_median_ms(self, t0: float, t1: float) -> float | None:
        """Median verification time of the rounds recorded between t0 and t1: the edge's own compute, which no
        flood touches; when it moves, the host's other load moved (a shared host)."""
        files = list(self.runs.glob("*/rounds.jsonl"))
        lines = files[0].read_text().splitlines()[self.index_at(t0):self.index_at(t1)] if files else []
        v = [json.loads(x)["measured"].get("verify_s") for x in lines]
        v = [x for x in v if x is not None]
        return 1e3 * float(np.median(v)) if v else None

    def rss_at(self, t: float) -> int:
        return min(self.samples, key=lambda s: abs(s[0] - t))[2]


def hostile_message(rng: random.Random) -> list[bytes]:
    """One malformed or forged message (the shapes of tests/system/test_hostile_lan.py)."""
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:
        return [b'{"v": 1, "type": "draft", "round": NaN}']
    if kind == 2:
        return [b'{"v": 1, "type": "x", "a": ' + b"[" * 2000 + b"]" * 2000 + b"}"]
    if kind == 3:
        return M.register(rng.choice(["intruder", "x" * 300]), rng.randrange(-5, 10**6), {})
    if kind == 4:
        hdr = {"type": "draft", "round": rng.randrange(0, 5), "arrays": [["q", "float32", [2**32, 2**32]]]}
        return [P.encode_header(hdr), b"\x00" * 16]
    return [P.encode_header({"type": rng.choice(["schedule", "verdict", "bye", "heartbeat"]),
                             "round": rng.randrange(-3, 3)})]


def flood(endpoint: str, n: int, seed: int, identities: int = 50) -> None:
    """`n` hostile messages to `endpoint` from `identities` peers, in bursts of 500."""
    rng, ctx = random.Random(seed), zmq.Context()
    try:
        socks = []
        for i in range(identities):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.ROUTING_ID, f"flood{seed}-{i}".encode())
            s.connect(endpoint)
            socks.append(s)
        for k in range(n):
            rng.choice(socks).send_multipart(hostile_message(rng))
            if k % 500 == 499:
                time.sleep(0.01)
        time.sleep(0.5)  # the queues drain before the sockets go
    finally:
        ctx.destroy(linger=0)


def hostile_device(endpoint: str, vocab: int, seconds: float) -> dict:
    """d2, registered, for `seconds`: every schedule answered with an unnormalised draft (UL mode: refused by the
    edge's validation; DL mode carries only q at the drafted tokens, which pass) and no verdict ever reported, so
    rounds wait for its report up to the deadline; registers again whenever it is told its session ended, or has
    heard nothing for 2 s (a session ended without a bye). Returns what it counted."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"d2")
    sock.connect(endpoint)
    counts = {"registered": 0, "drafts": 0, "refusals": 0}
    last_token, end, reg_at, heard = None, time.monotonic() + seconds, 0.0, time.monotonic()
    try:
        while time.monotonic() < end:
            if last_token is None and time.monotonic() - reg_at > 0.5:
                sock.send_multipart(M.register("d2", vocab, {"name": "hostile"}))
                reg_at = time.monotonic()
            if last_token is not None and time.monotonic() - heard > 2.0:
                last_token = None  # its session ended without a word: register again
            if not sock.poll(100):
                continue
            header, arrays = P.decode(sock.recv_multipart())
            kind = header.get("type")
            if kind != P.HEARTBEAT:
                heard = time.monotonic()
            if kind == P.REGISTERED:
                counts["registered"] += 1
                last_token = int(M.parse_registered(header, arrays).prompt_ids[-1])
            elif kind == P.SCHEDULE and last_token is not None:
                L = int(header.get("draft_len", 1))
                q = np.full((L, vocab), 2.0 / vocab)  # sums to 2: not a distribution
                frames = M.draft(int(header["round"]), header.get("mode", "UL"), np.zeros(L, np.int32), q,
                                 q_wire=q.astype(np.float16), last_token=last_token, bits_per_prob=16,
                                 on_air_vocab=None, timings={"draft_s": 0.001, "compute_s": 0.001})
                sock.send_multipart(frames)
                counts["drafts"] += 1
            elif kind == P.ERROR:
                counts["refusals"] += 1
                if "register" in json.dumps(header):
                    last_token = None
            elif kind == P.BYE:
                last_token = None
    finally:
        ctx.destroy(linger=0)
    return counts


def start_device(front: str, name: str, pair, logs: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "device_node.node", "--connect", front, "--name", name,
                             "--draft", str(pair.draft_onnx), "--register-timeout", "120"], cwd=ROOT,
                            stdout=open(logs / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise SystemExit(f"bench_flood: {what}: not within {timeout_s:g} s")
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=Path(tempfile.gettempdir()) / "multispin-bench-micro-pair")
    ap.add_argument("--messages", type=int, default=10_000, help="malformed messages at each of edge, frontend")
    ap.add_argument("--hostile-s", type=float, default=60.0, help="seconds of the hostile registered device")
    ap.add_argument("--baseline-s", type=float, default=10.0)
    ap.add_argument("--after-s", type=float, default=15.0)
    ap.add_argument("--control", action="store_true",
                    help="send nothing hostile (the hostile phase is a wait of --hostile-s): the run's own memory "
                         "growth and rounds/s over the same phases, to set beside a flood's")
    args = ap.parse_args()
    pair = micro_pair(args.pair)
    work = Path(tempfile.mkdtemp(prefix="bench-flood-"))
    edge, front, ctl = (f"tcp://127.0.0.1:{p}" for p in free_ports(3))
    prof = work / "p.yaml"
    prof.write_text(yaml.safe_dump(profile(pair, {"edge_bind": edge, "channel_frontend": front,
                                                  "channel_control": ctl})))
    runs = work / "runs"
    run = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", str(prof), "--runs-dir", str(runs),
                            "--quiet", "--no-plots"], cwd=ROOT, stdout=open(work / "run.log", "wb"),
                           stderr=subprocess.STDOUT)
    devices = [start_device(front, n, pair, work) for n in ("d0", "d1")]
    sampler = Sampler(runs, run.pid)
    out: dict = {"work_dir": str(work)}
    try:
        wait_for(lambda: sampler.rounds() >= 20, 180, "20 rounds")
        t_b0 = time.monotonic() + 3.0  # a warm-up first
        time.sleep(3.0 + args.baseline_s)
        t_b1 = time.monotonic()
        baseline = sampler.rate(t_b0, t_b1)
        rss0 = sampler.rss_at(t_b1)
        t_f0 = time.monotonic()
        if not args.control:
            flood(edge, args.messages, seed=1)
        during_edge = sampler.rate(t_f0, time.monotonic())
        t_f1 = time.monotonic()
        if not args.control:
            flood(front, args.messages, seed=2)
        during_front = sampler.rate(t_f1, time.monotonic())
        t_h0 = time.monotonic()
        if args.control:
            time.sleep(args.hostile_s)
            hostile = None
        else:
            hostile = hostile_device(front, 320, args.hostile_s)
        t_end = time.monotonic()
        during_hostile = sampler.rate(t_h0, t_end)
        time.sleep(args.after_s)
        recovery = None
        for k in range(int((args.after_s - WINDOW_S) / 0.1) + 1):
            t = t_end + 0.1 * k
            if sampler.rate(t, t + WINDOW_S) >= RECOVERED * baseline:
                recovery = t - t_end
                break
        rss1 = sampler.rss_at(t_end + 10.0)
        out.update({
            "baseline_rounds_per_s": baseline, "during_edge_flood": during_edge,
            "during_frontend_flood": during_front, "during_hostile_device": during_hostile,
            "after_10_s_rounds_per_s": sampler.rate(t_end, t_end + 10.0),
            "after_10_s_ratio": sampler.rate(t_end, t_end + 10.0) / baseline if baseline else None,
            "verify_median_ms": {"baseline": sampler.verify_median_ms(t_b0, t_b1),
                                 "after_10_s": sampler.verify_median_ms(t_end, t_end + 10.0)},
            "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
            "recovery_s": recovery, "recovered_within_10_s": recovery is not None and recovery <= 10.0,
            "edge_rss_mb": {"baseline": rss0 / 1024, "after": rss1 / 1024, "growth": (rss1 - rss0) / 1024,
                            "after_edge_flood": sampler.rss_at(t_f1) / 1024,
                            "after_frontend_flood": sampler.rss_at(t_h0) / 1024,
                            "after_hostile_device": sampler.rss_at(t_end) / 1024},
            "control": args.control, "messages": 0 if args.control else args.messages, "hostile_s": args.hostile_s,
            "hostile_device": hostile,
        })
    finally:
        sampler.stop.set()
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            try:
                run.wait(60)
            except subprocess.TimeoutExpired:
                run.kill()
        for d in devices:
            if d.poll() is None:
                d.terminate()
                d.wait(10)
    summary = next(runs.glob("*/summary.json"), None)
    if summary is not None:
        s = json.loads(summary.read_text())
        out["refused_messages"] = s.get("refused_messages")
        out["refusals"] = s.get("refusals")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
