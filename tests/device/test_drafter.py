"""The ONNX drafter (device side): logits equal PyTorch's at every step, also after rollback; q is exactly
the distribution each draft token was sampled from; it is a `Drafter`; the device never imports torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from device_node.drafter import OnnxDrafter
from device_node.drafting import Draft, Drafter
from testbed.core.sampling import (
    RoundRandomness,
    SamplingParams,
    exact_from_wire,
    sample_from,
    to_probs,
    to_wire_precision,
)
from testbed.wire import messages as M
from testbed.wire import protocol as P


@pytest.fixture(scope="module")
def torch_draft(micro_pair):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(micro_pair.draft_dir)).eval()


def _ref_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def test_onnx_logits_match_pytorch_every_step_including_after_rollback(micro_pair, torch_draft):
    d = OnnxDrafter(micro_pair.draft_onnx, threads=1)
    prompt = list(range(3, 40, 2))
    d.reset(prompt)
    rng = np.random.default_rng(0)
    params = SamplingParams(1.0)
    ctx = list(prompt)
    # cover full acceptance (cache keeps L-1, last draft re-fed), zero acceptance and partial acceptance
    plan = [(4, 4), (3, 0), (5, 2), (1, 1), (2, 0), (6, 6), (4, 3)]
    for n, n_acc in plan:
        draft = d.draft(n, params, rng)
        toks, q = draft.tokens, draft.q
        assert isinstance(draft, Draft) and draft.wire is None and len(toks) == n
        ref = _ref_logits(torch_draft, ctx + toks[:-1])[len(ctx) - 1:]
        assert d.last_logits.shape == ref.shape == (n, d.vocab_size)
        np.testing.assert_allclose(d.last_logits, ref, atol=1e-4, rtol=0)
        # q rows are the transforms of exactly these logits, and they produced the tokens
        np.testing.assert_array_equal(q, to_probs(d.last_logits.astype(np.float32), params))
        assert q.dtype == np.float32
        assert all(q[i, t] > 0 for i, t in enumerate(toks))
        nxt = int(rng.integers(d.vocab_size))
        d.commit(n_acc, nxt)
        ctx += toks[:n_acc] + [nxt]
        assert d.context == ctx
        assert d.cache_length <= len(ctx) - 1
    trace = d.logits_trace(ctx)
    np.testing.assert_allclose(trace, _ref_logits(torch_draft, ctx), atol=1e-4, rtol=0)
    assert d.context == ctx  # the trace leaves the state alone


def test_greedy_drafts_equal_pytorch_greedy(micro_pair, torch_draft):
    d = OnnxDrafter(micro_pair.draft_onnx)
    prompt = [10, 20, 30, 40]
    d.reset(prompt)
    draft = d.draft(8, SamplingParams(temperature=0), np.random.default_rng(0))
    toks, q = draft.tokens, draft.q
    ctx = list(prompt)
    for _ in range(8):
        ctx.append(int(_ref_logits(torch_draft, ctx)[-1].argmax()))
    assert toks == ctx[len(prompt):]
    assert (q.max(axis=1) == 1.0).all()


def test_drafting_is_reproducible_from_round_randomness(micro_pair):
    runs = []
    for _ in range(2):
        d = OnnxDrafter(micro_pair.draft_onnx)
        d.reset([1, 2, 3])
        out = []
        for r in range(3):
            draft = d.draft(3, SamplingParams(0.9, top_k=50), RoundRandomness(4, "dev", r).draft_generator())
            d.commit(1, 7)
            out.append(draft.tokens)
        runs.append(out)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("bits", [16, 32])
def test_wire_bits_tokens_are_sampled_from_the_returned_wire_exact_q(micro_pair, bits):
    """With wire_bits, each token is sampled from q_exact = exact_from_wire(wire row), the rows returned;
    they sum to 1 within 1e-12, equal exact_from_wire(wire) bit for bit, and are what the edge parses
    from the upload (UL) or receives at the tokens (DL). A low temperature makes float16 underflow happen."""
    d = OnnxDrafter(micro_pair.draft_onnx)
    d.reset([5, 9, 13, 17])
    underflow = 0
    for r, params in enumerate([SamplingParams(0.25), SamplingParams(1.0), SamplingParams(0.5, top_p=0.95)]):
        gen = RoundRandomness(8, "dev", r).draft_generator()
        draft = d.draft(5, params, gen, wire_bits=bits)
        toks, q, w = draft.tokens, draft.q, draft.wire
        assert q.dtype == np.float64 and w.dtype == np.dtype(f"float{bits}") and w.shape == q.shape == (5, d.vocab_size)
        # the wire rows are the transform of this round's logits cast once, q is f of them, bit for bit
        q32 = to_probs(d.last_logits.astype(np.float32), params)
        assert np.array_equal(w, to_wire_precision(q32, bits))
        assert np.array_equal(q, exact_from_wire(w))
        np.testing.assert_allclose(q.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        underflow += int(((q32 > 0) & (q == 0)).sum())
        # the tokens are the inverse-CDF samples of these rows with the round's uniforms...
        again = RoundRandomness(8, "dev", r).draft_generator()
        assert toks == [sample_from(q[i], float(again.random())) for i in range(5)]
        # ...so each token's distribution is its row: the code's token as a function of u, enumerated
        for row in q[:2]:
            cdf = np.cumsum(row) / row.sum()
            lo = np.concatenate([[0.0], cdf[:-1]])
            mass = np.zeros_like(row)
            for a, b in zip(lo, cdf):
                if b > a:
                    mass[sample_from(row, min((a + b) / 2, np.nextafter(1.0, 0.0)))] += b - a
            np.testing.assert_allclose(mass, row, rtol=0, atol=1e-12)
        assert all(q[i, t] > 0 for i, t in enumerate(toks))
        # the edge sees exactly these values through the messages, in both modes
        for mode in ("UL", "DL"):
            frames = M.draft(r, mode, toks, q, q_wire=w, last_token=0, bits_per_prob=bits,
                             on_air_vocab=d.vocab_size + 64, timings={})
            got = M.parse_draft(*P.decode([bytes(f) for f in frames]), mode=mode, draft_len=5,
                                vocab_size=d.vocab_size, bits_per_prob=bits, on_air_vocab=d.vocab_size + 64)
            assert np.array_equal(got.q_at, q[np.arange(5), toks])
            if mode == "UL":
                assert np.array_equal(got.q_rows, q)
        d.commit(2, toks[2])
    if bits == 16:
        assert underflow > 0  # entries > 0 in float32 that the wire (and the sampling) makes 0
    draft = d.draft(2, SamplingParams(), np.random.default_rng(0))  # without wire_bits: as before
    assert draft.wire is None and draft.q.dtype == np.float32


def test_onnx_drafter_is_a_drafter(micro_pair):
    assert isinstance(OnnxDrafter(micro_pair.draft_onnx), Drafter)


def test_drafter_errors_are_clear(micro_pair, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.onnx"):
        OnnxDrafter(tmp_path / "nothere.onnx")
    (tmp_path / "garbage.onnx").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="garbage.onnx: not a loadable ONNX model"):
        OnnxDrafter(tmp_path / "garbage.onnx")
    d = OnnxDrafter(micro_pair.draft_onnx)
    with pytest.raises(RuntimeError, match="reset"):
        d.draft(2, SamplingParams(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="prompt_ids"):
        d.reset([])
    with pytest.raises(ValueError, match="outside"):
        d.reset([d.vocab_size])
    d.reset([1, 2])
    with pytest.raises(RuntimeError, match="commit"):
        d.commit(0, 1)
    with pytest.raises(ValueError, match="n="):
        d.draft(0, SamplingParams(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="wire_bits=8"):
        d.draft(2, SamplingParams(), np.random.default_rng(0), wire_bits=8)
    d.draft(2, SamplingParams(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="n_accepted"):
        d.commit(3, 1)
    with pytest.raises(RuntimeError, match="twice"):
        d.draft(2, SamplingParams(), np.random.default_rng(0))


def test_device_side_imports_no_torch(micro_pair):
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from device_node.drafter import OnnxDrafter\n"
        "from testbed.core.sampling import SamplingParams, sample_correction\n"
        f"d = OnnxDrafter({str(micro_pair.draft_onnx)!r})\n"
        "d.reset([1, 2, 3]); d.draft(2, SamplingParams(), np.random.default_rng(0))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
