"""The built-in target/draft pair: build (corpus -> tokenizer -> two Llama-style LMs -> ONNX draft),
evaluate (perplexity, acceptance), cache under `$MULTISPIN_CACHE` or `~/.cache/multispin` with a manifest.

The build is deterministic from the seed (same corpus, same library versions -> same weights). The default
pair also ships in the package as float16 weights (`model_pairs.shipped_pair`): a fresh cache gets it in seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class PairPaths:
    root: Path
    target_dir: Path
    draft_dir: Path
    draft_onnx: Path
    tokenizer: Path
    manifest: Path

    @classmethod
    def under(cls, root: Path) -> PairPaths:
        root = Path(root)
        return cls(root, root / "target", root / "draft", root / "draft.onnx", root / "tokenizer.json",
                   root / MANIFEST)


@dataclass(frozen=True)
class PairBuildConfig:
    name: str = "pydoc-pair"
    seed: int = 1234
    corpus: str = "auto"  # auto | python-doc | stdlib
    max_corpus_chars: int | None = None
    heldout_every: int = 20  # one file in this many (by path hash) is held out
    vocab_size: int = 4096
    context: int = 256
    batch: int = 8
    target_shape: tuple = (256, 4, 4, 688)  # hidden, layers, heads, intermediate
    draft_shape: tuple = (128, 2, 4, 344)
    target_steps: int = 450
    draft_steps: int = 450
    target_lr: float = 3e-3
    draft_lr: float = 5e-3
    threads: int = 0  # torch threads while building; 0 = all cores
    eval_tokens: int = 16384  # held-out tokens for perplexity and teacher-forced acceptance
    spec_prompts: int = 8  # speculative-decoding acceptance: prompts x new tokens at temperature 1
    spec_new_tokens: int = 64
    spec_prompt_len: int = 32
    draft_len: int = 4

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        # threads is an execution detail (recorded in the manifest), not part of the pair's identity
        fields = {k: v for k, v in self.to_dict().items() if k != "threads"}
        blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


DEFAULT_CONFIG = PairBuildConfig()
# Builds in seconds: the pair the tests use (same code path, tiny everything).
MICRO_CONFIG = PairBuildConfig(
    name="micro-pair", seed=7, corpus="stdlib", max_corpus_chars=120_000, heldout_every=4, vocab_size=320,
    context=64, batch=8,
    target_shape=(48, 2, 4, 96), draft_shape=(32, 1, 4, 64), target_steps=60, draft_steps=60,
    target_lr=1e-2, draft_lr=1e-2, threads=1, eval_tokens=1024, spec_prompts=2, spec_new_tokens=16,
    spec_prompt_len=16, draft_len=4)


def cache_root() -> Path:
    env = os.environ.get("MULTISPIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "multispin"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _file_table(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def load_manifest(root) -> dict:
    path = Path(root)
    path = path if path.name == MANIFEST else path / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no model-pair manifest at {path}")
    return json.loads(path.read_text())


def _versions() -> dict:
    import numpy
    import onnx
    import onnxruntime
    import tokenizers
    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def eval_prompts(held_ids, config: PairBuildConfig) -> list[list[int]]:
    """The held-out prompts the speculative acceptance (and the greedy agreement) is measured on."""
    stride = max(1, (len(held_ids) - config.spec_prompt_len) // max(1, config.spec_prompts))
    return [held_ids[k * stride:k * stride + config.spec_prompt_len].tolist() for k in range(config.spec_prompts)]


def evaluate_acceptance(target, draft, held_ids, config: PairBuildConfig) -> dict:
    """Teacher-forced and speculative acceptance at temperature 1 and greedy (seeded: reruns give the same)."""
    from model_pairs.training import acceptance_summary, speculative_generate, teacher_forced_acceptance
    from testbed.core.sampling import SamplingParams

    acceptance = {}
    for label, params in (("temperature_1", SamplingParams(1.0)), ("greedy", SamplingParams(0.0))):
        tf = teacher_forced_acceptance(target, draft, held_ids, config.context, config.eval_tokens, params)
        counts: list[int] = []
        for k, prompt in enumerate(eval_prompts(held_ids, config)):
            _, c = speculative_generate(target, draft, prompt, config.spec_new_tokens, config.draft_len,
                                        params, seed=config.seed, device_name=f"eval-{k}")
            counts.extend(c)
        acceptance[label] = {"teacher_forced_alpha": tf, "draft_len": config.draft_len,
                             **acceptance_summary(counts, config.draft_len)}
    return acceptance


def load_heldout(config: PairBuildConfig, tokenizer_path: Path, corpus_dir: Path, expect_source: str | None = None):
    """The held-out token stream of a pair's corpus (as the build encoded it), for re-evaluating the pair."""
    from tokenizers import Tokenizer

    from model_pairs.corpus import load_corpus
    from model_pairs.training import encode_documents

    corpus = load_corpus(config.corpus, corpus_dir, heldout_every=config.heldout_every,
                         max_chars=config.max_corpus_chars)
    if expect_source is not None and corpus.source != expect_source:
        raise RuntimeError(f"corpus: the pair was built on {expect_source!r} but only {corpus.source!r} is "
                           "available here, so its held-out text differs")
    return encode_documents(Tokenizer.from_file(str(tokenizer_path)), corpus.heldout)


