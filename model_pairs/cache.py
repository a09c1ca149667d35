"""A pair in the model cache: there already, else unpacked from the package's shipped copy (seconds), else built
(minutes)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from model_pairs.model_pair import DEFAULT_CONFIG, PairBuildConfig, PairPaths, build_pair, is_complete, pair_dir
from model_pairs.shipped_pair import find_shipped, materialize


def ensure_pair(config: PairBuildConfig, cache_dir: Path | None = None, progress: bool = True,
                shipped: bool = True) -> PairPaths:
    """The pair in the cache; when missing, materialized from the package's shipped copy of this config
    (seconds; `model_pairs.shipped_pair`) if there is one and `shipped`, else built (minutes)."""
    root = pair_dir(config, cache_dir)
    paths = PairPaths.under(root)
    if is_complete(paths):
        return paths
    if shipped:
        src = find_shipped(config)
        if src is not None:
            return materialize(src, root, threads=config.threads, progress=progress)
    return build_pair(config, root, progress=progress)


def ensure_default_pair(cache_dir: Path | None = None, progress: bool = True,
                        threads: int | None = None) -> PairPaths:
    """The default pair: from the cache, else from the copy shipped in the package (seconds), else built
    (about 10 minutes on 2 CPU cores)."""
    config = DEFAULT_CONFIG if threads is None else dataclasses.replace(DEFAULT_CONFIG, threads=threads)
    return ensure_pair(config, cache_dir, progress)


# --- pairs by name ----------------------------------------------------------------------------------------
# A profile's `model: {pair: local, name: NAME}` is the folder <cache root>/models/NAME/ (the cache root:
# $MULTISPIN_CACHE, else ~/.cache/multispin), laid out as `multispin models fetch` writes it:
#   target/ (a Hugging Face folder) or target.gguf, draft.onnx, tokenizer.json or draft/tokenizer.json
# The profile's target / draft_onnx / tokenizer, when given, are relative to that folder (or absolute).

# The pairs `multispin models fetch NAME` knows (model_pairs.fetch.PAIRS holds their sources).
FETCHABLE = ("qwen2.5-coder",)
CACHE_VAR = "MULTISPIN_CACHE"
LAYOUT = {"target": ("target", "target.gguf"), "draft_onnx": ("draft.onnx",),
          "tokenizer": ("tokenizer.json", "draft/tokenizer.json", "target/tokenizer.json")}


class NamedPairError(FileNotFoundError):
    """A pair named in a profile that is not in the model cache (or lacks a file)."""


def expand_path(value: str | Path) -> Path:
    """`${MULTISPIN_CACHE}` / `$MULTISPIN_CACHE` -> the cache root (its default when the variable is unset),
    other environment variables and `~` expanded."""
    from model_pairs.model_pair import cache_root

    text = str(value)
    root = str(cache_root())
    text = text.replace("${" + CACHE_VAR + "}", root)
    text = re.sub(r"\$" + CACHE_VAR + r"(?![A-Za-z0-9_])", lambda _: root, text)
    return Path(os.path.expandvars(text)).expanduser()


def named_pair_dir(name: str, cache_dir: Path | None = None) -> Path:
    from model_pairs.model_pair import cache_root

    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise NamedPairError(f"model.name {name!r}: a pair's name is a folder name under the model cache")
    return Path(cache_dir if cache_dir is not None else cache_root()) / "models" / name


def how_to_get(name: str) -> str:
    if name in FETCHABLE:
        return f"fetch it with `multispin models fetch {name}`"
    return ("put target/ (or target.gguf), draft.onnx and tokenizer.json there, e.g. with `multispin models "
            "export` (docs/models.md)")


def resolve_named_pair(name: str, target: str | None = None, draft_onnx: str | None = None,
                       tokenizer: str | None = None, cache_dir: Path | None = None) -> dict[str, str]:
    """Absolute paths of the named pair's target, draft ONNX and tokenizer; a NamedPairError naming the pair,
    the folder, what is missing and how to get it."""
    root = named_pair_dir(name, cache_dir)
    if not root.is_dir():
        raise NamedPairError(f"model pair {name!r} is not in the model cache ({root} does not exist); "
                             f"{how_to_get(name)}")
    given = {"target": target, "draft_onnx": draft_onnx, "tokenizer": tokenizer}
    out, missing = {}, []
    for key, candidates in LAYOUT.items():
        if given[key]:
            p = expand_path(given[key])
            p = p if p.is_absolute() else root / p
            found = p if p.exists() else None
            wanted = str(p)
        else:
            found = next((root / c for c in candidates if (root / c).exists()), None)
            wanted = " or ".join(candidates)
        if found is None:
            missing.append(f"model.{key} ({wanted})")
        else:
            out[key] = str(found.resolve())
    if missing:
        raise NamedPairError(f"model pair {name!r} in {root} lacks {', '.join(missing)}; {how_to_get(name)}")
    return out
