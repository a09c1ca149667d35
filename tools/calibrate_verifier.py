"""Fit the verification-time law T_ver = t0 + t1 * sum_k (L_k + 1) for an edge target on this machine.

Times `BatchedVerifier.verify` (one batched forward, steady state: every session already prefilled) over a
grid of device counts and draft lengths, fits t0, t1 by least squares, and prints them with the fit error
and the time of the same work done one device at a time. The fitted values go into a profile's
`verify_t0_s` / `verify_t1_s`.

  python tools/calibrate_verifier.py --target ~/.cache/multispin/models/<pair>/target
  python tools/calibrate_verifier.py --arch qwen2.5-1.5b --dtype bfloat16      # random weights, same cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# Qwen2.5 shapes (config.json of the released checkpoints); random weights time the same as trained ones.
ARCHES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def build_model(args):
    import torch

    from model_pairs.checkpoints import load_causal_lm

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.target:
        return load_causal_lm(args.target, device=device, dtype=args.dtype), device
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**ARCHES[args.arch], max_position_embeddings=32768)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype or "float32"]
    model = Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval()
    return model, device


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_rounds(verifier, device, n_devices, draft_len, context, repeats, rng, *, batched=True):
    """Median seconds of one steady-state round (batched: one verify; else one verify per device)."""
    vocab = verifier.vocab_size
    names = [f"cal{i}" for i in range(n_devices)]
    for name in names:
        verifier.open(name, rng.integers(0, vocab, size=context).tolist())
    # First round prefills the prompts; commit everything so later rounds are steady state.
    drafts = {n: rng.integers(0, vocab, size=draft_len).tolist() for n in names}
    verifier.verify([(n, [], drafts[n]) for n in names])
    for n in names:
        verifier.commit(n, 0)  # keep the context length fixed across the timed rounds
    samples = []
    for _ in range(repeats):
        items = [(n, [], rng.integers(0, vocab, size=draft_len).tolist()) for n in names]
        synchronize(device)
        start = time.perf_counter()
        if batched:
            verifier.verify(items)
        else:
            for item in items:
                verifier.verify([item])
        synchronize(device)
        samples.append(time.perf_counter() - start)
        for n in names:
            verifier.commit(n, 0)
    for n in names:
        verifier.close(n)
    return statistics.median(samples)


def main(argv=None) -> int:
    import numpy as np

    from edge_node.verifier import BatchedVerifier

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--target", help="a Hugging Face directory or GGUF file")
    src.add_argument("--arch", choices=sorted(ARCHES), help="random weights with this architecture")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default float32)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    parser.add_argument("--devices", default="1,2,4,8,16", help="device counts")
    parser.add_argument("--draft-lens", default="1,4,8", help="draft lengths")
    parser.add_argument("--context", type=int, default=256, help="tokens of context per device")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not args.target and not args.arch:
        parser.error("give --target PATH or --arch NAME")

    from tqdm import tqdm

    model, device = build_model(args)
    verifier = BatchedVerifier(model, device=device)
    rng = np.random.default_rng(0)
    grid = [(n, L) for n in map(int, args.devices.split(",")) for L in map(int, args.draft_lens.split(","))]
    rows = []
    for n, L in tqdm(grid, desc="calibrate", unit="point", file=sys.stderr):
        batched = time_rounds(verifier, device, n, L, args.context, args.repeats, rng)
        serial = time_rounds(verifier, device, n, L, args.context, max(2, args.repeats // 2), rng, batched=False)
        rows.append({"devices": n, "draft_len": L, "tokens": n * (L + 1), "batched_s": batched, "serial_s": serial})

    x = np.array([r["tokens"] for r in rows], dtype=float)
    y = np.array([r["batched_s"] for r in rows])
    t1, t0 = np.polyfit(x, y, 1)
    rel_err = np.abs((t0 + t1 * x) - y) / y
    print(f"{'devices':>7} {'L':>3} {'tokens':>6} {'batched ms':>10} {'serial ms':>10} "
          f"{'serial/batched':>14} {'fit ms':>8}")
    for r in rows:
        fit = t0 + t1 * r["tokens"]
        print(f"{r['devices']:>7} {r['draft_len']:>3} {r['tokens']:>6} {r['batched_s']*1e3:>10.2f} "
              f"{r['serial_s']*1e3:>10.2f} {r['serial_s']/r['batched_s']:>14.2f} {fit*1e3:>8.2f}")
    name = args.target or args.arch
    print(f"\n{name} on {device} ({args.dtype or 'float32'}), context {args.context}: "
          f"verify_t0_s = {t0:.3e}, verify_t1_s = {t1:.3e}; fit error median {np.median(rel_err):.1%}, "
          f"max {rel_err.max():.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": name, "device": device, "dtype": args.dtype or "float32",
                                               "context": args.context, "verify_t0_s": t0, "verify_t1_s": t1,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
