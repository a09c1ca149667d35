"""The default pair shipped as package data: intact, unpacked into a fresh cache in seconds as a pair that
loads and drafts like its float16 weights say, packed back to the same bytes, and refused when damaged."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from model_pairs.cache import ensure_default_pair
from model_pairs.model_pair import DEFAULT_CONFIG, load_manifest, verify_files
from model_pairs.shipped_pair import (
    SHIPPED_MANIFEST,
    SHIPPED_ROOT,
    ShippedPairError,
    find_shipped,
    load_shipped,
    materialize,
    pack,
)

SHIPPED = find_shipped(DEFAULT_CONFIG)
PROMPT = [17, 402, 9, 1310, 77, 58, 2048, 3, 990, 41]


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """The default pair as `multispin run` gets it on a machine with an empty cache."""
    return ensure_default_pair(tmp_path_factory.mktemp("cache"), progress=False, threads=1)


def test_shipped_pair_matches_its_manifest():
    assert SHIPPED is not None, f"no shipped pair for config {DEFAULT_CONFIG.config_hash()} under {SHIPPED_ROOT}"
    m = load_shipped(SHIPPED)  # raises on any size or sha256 mismatch
    assert m["name"] == DEFAULT_CONFIG.name and m["config_hash"] == DEFAULT_CONFIG.config_hash()
    listed = {p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*") if p.is_file()}
    assert listed - {SHIPPED_MANIFEST} == set(m["files"])  # nothing ships unchecked
    build = m["build"]
    assert build["config_hash"] == m["config_hash"] and build["files"]["target/model.safetensors"]["sha256"]
    # the rounded pair was evaluated like the build and accepts no less, beyond the noise of 210 paired rounds
    assert m["evaluation"]["acceptance_rate"] >= build["acceptance_rate"] - 0.03


def test_unpacked_pair_loads_and_drafts_like_its_float16_weights(cached):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from device_node.drafter import OnnxDrafter
    from edge_node.verifier import load_target
    from model_pairs.training import greedy_generate
    from testbed.core.sampling import SamplingParams

    assert verify_files(cached) == []
    manifest = load_manifest(cached.root)
    assert manifest["config_hash"] == DEFAULT_CONFIG.config_hash() and manifest["shipped"]["manifest"]["files"]
    for role in ("target", "draft"):  # float32 in the cache, exactly the shipped float16 values
        half = load_file(str(SHIPPED / role / "model.safetensors"))
        full = load_file(str(cached.root / role / "model.safetensors"))
        assert half.keys() == full.keys()
        for k, t in half.items():
            assert t.dtype == torch.float16 and full[k].dtype == torch.float32
            assert torch.equal(t.float(), full[k]), k

    torch.set_num_threads(1)
    target = load_target(cached.target_dir, device="cpu")
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([PROMPT])).logits
    assert logits.shape == (1, len(PROMPT), manifest["vocab_size"]) and torch.isfinite(logits).all()

    # reference: a draft built from the shipped config and float16 file, widened here
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SHIPPED / "draft"))
    keys = ref.load_state_dict(
        {k: v.float() for k, v in load_file(str(SHIPPED / "draft" / "model.safetensors")).items()}, strict=False)
    assert set(keys.missing_keys) <= {"lm_head.weight"} and not keys.unexpected_keys  # lm_head is tied, not stored
    ref.tie_weights()
    ref.eval()
    drafter = OnnxDrafter(cached.draft_onnx)
    drafter.reset(PROMPT)
    got = drafter.draft(12, SamplingParams(0.0), np.random.default_rng(0)).tokens
    assert got == greedy_generate(ref, PROMPT, 12)


def test_pack_of_the_unpacked_pair_gives_the_shipped_bytes(cached, tmp_path):
    dest = pack(cached.root, tmp_path)
    again, shipped = load_shipped(dest), load_shipped(SHIPPED)
    assert dest.name == SHIPPED.name
    assert again["files"] == shipped["files"] and again["build"] == shipped["build"]
    assert again["evaluation"] == shipped["evaluation"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_shipped_file_is_a_clear_error(tmp_path, monkeypatch, damage):
    import model_pairs.shipped_pair as sp

    copy = tmp_path / "pairs" / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    f = copy / "draft" / "model.safetensors"
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-2])
    else:
        f.unlink()
    reason = {"flip": "sha256", "truncate": "bytes", "remove": "missing"}[damage]
    with pytest.raises(ShippedPairError, match=rf"draft/model\.safetensors.*{reason}"):
        materialize(copy, tmp_path / "direct")
    # through ensure_default_pair too: an error, not a silent ten-minute build
    monkeypatch.setattr(sp, "SHIPPED_ROOT", copy.parent)
    cache = tmp_path / "cache"
    with pytest.raises(ShippedPairError, match=r"draft/model\.safetensors"):
        ensure_default_pair(cache, progress=False)
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())
    assert not (tmp_path / "direct").exists()


def test_shipped_manifest_that_is_not_one_is_refused(tmp_path):
    copy = tmp_path / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    (copy / SHIPPED_MANIFEST).write_text(json.dumps({"kind": "something-else", "files": {}}))
    with pytest.raises(ShippedPairError, match="not a shipped-pair manifest"):
        load_shipped(copy)


def test_cli_info_names_the_shipped_weights(cached, capsys):
    from testbed.cli import main

    assert main(["models", "info", "--dir", str(cached.root), "--check"]) == 0
    out = capsys.readouterr().out
    assert "float16 as shipped" in out and "match the manifest" in out
