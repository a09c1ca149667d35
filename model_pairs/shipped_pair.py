"""The default pair as package data: packed from a built pair, materialized into the cache in seconds.

Shipped form (`model_pairs/pairs/<name>-<config_hash>/`, written by `multispin models pack`): the tokenizer,
the model configs and the weights as float16 safetensors (half the bytes), with `shipped.json` holding the
sha256 of every shipped file, the build's whole manifest (config, corpus, metrics, fp32 file hashes,
versions) and, from `pack --evaluate`, the acceptance and perplexities of the float16-rounded pair itself.

Materializing checks every shipped file against `shipped.json`, widens the weights back to float32 (exact:
the cached pair is the rounded pair), exports the ONNX draft there and writes a `manifest.json` that
`verify_files` checks like a built pair's.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from model_pairs.model_pair import (
    MANIFEST,
    PairBuildConfig,
    PairPaths,
    _file_table,
    _versions,
    eval_prompts,
    evaluate_acceptance,
    is_complete,
    load_heldout,
    load_manifest,
    sha256_file,
    verify_files,
)

SHIPPED_ROOT = Path(__file__).resolve().with_name("pairs")
SHIPPED_MANIFEST = "shipped.json"
KIND = "multispin-shipped-pair"
WEIGHTS = ("target/model.safetensors", "draft/model.safetensors")
COPIED = ("tokenizer.json", "target/config.json", "target/generation_config.json", "draft/config.json",
          "draft/generation_config.json")
FLOAT16_MAX = 65504.0


class ShippedPairError(RuntimeError):
    """A shipped pair that is missing a file, fails a hash, or does not describe the config asked for."""


def find_shipped(config: PairBuildConfig, root: Path | None = None) -> Path | None:
    """The shipped folder of exactly this config (same name and config hash) under root (default: the
    package's `pairs/`), or None."""
    src = Path(root if root is not None else SHIPPED_ROOT) / f"{config.name}-{config.config_hash()}"
    return src if (src / SHIPPED_MANIFEST).is_file() else None


def load_shipped(src: Path) -> dict:
    """shipped.json, after checking every listed file's size and sha256 (a clear error naming the file)."""
    src = Path(src)
    mpath = src / SHIPPED_MANIFEST
    try:
        m = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        raise ShippedPairError(f"{mpath}: unreadable shipped-pair manifest: {exc}") from None
    if m.get("kind") != KIND or not isinstance(m.get("files"), dict):
        raise ShippedPairError(f"{mpath}: not a shipped-pair manifest (kind {m.get('kind')!r})")
    for rel in (*COPIED, *WEIGHTS):
        if rel not in m["files"]:
            raise ShippedPairError(f"{mpath}: files lacks {rel}")
    for rel, info in m["files"].items():
        p = src / rel
        if not p.is_file():
            raise ShippedPairError(f"shipped model pair: {p} is missing; reinstall the package or run "
                                   "`multispin models build`")
        size = p.stat().st_size
        if size != info["bytes"]:
            raise ShippedPairError(f"shipped model pair: {p} has {size} bytes, {mpath} says {info['bytes']}; "
                                   "the file is damaged: reinstall the package or run `multispin models build`")
        digest = sha256_file(p)
        if digest != info["sha256"]:
            raise ShippedPairError(f"shipped model pair: {p} has sha256 {digest}, {mpath} says {info['sha256']}; "
                                   "the file is damaged: reinstall the package or run `multispin models build`")
    return m


def _convert(src: Path, dst: Path, dtype) -> None:
    """Copy a safetensors file with every floating tensor cast to dtype (names and metadata kept)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
        for k in f.keys():
            t = f.get_tensor(k)
            if t.is_floating_point():
                if dtype == torch.float16 and float(t.abs().max()) > FLOAT16_MAX:
                    raise ValueError(f"{src}: tensor {k} exceeds the float16 range")
                t = t.to(dtype)
            tensors[k] = t.contiguous()
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst), metadata=meta)


def _fresh_sibling(dest: Path, tag: str) -> Path:
    """A work folder of its own next to dest: concurrent runs never share one; the rename is atomic."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{tag}-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the installed folder private
    return tmp


def _install(tmp: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


@contextlib.contextmanager
def _quiet_exporter():
    """The ONNX exporter's INFO lines (optimizer passes, skipped torchvision ops) would flood a run's console."""
    loggers = [logging.getLogger(n) for n in ("onnx_ir", "onnxscript", "torch.onnx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def materialize(src: Path, dest: Path, *, threads: int = 0, progress: bool = False) -> PairPaths:
    """Turn the shipped pair in src into a cached pair at dest (float32 weights, ONNX draft, manifest)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from model_pairs.onnx_export import export_draft_onnx

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    src, dest = Path(src), Path(dest)
    shipped = load_shipped(src)
    if progress:
        print(f"model pair: unpacking the shipped {shipped['name']} into {dest}", file=sys.stderr, flush=True)
    tmp = _fresh_sibling(dest, "materializing")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        for rel in COPIED:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, tmp / rel)
        for rel in WEIGHTS:
            _convert(src / rel, tmp / rel, torch.float32)  # float16 -> float32 is exact
        draft = AutoModelForCausalLM.from_pretrained(str(tmp / "draft")).eval()
        with _quiet_exporter():
            export_info = export_draft_onnx(draft, tmp / "draft.onnx")
        manifest = copy.deepcopy(shipped["build"])
        evaluation = shipped.get("evaluation")
        if evaluation:  # the numbers of the weights in the cache; the fp32 build's stay under build_metrics
            manifest["build_metrics"] = {
                "acceptance": manifest["acceptance"], "acceptance_rate": manifest["acceptance_rate"],
                "target_heldout_perplexity": manifest["target"]["heldout_perplexity"],
                "draft_heldout_perplexity": manifest["draft"]["heldout_perplexity"]}
            manifest["acceptance"] = evaluation["acceptance"]
            manifest["acceptance_rate"] = evaluation["acceptance_rate"]
            for role in ("target", "draft"):
                manifest[role]["heldout_perplexity"] = evaluation[f"{role}_heldout_perplexity"]
        manifest["onnx"] = {"path": "draft.onnx", **export_info}
        manifest["shipped"] = {"source": str(src), "manifest": shipped,
                               "materialize_seconds": round(time.perf_counter() - t0, 2), "versions": _versions()}
        manifest["files"] = _file_table(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        paths = PairPaths.under(dest)
        if is_complete(paths):  # another process got there first: keep its pair
            shutil.rmtree(tmp)
        else:
            _install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(old_threads)
    if progress:
        print(f"model pair: ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return paths


def _rounded(model):
    """The model with every weight rounded through float16 (what the shipped pair loads as)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy outputs of two models: identical sequences, and tokens before the first difference."""
    same_prefix = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        same_prefix += n
    total = sum(len(x) for x in a)
    return {"identical_sequences": sum(x == y for x, y in zip(a, b)), "sequences": len(a),
            "tokens_before_first_difference": same_prefix, "tokens": total}


def evaluate_rounded(pair_root: Path, build: dict, corpus_dir: Path, threads: int = 0) -> dict:
    """Re-run the build's evaluation on the float16-rounded pair; with fp32 weights in pair_root, also the
    agreement of greedy outputs between the fp32 and the rounded models on the evaluation prompts."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from model_pairs.training import greedy_generate, perplexity

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    config = PairBuildConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in build["config"].items()})
    config = dataclasses.replace(config, threads=threads)
    pair_root = Path(pair_root)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        held = load_heldout(config, pair_root / "tokenizer.json", corpus_dir, expect_source=build["corpus"]["source"])
        load = lambda role: AutoModelForCausalLM.from_pretrained(str(pair_root / role),
                                                                 dtype=torch.float32).eval()
        orig = {role: load(role) for role in ("target", "draft")}
        rounded = {role: _rounded(load(role)) for role in ("target", "draft")}
        out = {"threads": config.threads or os.cpu_count()}
        for role in ("target", "draft"):
            out[f"{role}_heldout_perplexity"] = perplexity(rounded[role], held, config.context, config.eval_tokens)
        out["acceptance"] = evaluate_acceptance(rounded["target"], rounded["draft"], held, config)
        out["acceptance_rate"] = out["acceptance"]["temperature_1"]["alpha"]
        already_rounded = all(torch.equal(p, p.half().float()) for p in orig["target"].parameters())
        if not already_rounded:
            prompts = eval_prompts(held, config)
            out["greedy_agreement_with_build"] = {
                role: _agreement([greedy_generate(orig[role], p, config.spec_new_tokens) for p in prompts],
                                 [greedy_generate(rounded[role], p, config.spec_new_tokens) for p in prompts])
                for role in ("target", "draft")}
        out["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        torch.set_num_threads(old_threads)
    return out


def pack(pair_root: Path, out_parent: Path, *, evaluate: bool = False, corpus_dir: Path | None = None,
         threads: int = 0) -> Path:
    """Write the shipped form of the pair in pair_root to out_parent/<name>-<config_hash>/; returns it.

    pair_root is a built pair (or one materialized from a shipped pair: its build's provenance carries over).
    The same pair always packs to the same bytes, so the package data is reproducible from `models build`.
    """
    import torch

    pair_root = Path(pair_root)
    m = load_manifest(pair_root)
    bad = verify_files(PairPaths.under(pair_root))
    if bad:
        raise ShippedPairError(f"{pair_root}: files differ from its manifest: {', '.join(bad)}")
    earlier = m.get("shipped", {}).get("manifest")
    build = earlier["build"] if earlier else m
    dest = Path(out_parent) / f"{build['name']}-{build['config_hash']}"
    tmp = _fresh_sibling(dest, "packing")
    try:
        for rel in COPIED:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pair_root / rel, tmp / rel)
        for rel in WEIGHTS:
            _convert(pair_root / rel, tmp / rel, torch.float16)
        shipped = {"format": 1, "kind": KIND, "name": build["name"], "config_hash": build["config_hash"],
                   "config": build["config"], "weights_dtype": "float16", "files": _file_table(tmp),
                   "build": build}
        if evaluate:
            cdir = corpus_dir if corpus_dir is not None else pair_root.parent / "corpus-cache"
            shipped["evaluation"] = evaluate_rounded(pair_root, build, cdir, threads)
        elif earlier and earlier.get("evaluation"):
            shipped["evaluation"] = earlier["evaluation"]
        (tmp / SHIPPED_MANIFEST).write_text(json.dumps(shipped, indent=2, sort_keys=True) + "\n")
        _install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
