"""A pair in the model cache: there already, else unpacked from the package's shipped copy (seconds), else built
(minutes)."""

from __future__ import annotations

import dataclasses
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
