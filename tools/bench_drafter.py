"""Per-token draft latency: the ONNX drafter under onnxruntime against the same draft in PyTorch eager
(both with a KV cache, one token per step, same threads), measured side by side in one run.

  python tools/bench_drafter.py [--pair DIR | --micro] [--tokens 64] [--repeats 5] [--threads 1]

With --int8 [--acceptance]: the float32 ONNX draft against its int8 quantization (`multispin models export
--quantize int8`, written to a temporary folder unless the pair has draft.int8.onnx), per-token draft time
side by side and, with --acceptance, the pair's evaluation (teacher-forced and speculative acceptance at
temperature 1 and greedy, the build's prompts and seeds) with each draft against the PyTorch target.
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


def onnx_bytes(path: Path) -> int:
    """A model's size with its external data file (`NAME.data`: the weights of a model over 2 GB)."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", help="pair directory (default: the cached default pair, else the micro pair)")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--int8", action="store_true", help="float32 ONNX draft against its int8 quantization")
    ap.add_argument("--acceptance", action="store_true", help="with --int8: also the acceptance of each (minutes)")
    args = ap.parse_args()
    if args.int8:
        return compare_int8(args)

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


def compare_int8(args) -> int:
    import json
    import tempfile

    import numpy as np

    from device_node.drafter import OnnxDrafter
    from model_pairs.onnx_export import quantize_draft_onnx
    from testbed.core.sampling import SamplingParams

    pair = pick_pair(args)
    q_path = pair.root / "draft.int8.onnx"
    if not q_path.is_file():
        q_path = Path(tempfile.mkdtemp()) / "draft.int8.onnx"
        print(f"quantized {quantize_draft_onnx(pair.draft_onnx, q_path)}")
    drafters = {"float32": OnnxDrafter(pair.draft_onnx, threads=args.threads),
                "int8": OnnxDrafter(q_path, threads=args.threads)}
    prompt = list(range(1, args.prompt_len + 1))
    greedy = SamplingParams(0.0)

    def timer(d):
        def run() -> float:
            d.reset(prompt)
            d.draft(1, greedy, np.random.default_rng(0))
            d.commit(1, 5)
            t = time.perf_counter()
            d.draft(args.tokens, greedy, np.random.default_rng(0))
            dt = time.perf_counter() - t
            d.commit(0, 5)
            return dt / args.tokens
        return run

    f, q = timer(drafters["float32"]), timer(drafters["int8"])
    f(), q()
    mf, mq = interleaved_medians(f, q, args.repeats)
    result = {"pair": str(pair.root), "threads": args.threads, "tokens": args.tokens,
              "draft_ms_per_token": {"float32": round(mf * 1e3, 3), "int8": round(mq * 1e3, 3)},
              "bytes": {"float32": onnx_bytes(pair.draft_onnx), "int8": onnx_bytes(q_path)}}
    if args.acceptance:
        import dataclasses

        import torch
        from transformers import AutoModelForCausalLM

        from model_pairs.model_pair import PairBuildConfig, evaluate_acceptance, load_heldout, load_manifest

        torch.set_num_threads(args.threads)
        m = load_manifest(pair.root)
        config = PairBuildConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in m["config"].items()})
        config = dataclasses.replace(config, threads=args.threads)
        held = load_heldout(config, pair.tokenizer, pair.root.parent / "corpus-cache",
                            expect_source=m["corpus"]["source"])
        target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir)).eval()
        result["acceptance"] = {}
        for label, path in (("float32", pair.draft_onnx), ("int8", q_path)):
            t0 = time.perf_counter()
            acc = evaluate_acceptance(target, OnnxCausalLM(path, threads=args.threads), held, config)
            result["acceptance"][label] = {k: {"alpha": round(v["alpha"], 4),
                                               "teacher_forced_alpha": round(v["teacher_forced_alpha"], 4),
                                               "tokens_per_target_call": round(v["tokens_per_target_call"], 3)}
                                           for k, v in acc.items()}
            result["acceptance"][label]["seconds"] = round(time.perf_counter() - t0, 1)
        result["manifest_acceptance"] = {k: round(v["alpha"], 4) for k, v in m["acceptance"].items()}
    print(json.dumps(result, indent=2))
    return 0


class OnnxCausalLM:
    """An exported draft graph called like a Hugging Face model: `model(input_ids=ids).logits` (a torch tensor
    (1, S, V)), each call recomputing the whole sequence from an empty cache. What the evaluation code of
    `model_pairs.training` (teacher-forced and speculative acceptance) needs to measure an ONNX draft (say, an
    int8 one) against the target."""

    def __init__(self, onnx_path, threads: int = 1) -> None:
        from device_node.drafter import OnnxDrafter

        self._drafter = OnnxDrafter(onnx_path, threads=threads)

    def __call__(self, input_ids, **_):
        import types

        import numpy as np
        import torch

        d = self._drafter
        ids = np.asarray(input_ids, dtype=np.int64).reshape(1, -1)
        feeds = {"input_ids": ids, "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None]}
        feeds.update(zip(d._past_names, d._empty_cache()))
        logits = d.session.run(["logits"], feeds)[0]
        return types.SimpleNamespace(logits=torch.from_numpy(logits))


if __name__ == "__main__":
    sys.exit(main())
