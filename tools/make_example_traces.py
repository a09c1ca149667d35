"""Write the example traces shipped in testbed/profiles/traces/ (deterministic: same bytes on every run).

    python tools/make_example_traces.py [--out testbed/profiles/traces] [--check]

- ``example-ar1-6mbps.up``: a Mahimahi uplink trace, 20 s. The rate follows a first-order autoregressive
  process on its logarithm, sampled every 10 ms: ln r_{k+1} = m + rho (ln r_k - m) + s sqrt(1 - rho^2) z_k,
  with rho = exp(-10 ms / 0.5 s) (a 0.5 s coherence time), s = 0.5 and m such that the median is 6 Mbit/s,
  and a Markov fade state (entered with probability 0.4% per 10 ms, left with 5% per 10 ms: about 0.2 s
  fades every 2.5 s) that divides the rate by 10. Each millisecond adds r x 1 ms to a bit credit; every
  12,000 bits of credit (one 1500-byte packet) emit that millisecond as a delivery opportunity. The last
  line is 20000 so that mm-link (and the replay here) wraps after exactly 20 s.
- ``example-walk-30mbps.csv``: a downlink throughput trace ``time_s,mbps`` every 0.5 s for 60 s: a random
  walk in Mbit/s (steps of N(0, 2)) around 30 Mbit/s pulled back to it by 10% per step, clipped to
  [1, 80], with a handover dip to 2 Mbit/s from 31 s to 33 s.

Only ``random.Random(seed).random()`` is used (with a Box-Muller transform), whose sequence Python keeps
stable across versions, so ``--check`` can confirm that the shipped files are what this script writes.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "testbed" / "profiles" / "traces"
PACKET_BITS = 1500 * 8


def _normal(rng: random.Random) -> float:
    # Box-Muller from random() alone: reproducible bytes across Python versions.
    u1, u2 = rng.random(), rng.random()
    return math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)


def mahimahi_ar1(seed: int = 1, duration_s: float = 20.0, median_bps: float = 6e6, sigma: float = 0.5,
                 coherence_s: float = 0.5, step_s: float = 0.01) -> str:
    rng = random.Random(seed)
    rho = math.exp(-step_s / coherence_s)
    m = math.log(median_bps)
    x, fade, credit = m, False, 0.0
    lines: list[str] = []
    steps_ms = round(step_s * 1000)
    total_ms = round(duration_s * 1000)
    for k in range(0, total_ms, steps_ms):
        x = m + rho * (x - m) + sigma * math.sqrt(1 - rho * rho) * _normal(rng)
        fade = (rng.random() < 0.004) if not fade else (rng.random() >= 0.05)
        rate = math.exp(x) / (10.0 if fade else 1.0)
        for ms in range(k, k + steps_ms):
            credit += rate / 1000.0
            while credit >= PACKET_BITS:
                credit -= PACKET_BITS
                lines.append(str(ms))
    lines.append(str(total_ms))  # the period: mm-link wraps at the last timestamp
    return "\n".join(lines) + "\n"


def throughput_walk(seed: int = 2, duration_s: float = 60.0, step_s: float = 0.5, mean_mbps: float = 30.0) -> str:
    rng = random.Random(seed)
    v = mean_mbps
    rows = ["time_s,mbps"]
    for i in range(round(duration_s / step_s)):
        t = i * step_s
        v = min(80.0, max(1.0, v + 0.1 * (mean_mbps - v) + 2.0 * _normal(rng)))
        rows.append(f"{t:.1f},{2.0 if 31.0 <= t < 33.0 else v:.3f}")
    return "\n".join(rows) + "\n"


FILES = {"example-ar1-6mbps.up": mahimahi_ar1, "example-walk-30mbps.csv": throughput_walk}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="folder to write into")
    ap.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for name, make in FILES.items():
        text, path = make(), args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path} ({len(text.splitlines())} lines)")
    if stale:
        print(f"differ from what this script writes: {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
