"""Per-token draft latency: the ONNX drafter under onnxruntime against the same draft in PyTorch eager
(both with a KV cache, one token per step, same threads), measured side by side in one run.

  python tools/bench_drafter.py [--pair DIR | --micro] [--tokens 64] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_common import interleaved_medians  # tools/ is on sys.path when a script here runs


def pick_pair(args):
    from model_pairs.cache import ensure_pair
    from model_pairs.model_pair import DEFAULT_CONFIG, MICRO_CONFIG, PairPaths, pair_dir

    if args.pair:
        return PairPaths.under(Path(args.pair))
    if not args.micro and (pair_dir(DEFAULT_CONFIG) / "manifest.json").is_file():
        return PairPaths.under(pair_dir(DEFAULT_CONFIG))
    if not args.micro:
        print("default pair not built (multispin models build); using the micro pair", file=sys.stderr)
    return ensure_pair(MICRO_CONFIG, progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", help="pair directory (default: the cached default pair, else the micro pair)")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from device_node.drafter import OnnxDrafter
    from model_pairs.checkpoints import cache_kwarg
    from testbed.core.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    pair = pick_pair(args)
    onnx = OnnxDrafter(pair.draft_onnx, threads=args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(pair.draft_dir)).eval()
    kw = cache_kwarg(model)
    prompt = list(range(1, args.prompt_len + 1))
    greedy = SamplingParams(0.0)

    def run_onnx() -> float:
        onnx.reset(prompt)
        onnx.draft(1, greedy, np.random.default_rng(0))  # prefill outside the timed part
        onnx.commit(1, 5)
        t = time.perf_counter()
        onnx.draft(args.tokens, greedy, np.random.default_rng(0))  # the returned Draft is not needed here
        dt = time.perf_counter() - t
        onnx.commit(0, 5)
        return dt / args.tokens

    @torch.no_grad()
    def run_torch() -> float:
        cache = DynamicCache()
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, **{kw: cache})
        tok = out.logits[0, -1].argmax().view(1, 1)
        pos = len(prompt)
        t = time.perf_counter()
        for _ in range(args.tokens):
            out = model(input_ids=tok, position_ids=torch.tensor([[pos]]), use_cache=True, **{kw: cache})
            tok = out.logits[0, -1].argmax().view(1, 1)
            pos += 1
        return (time.perf_counter() - t) / args.tokens

    run_onnx(), run_torch()  # warm-up
    mo, mp = interleaved_medians(run_onnx, run_torch, args.repeats)
    print(f"pair: {pair.root}")
    print(f"draft decode, {args.tokens} tokens after a {args.prompt_len}-token prompt, {args.threads} thread(s), "
          f"median of {args.repeats}:")
    print(f"  onnxruntime    {mo * 1e3:8.3f} ms/token")
    print(f"  pytorch eager  {mp * 1e3:8.3f} ms/token")
    print(f"  ratio pytorch/onnx = {mp / mo:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
