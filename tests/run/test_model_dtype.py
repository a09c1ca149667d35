"""`model.dtype`: the edge verifies with the target in the precision the profile names. At temperature 0 a
bfloat16 run's tokens are the bfloat16 target's greedy decoding (lossless against the target it verified
with), and the run records the precision it ran at.

Real processes on private sockets, micro model pair."""

from __future__ import annotations

import json

import pytest
import torch
from support import profile_data

from edge_node.verifier import load_target
from model_pairs.training import greedy_generate
from testbed.run.launcher import load_tokenizer
from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.run.session import encode_prompts


def test_a_bfloat16_run_gives_the_bfloat16_targets_greedy_tokens(micro_pair, tmp_path):
    data = profile_data(micro_pair, rounds=4, policy="fixed-length", fixed_length=3,
                        sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0})
    data["model"] |= {"dtype": "bfloat16", "threads": 1}
    summary = run_live(load_profile(data), tmp_path / "run", progress=False)
    assert summary["status"] == "complete"
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["target"] == {"dtype": "bfloat16", "device": "cpu", "threads": 1}  # what the edge verified with
    target = load_target(micro_pair.target_dir, device="cpu", dtype="bfloat16")
    assert next(target.parameters()).dtype == torch.bfloat16
    tokenizer = load_tokenizer(str(micro_pair.tokenizer))
    outputs = json.loads((tmp_path / "run" / "outputs.json").read_text())
    with torch.inference_mode():
        for name, entry in outputs.items():
            got = [int(t) for t in entry["output_ids"]]
            assert got, name
            assert got == greedy_generate(target, encode_prompts(tokenizer, [entry["prompt"]])[0], len(got)), name


def test_an_unknown_dtype_is_refused_at_load(micro_pair):
    data = profile_data(micro_pair)
    data["model"]["dtype"] = "int4"
    with pytest.raises(ValueError, match="model.dtype"):
        load_profile(data)
