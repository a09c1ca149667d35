"""Shared fixtures (a micro model pair built once per test session by the same code as the default pair), and
the `live` marker applied by folder and by fixture.

The tree mirrors the source layers (tests/core, tests/wire, ... tests/edge, tests/device, tests/emulator) plus
tests/system for whole live runs. `live` marks tests that start processes, bind sockets, load a model pair or
run for seconds: every test under LIVE_FOLDERS and every test that uses `micro_pair` gets it here; a live test
elsewhere carries `@pytest.mark.live` (or its module's `pytestmark`). The fast tier is everything else:
`python -m pytest -q -n 2 -m "not live and not slow and not netns"`."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LIVE_FOLDERS = {"system", "device", "emulator", "model_pairs", "cli"}
"""Folders whose every test starts processes or sockets, or loads a model pair."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if folder in LIVE_FOLDERS or "micro_pair" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.live)


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
