"""The batched verifier (edge side): one padded forward for many devices equals one pass per device and a
full recomputation; caches roll back to the accepted prefix; greedy speculative output equals the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_node.drafter import OnnxDrafter
from edge_node.verifier import BatchedVerifier, load_target
from model_pairs.training import greedy_generate
from testbed.core.sampling import RoundRandomness, SamplingParams, speculative_round, to_probs


@pytest.fixture(scope="module")
def target(micro_pair):
    torch.set_num_threads(1)
    return load_target(micro_pair.target_dir, device="cpu")


def _full(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def test_batched_equals_per_device_and_full_recompute(target):
    rng = np.random.default_rng(1)
    vocab = target.config.vocab_size
    devices = {f"dev{k}": list(rng.integers(1, vocab, size=n)) for k, n in enumerate([3, 17, 40, 9, 25])}
    batched = BatchedVerifier(target, "cpu")
    singles = {name: BatchedVerifier(target, "cpu") for name in devices}
    ctx = {name: list(map(int, p)) for name, p in devices.items()}
    pending = {name: [] for name in devices}
    for name, prompt in ctx.items():
        batched.open(name, prompt)
        singles[name].open(name, prompt)
    for rnd in range(4):
        items = []
        for k, name in enumerate(devices):
            L = int(1 + (k + rnd) % 6)  # different draft lengths in every batch
            items.append((name, pending[name], list(map(int, rng.integers(1, vocab, size=L)))))
        out = batched.verify(items)
        for (name, pend, drafts), got in zip(items, out):
            (alone,) = singles[name].verify([(name, pend, drafts)])
            assert got.shape == (len(drafts) + 1, vocab) and got.dtype == np.float32
            np.testing.assert_allclose(got, alone, atol=1e-4, rtol=0)
            full = _full(target, ctx[name] + drafts)[len(ctx[name]) - 1:]
            np.testing.assert_allclose(got, full, atol=1e-4, rtol=0)
            n_acc = int(rng.integers(0, len(drafts) + 1))
            nxt = int(rng.integers(1, vocab))
            batched.commit(name, n_acc)
            singles[name].commit(name, n_acc)
            ctx[name] += drafts[:n_acc]
            ctx[name].append(nxt)
            pending[name] = [nxt]
    assert batched.context_length("dev2") == len(ctx["dev2"]) - 1  # the last correction is still pending


def test_sessions_join_and_leave_between_rounds(target):
    v = BatchedVerifier(target, "cpu")
    v.open("a", [5, 6, 7])
    (first,) = v.verify([("a", [], [8, 9])])
    v.commit("a", 2)
    v.open("b", [1, 2])
    out = v.verify([("a", [10], [11]), ("b", [], [3, 4, 5])])
    np.testing.assert_allclose(out[0], _full(target, [5, 6, 7, 8, 9, 10, 11])[-2:], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[1], _full(target, [1, 2, 3, 4, 5])[-4:], atol=1e-4, rtol=0)
    v.close("a")
    with pytest.raises(KeyError, match="'a'"):
        v.verify([("a", [], [1])])


def test_verifier_errors_are_clear(target):
    v = BatchedVerifier(target, "cpu")
    with pytest.raises(ValueError, match="prompt_ids"):
        v.open("x", [])
    v.open("x", [1, 2])
    with pytest.raises(ValueError, match="at most once"):
        v.verify([("x", [], [1]), ("x", [], [2])])
    with pytest.raises(ValueError, match="outside"):
        v.verify([("x", [], [10 ** 7])])
    with pytest.raises(RuntimeError, match="without a preceding verify"):
        v.commit("x", 0)
    v.verify([("x", [], [3, 4])])
    with pytest.raises(RuntimeError, match="before commit"):
        v.verify([("x", [], [3])])
    with pytest.raises(ValueError, match="n_accepted"):
        v.commit("x", 3)


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0, top_k=40)])
def test_speculative_loop_with_onnx_drafter_and_batched_verifier(micro_pair, target, params):
    """Two devices decode together through the real drafter + verifier. Greedy must reproduce the target's
    greedy output exactly; sampled output must equal the uncached reference loop with the same seeds."""
    from transformers import AutoModelForCausalLM

    from model_pairs.training import speculative_generate

    prompts = {"d0": [12, 40, 7, 90, 33], "d1": list(range(50, 80, 3))}
    new_tokens = 24
    drafters = {}
    v = BatchedVerifier(target, "cpu")
    for name, prompt in prompts.items():
        drafters[name] = OnnxDrafter(micro_pair.draft_onnx)
        drafters[name].reset(prompt)
        v.open(name, prompt)
    outs = {name: [] for name in prompts}
    pending = {name: [] for name in prompts}
    rnd = 0
    while min(len(o) for o in outs.values()) < new_tokens:
        items, qs = [], {}
        for name in prompts:
            rr = RoundRandomness(3, name, rnd)
            d = drafters[name].draft(4, params, rr.draft_generator())
            items.append((name, pending[name], d.tokens))
            qs[name] = d.q
        for (name, _, toks), logits in zip(items, v.verify(items)):
            rr = RoundRandomness(3, name, rnd)
            n_acc, nxt = speculative_round(toks, qs[name], to_probs(logits, params), rr)
            drafters[name].commit(n_acc, nxt)
            v.commit(name, n_acc)
            outs[name] += toks[:n_acc] + [nxt]
            pending[name] = [nxt]
        rnd += 1
    draft_model = AutoModelForCausalLM.from_pretrained(str(micro_pair.draft_dir)).eval()
    for name, prompt in prompts.items():
        if params.greedy:
            assert outs[name][:new_tokens] == greedy_generate(target, prompt, new_tokens)
        ref, _ = speculative_generate(target, draft_model, prompt, new_tokens, 4, params, seed=3,
                                      device_name=name)
        assert outs[name][:new_tokens] == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_on_cuda_matches_cpu(micro_pair, target):
    gpu_target = load_target(micro_pair.target_dir, device="cuda")
    gpu, cpu = BatchedVerifier(gpu_target, "cuda"), BatchedVerifier(target, "cpu")
    assert gpu.device.type == "cuda"
    rng = np.random.default_rng(5)
    items = []
    for k, (ctx, L) in enumerate([(5, 1), (30, 4), (12, 6), (44, 2)]):
        prompt = list(map(int, rng.integers(1, gpu.vocab_size, ctx)))
        gpu.open(f"d{k}", prompt)
        cpu.open(f"d{k}", prompt)
        items.append((f"d{k}", [], list(map(int, rng.integers(1, gpu.vocab_size, L)))))
    batched = gpu.verify(items)
    for it, got in zip(items, batched):
        (ref,) = cpu.verify([it])
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_auto_threads_is_one_for_a_small_target_and_torchs_default_for_a_large_one(target, monkeypatch):
    from edge_node import verifier

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        BatchedVerifier(target, "cpu", threads="auto")  # the micro target: far below SMALL_TARGET_PARAMS
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(verifier, "SMALL_TARGET_PARAMS", 1)  # every target is large now: torch's own setting
        BatchedVerifier(target, "cpu", threads="auto")
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="threads='many'"):
            BatchedVerifier(target, "cpu", threads="many")
    finally:
        torch.set_num_threads(before)