def build_pair(config: PairBuildConfig, out_dir: Path, progress: bool = True) -> PairPaths:
    """Build the pair into out_dir (written to a temporary sibling, then renamed: never half-built)."""
    import numpy as np
    import torch
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from model_pairs.corpus import load_corpus
    from model_pairs.onnx_export import export_draft_onnx
    from model_pairs.training import (
        ModelShape,
        encode_documents,
        make_model,
        param_count,
        perplexity,
        train_lm,
        train_tokenizer,
    )

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".building")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    paths = PairPaths.under(tmp)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    hf_logging.disable_progress_bar()  # only our own training bars
    old_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads or os.cpu_count() or 1)
    try:
        t = time.perf_counter()
        corpus = load_corpus(config.corpus, out_dir.parent / "corpus-cache", heldout_every=config.heldout_every,
                             max_chars=config.max_corpus_chars)
        timings["corpus_s"] = time.perf_counter() - t

        t = time.perf_counter()
        tok = train_tokenizer(corpus.train, config.vocab_size)
        tok.save(str(paths.tokenizer))
        train_ids = encode_documents(tok, corpus.train)
        held_ids = encode_documents(tok, corpus.heldout)
        timings["tokenizer_s"] = time.perf_counter() - t
        vocab = tok.get_vocab_size()
        max_pos = max(2048, config.context * 4)

        models = {}
        results: dict[str, dict] = {}
        for role, shape, steps, lr, seed_off in (
                ("target", config.target_shape, config.target_steps, config.target_lr, 1),
                ("draft", config.draft_shape, config.draft_steps, config.draft_lr, 2)):
            t = time.perf_counter()
            model = make_model(ModelShape(*shape), vocab, max_pos, config.seed + seed_off)
            bar = tqdm(total=steps, desc=f"train {role}", disable=not progress, leave=True)
            try:
                losses = train_lm(model, train_ids, steps=steps, batch=config.batch, context=config.context,
                                  lr=lr, seed=config.seed + 10 + seed_off, progress=bar)
            finally:
                bar.close()
            timings[f"train_{role}_s"] = time.perf_counter() - t
            model.save_pretrained(str(tmp / role))
            models[role] = model
            results[role] = {
                "parameters": param_count(model),
                "shape": ModelShape(*shape).to_dict(),
                "final_train_loss": float(np.mean(losses[-max(1, steps // 20):])),
                "heldout_perplexity": perplexity(model, held_ids, config.context, config.eval_tokens),
            }

        t = time.perf_counter()
        export_info = export_draft_onnx(models["draft"], paths.draft_onnx)
        timings["onnx_export_s"] = time.perf_counter() - t

        t = time.perf_counter()
        acceptance = evaluate_acceptance(models["target"], models["draft"], held_ids, config)
        timings["evaluation_s"] = time.perf_counter() - t
    finally:
        torch.set_num_threads(old_threads)

    manifest = {
        "format": FORMAT_VERSION,
        "name": config.name,
        "config": config.to_dict(),
        "config_hash": config.config_hash(),
        "seed": config.seed,
        "corpus": {"source": corpus.source, "train_chars": corpus.chars[0], "heldout_chars": corpus.chars[1],
                   "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids))},
        "vocab_size": vocab,
        "target": results["target"],
        "draft": results["draft"],
        "acceptance": acceptance,
        "acceptance_rate": acceptance["temperature_1"]["alpha"],
        "onnx": {"path": paths.draft_onnx.name, **export_info},
        "build_seconds": round(time.perf_counter() - t_start, 1),
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "threads": config.threads or os.cpu_count(),
        "versions": _versions(),
        "files": _file_table(tmp),
        "built_at_unix": int(time.time()),
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return PairPaths.under(out_dir)


def pair_dir(config: PairBuildConfig, cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or cache_root()) / "models" / f"{config.name}-{config.config_hash()}"


def is_complete(paths: PairPaths) -> bool:
    return paths.manifest.is_file() and paths.draft_onnx.is_file() and paths.tokenizer.is_file()


def verify_files(paths: PairPaths) -> list[str]:
    """Files whose size or sha256 no longer matches the manifest (empty list = intact)."""
    manifest = load_manifest(paths.root)
    bad = []
    for rel, info in manifest["files"].items():
        p = paths.root / rel
        if not p.is_file() or p.stat().st_size != info["bytes"] or sha256_file(p) != info["sha256"]:
            bad.append(rel)
    return bad
