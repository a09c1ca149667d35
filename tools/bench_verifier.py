"""Batched verification against one pass per device, measured side by side in one run.

N devices (default 4) with different context and draft lengths; the batched path verifies all drafts in
one forward; the per-device path calls verify once per device. Each measurement commits 0 drafts, which
leaves every cache as it was, so the repeats see identical states.

  python tools/bench_verifier.py [--pair DIR | --micro | --target HF_DIR] [--devices 4] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time

# tools/ is on sys.path when a script here runs; the testbed packages come from the installed project.
from bench_common import interleaved_medians
from bench_drafter import pick_pair


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", help="pair directory (default: the cached default pair, else the micro pair)")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--target", help="a target HF directory or GGUF file instead of a pair")
    ap.add_argument("--random", metavar="H,LAYERS,HEADS,FF,VOCAB",
                    help="a random-weight Llama target of this shape instead (e.g. 896,24,14,4864,151936)")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (more oversubscribes a busy host)")
    ap.add_argument("--compare-dtype", metavar="DTYPE",
                    help="also load the target in DTYPE (e.g. bfloat16) and time its batched forward against "
                         "--dtype's, interleaved; prints the ratio and how often the two agree on the top token")
    args = ap.parse_args()

    import numpy as np
    import torch

    from edge_node.verifier import BatchedVerifier, load_target

    torch.set_num_threads(args.threads)
    if args.random:
        from model_pairs.checkpoints import _torch_dtype
        from model_pairs.training import ModelShape, make_model

        h, layers, heads, ff, vocab = (int(x) for x in args.random.split(","))
        path = f"random Llama {args.random}"
        model = make_model(ModelShape(h, layers, heads, ff), vocab, 4096, seed=0)
        model = model.to(device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                          dtype=_torch_dtype(args.dtype, "")).eval()
    else:
        path = args.target or pick_pair(args).target_dir
        model = load_target(path, device=args.device, dtype=args.dtype)
    v = BatchedVerifier(model, args.device)
    rng = np.random.default_rng(0)
    vocab = v.vocab_size
    items, prompts = [], {}
    for k in range(args.devices):
        ctx_len = [40, 120, 200, 80, 160, 60, 240, 100][k % 8]
        L = [2, 4, 6, 3, 5, 8, 1, 7][k % 8]
        name = f"dev{k}"
        prompts[name] = list(map(int, rng.integers(1, vocab, ctx_len)))
        v.open(name, prompts[name])
        items.append((name, [], list(map(int, rng.integers(1, vocab, L)))))
    sync = torch.cuda.synchronize if v.device.type == "cuda" else (lambda: None)

    def batched() -> float:
        sync()
        t = time.perf_counter()
        v.verify(items)
        sync()
        dt = time.perf_counter() - t
        for name, _, _ in items:
            v.commit(name, 0)
        return dt

    def per_device() -> float:
        sync()
        t = time.perf_counter()
        for it in items:
            v.verify([it])
        sync()
        dt = time.perf_counter() - t
        for name, _, _ in items:
            v.commit(name, 0)
        return dt

    batched(), per_device()  # the first calls prefill the contexts and warm up
    batched(), per_device()
    mb, ms = interleaved_medians(batched, per_device, args.repeats)
    print(f"target: {path} on {v.device} ({next(model.parameters()).dtype})")
    print(f"{args.devices} devices, contexts {[v.context_length(n) for n, _, _ in items]}, "
          f"draft lengths {[len(d) for _, _, d in items]}, median of {args.repeats}:")
    print(f"  one batched forward   {mb * 1e3:8.2f} ms")
    print(f"  one forward per device {ms * 1e3:7.2f} ms")
    print(f"  ratio per-device/batched = {ms / mb:.2f}")
    if args.compare_dtype:
        compare_dtype(args, path, v, items, prompts, batched)
    return 0


def compare_dtype(args, path, v, items, prompts, batched) -> None:
    """The same batched forward on a second copy of the target in `--compare-dtype`, timed interleaved with
    the first; top-1 agreement over every verified row (a lower precision is another target: lossless
    against itself, not against float32)."""
    import numpy as np
    import torch

    from edge_node.verifier import BatchedVerifier, load_target

    other = BatchedVerifier(load_target(path, device=args.device, dtype=args.compare_dtype), args.device)
    for name, prompt in prompts.items():
        other.open(name, prompt)

    sync = torch.cuda.synchronize if other.device.type == "cuda" else (lambda: None)

    def batched_other() -> float:
        sync()
        t = time.perf_counter()
        other.verify(items)
        sync()
        dt = time.perf_counter() - t
        for name, _, _ in items:
            other.commit(name, 0)
        return dt

    batched_other(), batched_other()  # prefill and warm-up
    first, second = interleaved_medians(batched, batched_other, args.repeats)
    a, b = v.verify(items), other.verify(items)
    for name, _, _ in items:
        v.commit(name, 0)
        other.commit(name, 0)
    agree = np.mean(np.concatenate([x.argmax(-1) == y.argmax(-1) for x, y in zip(a, b)]))
    print(f"  {args.dtype or 'float32'} batched {first * 1e3:8.2f} ms, {args.compare_dtype} {second * 1e3:8.2f} ms: "
          f"ratio {first / second:.2f}; top-1 agreement {agree:.3f} over {sum(len(x) for x in a)} rows")


if __name__ == "__main__":
    sys.exit(main())
