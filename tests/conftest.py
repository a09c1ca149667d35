"""Shared fixtures: a micro model pair built once per test session by the same code as the default pair."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory):
    """PairPaths of a tiny target/draft pair (stdlib corpus, 320-token vocabulary, ONNX draft with a KV
    cache), built under the session's pytest tmp base: ~20 s on an idle core, once per session."""
    from model_pairs.model_pair import MICRO_CONFIG, PairPaths, build_pair

    root = tmp_path_factory.getbasetemp() / "micro-pair"
    paths = PairPaths.under(root)
    if paths.manifest.is_file():
        return paths
    return build_pair(MICRO_CONFIG, root, progress=False)
