"""The payload validator's cost (testbed/wire/validate.py) next to the verification it guards, in one run.

N devices (default 4) each upload L (default 4) draft rows of the default pair (V = 4,096) at float16, padded
on the air to 151,936 entries (the emulation profile); the validator checks every device's rows as the edge
does (padding, entries, row sums, q at the drafted tokens: `WireRows.checked` + `check_drafted`, and
`from_wire` for float32). The verification is the batched target forward over the same N x L drafts.
`--measure` also prints the worst |row sum - 1| of the shipped pair's real draft rows at float16 and float32,
the numbers behind the tolerance.

  python tools/bench_validate.py [--pair DIR | --micro] [--devices 4] [--draft-len 4] [--measure]
"""

from __future__ import annotations

import argparse
import sys
import time

# tools/ is on sys.path when a script here runs; the testbed packages come from the installed project.
from bench_common import interleaved_medians
from bench_drafter import pick_pair


def measure_rows(paths, n_rows: int = 864) -> None:
    """Worst |sum - 1| of real draft rows cast to the wire precision, against the tolerance."""
    import numpy as np

    from device_node.drafter import OnnxDrafter
    from testbed.core.sampling import SamplingParams, to_probs, to_wire_precision
    from testbed.wire.validate import sum_tolerance

    dr = OnnxDrafter(paths.draft_onnx)
    v, rng = dr.vocab_size, np.random.default_rng(0)
    dev: dict[int, list[float]] = {16: [], 32: []}
    while len(dev[16]) < n_rows:
        params = SamplingParams(temperature=float(rng.choice([0.7, 1.0, 1.3])), top_k=0, top_p=1.0)
        dr.reset(list(map(int, rng.integers(1, v, 24))))
        for _ in range(12):
            d = dr.draft(4, params, rng)
            for lg in dr.last_logits:
                q = to_probs(lg.astype(np.float32), params)
                for b in dev:
                    dev[b].append(abs(to_wire_precision(q, b).astype(np.float64).sum() - 1))
            dr.commit(0, d.tokens[0])
    for b, dt in ((16, np.float16), (32, np.float32)):
        print(f"real rows at float{b}: worst |sum - 1| = {max(dev[b]):.3g} over {len(dev[b])} rows; "
              f"tolerance {sum_tolerance(v, dt):.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", help="pair directory (default: the cached default pair, else the micro pair)")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--on-air", type=int, default=151936, help="on-air width of the rows (0: none)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--measure", action="store_true", help="also the real rows' sum deviation (the tolerance)")
    args = ap.parse_args()

    import numpy as np
    import torch

    from edge_node.verifier import BatchedVerifier, load_target
    from testbed.core.sampling import exact_from_wire, to_wire_precision
    from testbed.wire import messages as M
    from testbed.wire import protocol as P
    from testbed.wire import validate

    torch.set_num_threads(args.threads)
    paths = pick_pair(args)
    model = load_target(paths.target_dir, device=args.device)
    v = BatchedVerifier(model, args.device)
    vocab, L, rng = v.vocab_size, args.draft_len, np.random.default_rng(0)
    on_air = args.on_air or None
    items, uploads = [], []
    for k in range(args.devices):
        name = f"dev{k}"
        v.open(name, list(map(int, rng.integers(1, vocab, [40, 120, 200, 80][k % 4]))))
        rows = {b: to_wire_precision(rng.dirichlet(np.full(vocab, 0.05), size=L), b) for b in (16, 32)}
        toks = np.array([rng.choice(vocab, p=r) for r in exact_from_wire(rows[16])])
        uploads.append(({b: P.to_wire(w, b, on_air) for b, w in rows.items()}, toks))
        items.append((name, [], list(map(int, toks))))
    sync = torch.cuda.synchronize if v.device.type == "cuda" else (lambda: None)

    def check16() -> float:
        t = time.perf_counter()
        for wire, toks in uploads:
            q = M.WireRows.checked(wire[16], vocab, name="draft.q")
            validate.check_drafted("draft.q", q.at(toks), toks)
        return time.perf_counter() - t

    def check32() -> float:
        t = time.perf_counter()
        for wire, toks in uploads:
            q = validate.from_wire(wire[32], vocab, name="draft.q")
            validate.check_drafted("draft.q", q[np.arange(L), toks], toks)
        return time.perf_counter() - t

    def verify() -> float:
        sync()
        t = time.perf_counter()
        v.verify(items)
        sync()
        dt = time.perf_counter() - t
        for name, _, _ in items:
            v.commit(name, 0)
        return dt

    verify(), verify(), check16(), check32()  # prefill the contexts, warm up
    c16, ver = interleaved_medians(check16, verify, args.repeats)
    c32, _ = interleaved_medians(check32, lambda: 0.0, args.repeats)
    print(f"target: {paths.target_dir} on {v.device}; V = {vocab}, on-air width {on_air or vocab}")
    print(f"{args.devices} devices x L = {L} draft rows each, median of {args.repeats}:")
    print(f"  validate, float16 (UL, WireRows)   {c16 * 1e6:9.1f} us   ratio to verify {c16 / ver:.4f}")
    print(f"  validate, float32 (UL, from_wire)  {c32 * 1e6:9.1f} us   ratio to verify {c32 / ver:.4f}")
    print(f"  verify (one batched forward)       {ver * 1e3:9.2f} ms")
    if args.measure:
        measure_rows(paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
