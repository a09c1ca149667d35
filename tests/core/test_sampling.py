"""Losslessness of the speculative-sampling primitives: exact enumeration, chi-square tests, UL == DL."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy import stats
from support import output_and_target, toy_model

from testbed.core.sampling import (
    WIRE_DTYPES,
    RoundRandomness,
    SamplingParams,
    count_accepted,
    exact_from_wire,
    sample_correction,
    sample_from,
    speculative_round,
    to_half,
    to_probs,
    to_wire_precision,
)

# --- transforms -------------------------------------------------------------------------------------------


def test_to_probs_rows_sum_to_one_and_keep_dtype():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
    for params in (SamplingParams(), SamplingParams(0.7, 4, 0.9), SamplingParams(2.0, 0, 0.5)):
        p = to_probs(logits, params)
        assert p.dtype == np.float32 and p.shape == logits.shape
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
        assert (p >= 0).all()


def test_temperature_one_is_softmax_and_temperature_scales():
    x = np.array([1.0, 2.0, 0.5, -1.0])
    e = np.exp(x - x.max())
    np.testing.assert_allclose(to_probs(x, SamplingParams()), e / e.sum(), rtol=1e-14)
    e2 = np.exp((x - x.max()) / 0.5)
    np.testing.assert_allclose(to_probs(x, SamplingParams(0.5)), e2 / e2.sum(), rtol=1e-14)


def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    p = to_probs(np.array([[0.1, 3.0, 3.0, -2.0]]), SamplingParams(temperature=0))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_keeps_exactly_k_largest():
    x = np.array([0.0, 5.0, 1.0, 4.0, 2.0])
    p = to_probs(x, SamplingParams(top_k=2))
    assert np.flatnonzero(p).tolist() == [1, 3]
    np.testing.assert_allclose(p[[1, 3]], np.exp([5.0, 4.0]) / np.exp([5.0, 4.0]).sum())


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    # (exact boundaries such as top_p = 0.8 = 0.5 + 0.3 are at the mercy of rounding: test either side)
    assert np.flatnonzero(to_probs(logits, SamplingParams(top_p=0.49))).tolist() == [0]
    assert np.flatnonzero(to_probs(logits, SamplingParams(top_p=0.51))).tolist() == [0, 1]
    assert np.flatnonzero(to_probs(logits, SamplingParams(top_p=0.79))).tolist() == [0, 1]
    assert np.flatnonzero(to_probs(logits, SamplingParams(top_p=0.81))).tolist() == [0, 1, 2]
    np.testing.assert_allclose(to_probs(logits, SamplingParams(top_p=0.79))[:2], [0.625, 0.375])


@pytest.mark.parametrize("kwargs,field", [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
                                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                          ({"temperature": float("nan")}, "temperature")])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# --- primitives and edge cases ----------------------------------------------------------------------------


def test_p_zero_always_rejects_even_with_u_zero():
    assert count_accepted([3], [0.5], [0.0], [0.0]) == 0


def test_q_zero_for_a_drafted_token_is_an_error():
    with pytest.raises(ValueError, match="q_at_tokens"):
        count_accepted([3], [0.0], [0.5], [0.1])


def test_count_accepted_stops_at_first_rejection():
    # ratios 1, 0.5, 1 with u = 0.9, 0.6, 0.0 -> accept, reject (0.6 >= 0.5): 1 accepted
    assert count_accepted([0, 1, 2], [0.2, 0.4, 0.1], [0.3, 0.2, 0.5], [0.9, 0.6, 0.0]) == 1
    assert count_accepted([0, 1, 2], [0.2, 0.4, 0.1], [0.3, 0.2, 0.5], [0.9, 0.4, 0.99]) == 3


def test_correction_never_samples_where_p_le_q():
    p = np.array([0.5, 0.2, 0.3, 0.0])
    q = np.array([0.1, 0.6, 0.3, 0.0])
    for u in np.linspace(0, 1, 1001, endpoint=False):
        assert sample_correction(p, q, u) == 0  # residual (0.4, 0, 0, 0)


def test_correction_with_p_equal_q_falls_back_to_p():
    p = np.array([0.25, 0.0, 0.75])
    assert sample_correction(p, p.copy(), 0.1) == 0
    assert sample_correction(p, p.copy(), 0.5) == 2


def test_sample_from_never_picks_zero_mass_entries():
    p = np.array([0.0, 0.3, 0.0, 0.7, 0.0])
    got = {sample_from(p, u) for u in np.linspace(0, 1, 10001, endpoint=False)}
    assert got == {1, 3}
    assert sample_from(p, np.nextafter(1.0, 0.0)) == 3


def test_round_randomness_is_deterministic_and_separated():
    a, b = RoundRandomness(5, "dev-1", 3), RoundRandomness(5, "dev-1", 3)
    np.testing.assert_array_equal(a.acceptance_uniforms(6), b.acceptance_uniforms(6))
    np.testing.assert_array_equal(a.acceptance_uniforms(6)[:2], b.acceptance_uniforms(2))
    assert a.final_uniform() == b.final_uniform()
    others = [RoundRandomness(5, "dev-2", 3), RoundRandomness(5, "dev-1", 4), RoundRandomness(6, "dev-1", 3)]
    for o in others:
        assert o.final_uniform() != a.final_uniform()
    with pytest.raises(ValueError, match="device"):
        RoundRandomness(1, "", 0)
    with pytest.raises(ValueError, match="round_index"):
        RoundRandomness(1, "d", -1)


def test_shape_errors_are_clear():
    rr = RoundRandomness(0, "d", 0)
    with pytest.raises(ValueError, match="p_rows shape"):
        speculative_round([1, 2], np.full((2, 4), 0.25), np.full((2, 4), 0.25), rr)
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_round([7], np.full((1, 4), 0.25), np.full((2, 4), 0.25), rr)


# --- exact enumeration ------------------------------------------------------------------------------------
# The code's random choices are deterministic functions of uniforms and piecewise constant between known
# breakpoints, so evaluating them at interval midpoints and weighting by interval lengths gives the exact
# output distribution of the code itself.










def _wire_model(model, bits: int):
    """The model as both ends use it at `bits` bits: exact_from_wire(to_wire_precision(row))."""
    return functools.lru_cache(maxsize=None)(lambda prefix: exact_from_wire(to_wire_precision(model(prefix), bits)))




@pytest.mark.parametrize("vocab,draft_len,params,peaky", [
    (4, 2, SamplingParams(1.0), 1.5),
    (5, 2, SamplingParams(0.8, top_k=3), 2.0),
    (4, 3, SamplingParams(1.3, top_p=0.8), 1.0),
    (8, 1, SamplingParams(1.0), 3.0),
    (5, 2, SamplingParams(0.0), 1.0),  # greedy
])
def test_exact_enumeration_output_equals_target(vocab, draft_len, params, peaky):
    """P(first n output tokens = s) equals the target's prod p(s_i | s_<i) to 1e-12, for n = draft_len + 1,
    over as many rounds as it takes (each round is enumerated exactly)."""
    p_model = toy_model(vocab, 11, params, peaky)
    q_model = toy_model(vocab, 22, params, peaky)
    got, target = output_and_target(vocab, draft_len, p_model, q_model)
    assert abs(sum(got.values()) - 1) < 1e-12
    for seq in set(got) | set(target):
        assert abs(got.get(seq, 0.0) - target.get(seq, 0.0)) < 1e-12, seq
    if params.greedy:
        assert len(target) == 1 and got == pytest.approx(target)




@pytest.mark.parametrize("vocab,draft_len,params,peaky", [
    (4, 2, SamplingParams(1.0), 1.5),
    (5, 2, SamplingParams(0.8, top_k=4), 3.0),
    (6, 1, SamplingParams(1.0), 4.0),
])
def test_exact_enumeration_wire_exact_16_bit_output_equals_wire_target(vocab, draft_len, params, peaky):
    """Drafting from q16 = exact_from_wire(to_wire_precision(q, 16)) and verifying with q16 and
    p16 = exact_from_wire(to_wire_precision(p, 16)) outputs exactly p16's distribution (to 1e-12), also
    where entries of p or q are positive in float64 but 0 in float16."""
    p32 = toy_model(vocab, 11, params, peaky, tiny=True)
    q32 = toy_model(vocab, 22, params, peaky, tiny=True)
    p16, q16 = _wire_model(p32, 16), _wire_model(q32, 16)
    got, target = output_and_target(vocab, draft_len, p16, q16)
    assert abs(sum(got.values()) - 1) < 1e-12
    for seq in set(got) | set(target):
        assert abs(got.get(seq, 0.0) - target.get(seq, 0.0)) < 1e-12, seq
    # the case the fix is about occurs: entries > 0 before the wire and 0 after it, in p and in q
    for model in (p32, q32):
        rows = [model(pre) for pre in [(), *((x,) for x in range(vocab)),
                                       *((x, y) for x in range(vocab) for y in range(vocab))]]
        assert any(((r > 0) & (to_wire_precision(r, 16) == 0)).any() for r in rows)


def test_exact_enumeration_detects_verifying_with_another_q():
    """Negative control: sampling drafts from q but verifying with the (unnormalised, rounded) float16 copy
    of q, the old defect, moves the output away from the target by far more than 1e-12."""
    params = SamplingParams(1.0)
    p_model = toy_model(4, 11, params, 1.5)
    q_model = toy_model(4, 22, params, 1.5)
    q_wire_copy = functools.lru_cache(maxsize=None)(lambda pre: q_model(pre).astype(np.float16).astype(np.float64))
    got, target = output_and_target(4, 2, p_model, q_model, q_wire_copy)
    assert max(abs(got.get(s, 0.0) - target.get(s, 0.0)) for s in set(got) | set(target)) > 1e-7


# --- the wire precision -----------------------------------------------------------------------------------


def test_wire_precision_and_exact_rows():
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.full(1000, 0.05), size=4)
    probs[:, :3] = 1e-11  # positive, but 0 in float16
    probs /= probs.sum(axis=1, keepdims=True)
    for bits, dtype in WIRE_DTYPES.items():
        w = to_wire_precision(probs, bits)
        assert w.dtype == dtype
        q = exact_from_wire(w)
        assert q.dtype == np.float64
        np.testing.assert_allclose(q.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        # bit-identical for one row or a stack, whatever the memory layout of the wire rows
        for i in range(4):
            assert np.array_equal(exact_from_wire(w[i]), q[i])
        assert np.array_equal(exact_from_wire(np.asfortranarray(w)), q)
        padded = np.pad(w, [(0, 0), (0, 37)])[:, :1000]
        assert np.array_equal(exact_from_wire(padded), q)
    w16 = to_wire_precision(probs, 16)
    assert (w16[:, :3] == 0).all() and (exact_from_wire(w16)[:, :3] == 0).all()
    with pytest.raises(ValueError, match="bits=8"):
        to_wire_precision(probs, 8)
    with pytest.raises(ValueError, match="positive sum"):
        exact_from_wire(np.zeros((2, 3), np.float16))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_half_cast_is_numpys_cast_bit_for_bit(dtype):
    """`to_half` replaces numpy's cast on the hot path: any bit pattern (subnormal halves, ties, overflow, NaN,
    signed zeros) gives the very bits numpy gives."""
    rng = np.random.default_rng(11)
    uint = np.uint32 if dtype == np.float32 else np.uint64
    anything = rng.integers(0, np.iinfo(uint).max, size=200_000, dtype=uint, endpoint=True).view(dtype)
    # Around float16's subnormal range, densely: exact ties between two halves, their neighbours, and values
    # whose float32 rounding would make a tie (a cast through float32 would round those twice).
    ties = (np.arange(0, 2050) + 0.5) * 2.0 ** -24
    near = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 1), ties * (1 + 2.0 ** -30),
                           rng.uniform(0, 2.0 ** -13, 100_000), np.logspace(-40, 5, 10_000)]).astype(dtype)
    with np.errstate(all="ignore"):
        x = np.concatenate([anything, near, -near, [0.0, -0.0, np.inf, -np.inf, 65519.99, 65520.0]]).astype(dtype)
        expected, got = x.astype(np.float16), to_half(x)
        stacked = to_half(x.reshape(-1, 2))
    assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))
    assert np.array_equal(stacked.view(np.uint16), expected.reshape(-1, 2).view(np.uint16))
    scalar = np.asarray(dtype(3e-6))  # a 0-d array
    assert to_half(scalar).view(np.uint16) == scalar.astype(np.float16).view(np.uint16)


# --- chi-square tests -------------------------------------------------------------------------------------
# Each test is one chi-square goodness-of-fit test at false-alarm rate 1e-3 (6 cases: family-wise < 0.6%).
# Seeds are fixed, so the outcome is reproducible.

def _cases():
    v = 8
    r = np.random.default_rng(3)
    p = r.dirichlet(np.ones(v))
    q = r.dirichlet(np.ones(v))
    disjoint_p = np.array([0.4, 0.3, 0.3, 0, 0, 0, 0, 0])
    disjoint_q = np.array([0, 0, 0, 0.1, 0.2, 0.3, 0.2, 0.2])
    one_hot_q = np.eye(v)[5]
    q_zero = np.array([0.5, 0.5, 0, 0, 0, 0, 0, 0])  # q = 0 where p > 0
    near_zero_p = np.array([0.6, 0.3999, 1e-4, 0, 0, 0, 0, 0])
    near_zero_q = np.array([1e-6, 0.2, 0.799999, 0, 0, 0, 0, 0])
    return {
        "random": (p, q), "p_equals_q": (p, p.copy()), "disjoint": (disjoint_p, disjoint_q),
        "one_hot_q": (p, one_hot_q), "q_zero_where_p_positive": (p, q_zero),
        "near_zero": (near_zero_p, near_zero_q),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_chi_square_first_token_is_target_distributed(case):
    p, q = _cases()[case]
    rounds = 8000
    counts = np.zeros(len(p), int)
    accepted = 0
    for r in range(rounds):
        rr = RoundRandomness(2024, f"chi-{case}", r)
        x = sample_from(q, float(rr.draft_generator().random()))
        n_acc, nxt = speculative_round([x], q[None], np.stack([p, p]), rr)
        counts[x if n_acc == 1 else nxt] += 1
        accepted += n_acc
    assert counts[p == 0].sum() == 0  # never a token the target cannot produce
    support = p > 0
    expected = p[support] * rounds
    # pool cells with expected count < 5 into one (near-zero probabilities)
    small = expected < 5
    obs = np.append(counts[support][~small], counts[support][small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) > 1:
        pval = stats.chisquare(obs, exp).pvalue
        assert pval > 1e-3, (case, counts, p)
    # the acceptance count agrees with beta = sum min(p, q) (binomial, two-sided, false alarm 1e-3)
    beta = float(np.minimum(p, q).sum())
    if 0 < beta < 1:
        assert stats.binomtest(accepted, rounds, beta).pvalue > 1e-3
    else:
        assert accepted == round(beta * rounds)


# --- UL mode and DL mode give the same tokens -------------------------------------------------------------


def test_ul_and_dl_modes_produce_identical_tokens_over_1000_rounds():
    rng = np.random.default_rng(99)
    v = 32
    rejections = 0
    for r in range(1000):
        L = int(rng.integers(1, 7))
        params = SamplingParams(float(rng.choice([0.0, 0.7, 1.0, 1.5])), int(rng.choice([0, 8])),
                                float(rng.choice([1.0, 0.9])))
        q_logits = rng.normal(size=(L, v)).astype(np.float32)
        p_logits = (q_logits[:, :] * 0.8 + rng.normal(size=(L, v)) * 0.6).astype(np.float32)
        p_rows = to_probs(np.vstack([p_logits, rng.normal(size=(1, v)).astype(np.float32)]), params)
        # device: drafts from its q with the round's drafting stream
        dev_rr = RoundRandomness(7, f"dev-{r % 5}", r)
        g = dev_rr.draft_generator()
        q_rows = to_probs(q_logits, params)
        drafts = [sample_from(q_rows[i], float(g.random())) for i in range(L)]

        # UL mode: everything at the edge
        ul = speculative_round(drafts, q_rows, p_rows, RoundRandomness(7, f"dev-{r % 5}", r))

        # DL mode: edge gets only scalars q_i(x_i); on rejection sends p_j; device corrects with its q_j
        edge_rr = RoundRandomness(7, f"dev-{r % 5}", r)
        idx = np.arange(L)
        q_scalars = q_rows[idx, drafts]  # what the device uploads
        j = count_accepted(drafts, q_scalars, p_rows[idx, drafts], edge_rr.acceptance_uniforms(L))
        if j < L:
            rejections += 1
            p_j = p_rows[j].copy()  # downlink payload
            dl = (j, sample_correction(p_j, q_rows[j], RoundRandomness(7, f"dev-{r % 5}", r).final_uniform()))
        else:
            dl = (j, sample_from(p_rows[L], edge_rr.final_uniform()))
        assert ul == dl, r
    assert 100 < rejections < 1000  # both branches exercised
