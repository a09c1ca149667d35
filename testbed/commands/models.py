"""`multispin models`: build, inspect and export the model pair.

  multispin models build [--micro] [--cache-dir DIR] [--force] [--no-progress] [--threads N]
  multispin models info [--micro | --dir DIR] [--json] [--check]
  multispin models export --model HF_DIR_OR_GGUF --out draft.onnx
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.cli import CliError


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="build, inspect and export the target/draft model pair")
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    sub.required = True

    b = sub.add_parser("build", help="train the default pair (tokenizer, target, draft, ONNX draft) into the cache")
    _pair_args(b)
    b.add_argument("--force", action="store_true", help="rebuild even if the cache holds this pair")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads while building (default: all cores; 1 is faster on a busy machine)")
    b.set_defaults(handler=_build)

    i = sub.add_parser("info", help="print the manifest of a built pair")
    _pair_args(i)
    i.add_argument("--dir", type=Path, help="a pair directory (overrides --micro/--cache-dir)")
    i.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    i.add_argument("--check", action="store_true", help="verify file sizes and sha256 against the manifest")
    i.set_defaults(handler=_info)

    e = sub.add_parser("export", help="export a draft model (HF directory or GGUF file) to ONNX with a KV cache")
    e.add_argument("--model", type=Path, required=True, help="Hugging Face model directory or .gguf file")
    e.add_argument("--out", type=Path, required=True, help="output .onnx path")
    e.add_argument("--exporter", choices=["auto", "dynamo", "torchscript"], default="auto")
    e.add_argument("--check", action="store_true", help="compare ONNX and PyTorch logits after exporting")
    e.set_defaults(handler=_export)


def _pair_args(p) -> None:
    p.add_argument("--micro", action="store_true", help="the micro pair the tests use (builds in seconds)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cache root (default: $MULTISPIN_CACHE or ~/.cache/multispin)")


def _config(args):
    from edge_node.model_pair import DEFAULT_CONFIG, MICRO_CONFIG

    return MICRO_CONFIG if args.micro else DEFAULT_CONFIG


def _build(args) -> int:
    import dataclasses

    from edge_node.model_pair import build_pair, ensure_pair, pair_dir

    config = _config(args)
    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads {args.threads}: must be >= 1")
        config = dataclasses.replace(config, threads=args.threads)
    root = pair_dir(config, args.cache_dir)
    if args.force:
        paths = build_pair(config, root, progress=not args.no_progress)
    else:
        paths = ensure_pair(config, args.cache_dir, progress=not args.no_progress)
    _print_summary(paths.root)
    return 0


def _print_summary(root: Path) -> None:
    from edge_node.model_pair import load_manifest

    m = load_manifest(root)
    acc = m["acceptance"]
    lines = [
        f"pair        {m['name']}  ({root})",
        f"corpus      {m['corpus']['source']}: {m['corpus']['train_tokens']:,} train / "
        f"{m['corpus']['heldout_tokens']:,} held-out tokens, vocabulary {m['vocab_size']:,}",
        f"target      {m['target']['parameters']:,} parameters, held-out perplexity "
        f"{m['target']['heldout_perplexity']:.1f}",
        f"draft       {m['draft']['parameters']:,} parameters, held-out perplexity "
        f"{m['draft']['heldout_perplexity']:.1f}",
    ]
    for label, a in acc.items():
        lines.append(f"acceptance  {label}: alpha {a['alpha']:.3f} (speculative, L={a['draft_len']}, "
                     f"{a['tokens_per_target_call']:.2f} tokens/target call), teacher-forced "
                     f"{a['teacher_forced_alpha']:.3f}")
    lines.append(f"build       {m['build_seconds']:.0f} s on {m['threads']} threads "
                 f"({', '.join(f'{k} {v:.0f}' for k, v in m['timings'].items())})")
    lines.append(f"onnx        {m['onnx']['path']} ({m['onnx']['exporter']})")
    print("\n".join(lines))


def _info(args) -> int:
    from edge_node.model_pair import PairPaths, load_manifest, pair_dir, verify_files

    root = args.dir if args.dir is not None else pair_dir(_config(args), args.cache_dir)
    try:
        manifest = load_manifest(root)
    except FileNotFoundError as exc:
        flag = " --micro" if args.micro else ""
        raise CliError(f"{exc}; build it with `multispin models build{flag}`") from None
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        _print_summary(Path(root))
    if args.check:
        bad = verify_files(PairPaths.under(Path(root)))
        if bad:
            raise CliError(f"files differ from the manifest: {', '.join(bad)}")
        print(f"files       {len(manifest['files'])} files match the manifest")
    return 0


def _export(args) -> int:
    import numpy as np
    import torch

    from edge_node.checkpoints import load_causal_lm
    from edge_node.onnx_export import export_draft_onnx

    if not args.model.exists():
        raise CliError(f"--model {args.model}: no such directory or file")
    if args.out.suffix != ".onnx":
        raise CliError(f"--out {args.out}: must end in .onnx")
    model = load_causal_lm(args.model, device="cpu")
    dynamo = {"auto": None, "dynamo": True, "torchscript": False}[args.exporter]
    info = export_draft_onnx(model, args.out, dynamo=dynamo)
    print(f"exported {args.out} with {info['exporter']} in {info['seconds']:.1f} s")
    if args.check:
        from device_node.drafter import OnnxDrafter

        ids = list(range(1, 17))
        got = OnnxDrafter(args.out).logits_trace(ids)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        err = float(np.abs(got - ref).max())
        print(f"max |ONNX - PyTorch| logit difference over {len(ids)} decode steps: {err:.2e}")
        if err > 1e-3:
            raise CliError(f"ONNX logits differ from PyTorch by {err:.2e} (> 1e-3)")
    return 0
