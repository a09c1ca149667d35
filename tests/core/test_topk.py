"""Top-k uploads (`payload_format: topk`, `topk_choices`): the draft distribution is q truncated to its top k
entries, uploaded as k (index, probability) pairs per position. Lossless (exact enumeration, chi-square),
UL == DL through the real messages, the bytes on the air equal the model's payload, the optimizer's choice
of k and the controller's acceptance per (device, k)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy import stats
from support import output_and_target, toy_model

from edge_node.controller import Controller
from testbed.core import model, payload
from testbed.core.optimizer import plan
from testbed.core.sampling import (
    DraftParams,
    RoundRandomness,
    SamplingParams,
    exact_from_wire,
    sample_correction,
    sample_from,
    to_probs,
    to_wire_precision,
    truncate_top_k,
    verify_draft,
)
from testbed.core.scenario import Scenario, ScenarioError
from testbed.core.simulate import run_task
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire import sparse
from testbed.wire.protocol import ProtocolError


def _roundtrip(frames):
    """What a receiver sees: the frames as bytes, decoded."""
    return P.decode([bytes(f) if not isinstance(f, bytes) else f for f in frames])


def _device_draft(q_logits, params, bits, rng):
    """A device's drafting as OnnxDrafter does it: q = exact_from_wire(wire(to_probs(logits))), token ~ q."""
    wire = to_wire_precision(to_probs(np.asarray(q_logits, np.float32), params), bits)
    q = exact_from_wire(wire)
    return [sample_from(q[i], float(rng.random())) for i in range(len(q))], q, wire


def _edge_q(wire_rows, k, bits_per_prob=16, on_air=None):
    """The q rows the edge rebuilds from a top-k UL upload of these wire rows (the real message path)."""
    L, v = wire_rows.shape
    frames = M.draft(0, "UL", [0] * L, exact_from_wire(wire_rows), q_wire=wire_rows, last_token=0,
                     bits_per_prob=bits_per_prob, on_air_vocab=on_air, timings={}, topk=k)
    header, arrays = _roundtrip(frames)
    rows = sparse.decode(arrays["q_ids"], arrays["q_p"], draft_len=L, k=k, bits=sparse.id_bits(max(v, on_air or 0)),
                         vocab_size=v, bits_per_prob=bits_per_prob)
    return exact_from_wire(rows)


# --- the truncation ---------------------------------------------------------------------------------------


def test_truncate_keeps_the_k_largest_and_renormalizes():
    p = np.array([[0.1, 0.3, 0.05, 0.3, 0.25], [0.5, 0.5, 0.0, 0.0, 0.0]])
    t = truncate_top_k(p, 2)
    np.testing.assert_allclose(t[0], [0, 0.5, 0, 0.5, 0])  # tie 0.3 / 0.3 kept, 0.25 dropped
    np.testing.assert_allclose(t[1], p[1])  # no more than k positive entries: unchanged
    assert np.array_equal(truncate_top_k(np.array([0.25, 0.25, 0.25, 0.25]), 2), [0.5, 0.5, 0, 0])  # lower index
    assert np.array_equal(truncate_top_k(p, 5), p) and truncate_top_k(p.astype(np.float32), 2).dtype == np.float32
    with pytest.raises(ValueError, match="k=0"):
        truncate_top_k(p, 0)
    with pytest.raises(ValueError, match="payload_topk"):
        DraftParams(1.0, 0, 1.0, -1)


def test_draft_params_truncate_after_temperature_top_k_and_top_p():
    logits = np.random.default_rng(1).normal(size=(4, 40)).astype(np.float32)
    base = SamplingParams(0.8, 30, 0.95)
    q = to_probs(logits, DraftParams.of(base, 8))
    assert np.array_equal(q, truncate_top_k(to_probs(logits, base), 8))
    assert ((q > 0).sum(axis=1) <= 8).all() and ((to_probs(logits, base) > 0).sum(axis=1) > 8).all()
    assert DraftParams.of(base, None) is base and DraftParams.of(base, 0) is base
    greedy = to_probs(logits, DraftParams.of(SamplingParams(0.0), 3))  # one-hot stays one-hot
    assert np.array_equal(greedy, to_probs(logits, SamplingParams(0.0)))


# --- the wire format --------------------------------------------------------------------------------------


def test_id_packing_roundtrips_at_b_id_bits():
    rng = np.random.default_rng(2)
    for v in (2, 5, 320, 4096, 151936):
        bits = sparse.id_bits(v)
        assert bits == model.bits_per_id(v) or v <= 1
        for n in (1, 7, 64, 1000):
            ids = rng.integers(0, v, n)
            packed = sparse.pack_ids(ids, bits)
            assert packed.dtype == np.uint8 and packed.size == sparse.packed_bytes(n, bits) == -(-n * bits // 8)
            assert np.array_equal(sparse.unpack_ids(packed, n, bits), ids)


@pytest.mark.parametrize("v_model,v_air,k,L,bits", [
    (4096, 151936, 64, 4, 16), (4096, 151936, 16, 3, 16), (4096, None, 256, 8, 32), (320, None, 16, 5, 16),
    (320, 4096, 7, 3, 16),  # L k b_id = 252 bits: not whole bytes, the last byte padded
])
def test_top_k_upload_bytes_equal_the_model_payload(v_model, v_air, k, L, bits):
    """The distributions of a top-k UL upload take ceil(L k b_id / 8) + L k b_p / 8 bytes on the air: the
    model's L x distribution_bits (L k (b_id + b_p) bits, b_id from the on-air V), exactly when L k b_id is a
    whole number of bytes, else at most 7 bits more. What else crosses the air is the header and the int32
    token ids, as in a dense upload: the model's H and b_id per token."""
    logits = np.random.default_rng(k).normal(size=(L, v_model)).astype(np.float32)
    toks, q, wire = _device_draft(logits, DraftParams(1.0, 0, 1.0, k), bits, np.random.default_rng(0))
    frames = M.draft(3, "UL", toks, q, q_wire=wire, last_token=1, bits_per_prob=bits, on_air_vocab=v_air,
                     timings={"draft_s": 0.01}, topk=k)
    header, arrays = _roundtrip(frames)
    sc = Scenario.from_dict({"vocab_size": v_air or v_model, "bits_per_prob": bits, "payload_format": "topk",
                             "topk_k": k, "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.01,
                                                       "acceptance": 0.7}]})
    model_bits = L * model.distribution_bits(sc)
    b_id = model.bits_per_id(v_air or v_model)
    assert model_bits == L * k * (b_id + bits)
    q_bytes = arrays["q_ids"].nbytes + arrays["q_p"].nbytes
    assert q_bytes == -(-L * k * b_id // 8) + L * k * bits // 8
    assert 0 <= 8 * q_bytes - model_bits < 8 and (8 * q_bytes == model_bits) == (L * k * b_id % 8 == 0)
    on_air = sum(len(bytes(f)) for f in frames)
    assert on_air == len(bytes(frames[0])) + 4 * L + q_bytes  # header + int32 tokens + the distributions
    d = M.parse_draft(header, arrays, mode="UL", draft_len=L, vocab_size=v_model, bits_per_prob=bits,
                      on_air_vocab=v_air, topk=k)
    assert d.q_bytes == q_bytes and d.topk == k
    assert np.array_equal(d.q_rows, q)  # the very rows the tokens were sampled from, bit for bit
    assert np.array_equal(d.q_at, q[np.arange(L), toks])


def _valid_upload(L=3, v=50, k=4, v_air=128):
    logits = np.random.default_rng(9).normal(size=(L, v)).astype(np.float32)
    toks, q, wire = _device_draft(logits, DraftParams(1.0, 0, 1.0, k), 16, np.random.default_rng(3))
    frames = M.draft(1, "UL", toks, q, q_wire=wire, last_token=2, bits_per_prob=16, on_air_vocab=v_air,
                     timings={}, topk=k)
    header, arrays = _roundtrip(frames)
    return header, {name: a.copy() for name, a in arrays.items()}, toks


def _parse(header, arrays, **kw):
    args = dict(mode="UL", draft_len=3, vocab_size=50, bits_per_prob=16, on_air_vocab=128, topk=4) | kw
    return M.parse_draft(header, arrays, **args)


def test_top_k_uploads_are_refused_with_the_field_named():
    header, arrays, toks = _valid_upload()
    bits = sparse.id_bits(128)  # 7 bits: 12 ids take 84 bits, 4 padding bits in the last byte
    _parse(header, arrays)  # the valid one passes
    with pytest.raises(ProtocolError, match="draft.topk: 4 .*scheduled topk 8"):
        _parse(header, arrays, topk=8)
    with pytest.raises(ProtocolError, match="draft.topk: 4 .*dense draft"):
        _parse(header, arrays, topk=None)
    with pytest.raises(ProtocolError, match=r"draft.q_ids: None"):
        _parse(header, {k: v for k, v in arrays.items() if k != "q_ids"})
    with pytest.raises(ProtocolError, match=r"draft.q_p: \('float32'"):
        _parse(header, {**arrays, "q_p": arrays["q_p"].astype(np.float32)})
    ids = sparse.unpack_ids(arrays["q_ids"], 12, bits).reshape(3, 4)
    for bad, match in ((55, r"id 55 is not allowed; ids must be in \[0, 50\)"),  # beyond V, inside V_air
                       (int(ids[0, 1]), "row 0 repeats an id")):
        forged = ids.copy()
        forged[0, 0] = bad
        with pytest.raises(ProtocolError, match=match):
            _parse(header, {**arrays, "q_ids": sparse.pack_ids(forged, bits)})
    values = arrays["q_p"].copy()
    values[1] *= 2
    with pytest.raises(ProtocolError, match="draft.q_p: row 1 sums to"):
        _parse(header, {**arrays, "q_p": values})
    values = arrays["q_p"].copy()
    values[0, 0] = np.nan
    with pytest.raises(ProtocolError, match="NaN"):
        _parse(header, {**arrays, "q_p": values})
    # a drafted token outside its row's ids: q = 0 at a token that was sampled from q, impossible honestly
    forged = ids.copy()
    forged[0] = [t for t in range(50) if t != toks[0] and t not in ids[0]][:4]
    with pytest.raises(ProtocolError, match="a drafted token has q = 0"):
        _parse(header, {**arrays, "q_ids": sparse.pack_ids(forged, bits), "q_p": np.full_like(arrays["q_p"], 0.25)})
    padded = arrays["q_ids"].copy()
    spare = padded.size * 8 - 12 * bits
    assert spare > 0
    padded[-1] |= 1
    with pytest.raises(ProtocolError, match="padding bits"):
        _parse(header, {**arrays, "q_ids": padded})


def test_a_drafter_without_the_truncation_is_refused_at_the_sender():
    wire = to_wire_precision(to_probs(np.random.default_rng(0).normal(size=(2, 30)), SamplingParams()), 16)
    with pytest.raises(ValueError, match="more than k=4.*DraftParams"):
        M.draft(0, "UL", [0, 1], exact_from_wire(wire), q_wire=wire, last_token=0, bits_per_prob=16,
                on_air_vocab=None, timings={}, topk=4)


def test_schedule_carries_topk():
    h, _ = _roundtrip(M.schedule(5, "UL", 3, 0.2, 0.0, 4.0, topk=64))
    assert M.parse_schedule(h, 8, vocab_size=320).topk == 64
    h, _ = _roundtrip(M.schedule(5, "DL", 3, 0.2, 0.0, 4.0))
    assert "topk" not in h and M.parse_schedule(h, 8).topk is None
    h, _ = _roundtrip(M.schedule(5, "UL", 3, 0.2, 0.0, 4.0, topk=400))
    with pytest.raises(ProtocolError, match=r"schedule.topk: 400 .*1\.\.320"):
        M.parse_schedule(h, 8, vocab_size=320)


# --- lossless: exact enumeration ---------------------------------------------------------------------------
# As tests/core/test_sampling.py: the code's output distribution computed exactly (interval midpoints of every
# uniform), compared with the target's to 1e-12. Drafts are sampled from the device's truncated q at the wire
# precision; accept/reject and the correction use the q the edge rebuilds from the top-k upload.


def _edge_model(device_q_wire, k):
    return functools.lru_cache(maxsize=None)(lambda prefix: _edge_q(device_q_wire(prefix)[None], k)[0])


@pytest.mark.parametrize("vocab,k,draft_len,params,peaky", [
    (5, 2, 2, SamplingParams(1.0), 1.5),
    (6, 3, 2, SamplingParams(0.8, top_k=4), 2.0),
    (5, 2, 3, SamplingParams(1.3, top_p=0.9), 1.0),
    (8, 1, 1, SamplingParams(1.0), 3.0),  # k = 1: the draft is the argmax, accepted with probability p(x)
    (5, 4, 2, SamplingParams(0.0), 1.0),  # greedy
])
def test_exact_enumeration_top_k_output_equals_target(vocab, k, draft_len, params, peaky):
    p32 = toy_model(vocab, 11, params, peaky)
    q32 = toy_model(vocab, 22, DraftParams.of(params, k), peaky)  # truncated after temperature/top-k/top-p
    p16 = functools.lru_cache(maxsize=None)(lambda pre: exact_from_wire(to_wire_precision(p32(pre), 16)))
    q_wire = functools.lru_cache(maxsize=None)(lambda pre: to_wire_precision(q32(pre), 16))
    q_device = functools.lru_cache(maxsize=None)(lambda pre: exact_from_wire(q_wire(pre)))
    got, target = output_and_target(vocab, draft_len, p16, q_device, _edge_model(q_wire, k))
    assert abs(sum(got.values()) - 1) < 1e-12
    for seq in set(got) | set(target):
        assert abs(got.get(seq, 0.0) - target.get(seq, 0.0)) < 1e-12, seq
    # the truncation is real: q has at most k positive entries where the untruncated q has more
    rows = [((),), *(((x,),) for x in range(vocab))]
    assert all((q_device(*r) > 0).sum() <= k for r in rows)
    if not params.greedy:
        untruncated = toy_model(vocab, 22, params, peaky)
        assert any((untruncated(*r) > 0).sum() > k for r in rows)


def test_exact_enumeration_detects_verifying_with_the_untruncated_q():
    """Negative control: drafting from the top-k q but verifying with the full q (the lossy variant's
    mistake) moves the output away from the target by far more than 1e-12."""
    params = SamplingParams(1.0)
    p = toy_model(5, 11, params, 1.5)
    q_full = toy_model(5, 22, params, 1.5)
    q_top = toy_model(5, 22, DraftParams.of(params, 2), 1.5)
    got, target = output_and_target(5, 2, p, q_top, q_full)
    assert max(abs(got.get(s, 0.0) - target.get(s, 0.0)) for s in set(got) | set(target)) > 1e-4


# --- lossless: chi-square ---------------------------------------------------------------------------------
# One chi-square goodness-of-fit test of the output token and one binomial test of the accepted count per
# case, each at false-alarm rate 1e-3 (4 cases x 2 tests: family-wise < 0.8%); seeds fixed.

def _chi_cases():
    r = np.random.default_rng(4)
    v = 12
    return {"random_k4": (r.dirichlet(np.ones(v)), r.normal(size=v), 4),
            "peaked_k2": (r.dirichlet(np.full(v, 0.3)), 2 * r.normal(size=v), 2),
            "disjoint_k3": (np.r_[np.full(6, 1 / 6), np.zeros(6)], np.r_[np.zeros(6), r.normal(size=6)], 3),
            "k_equals_v": (r.dirichlet(np.ones(v)), r.normal(size=v), v)}


@pytest.mark.parametrize("case", list(_chi_cases()))
def test_chi_square_top_k_first_token_is_target_distributed(case):
    p, q_logits, k = _chi_cases()[case]
    q_logits = np.where(q_logits == 0, -1e30, q_logits)[None]
    p_rows = np.stack([p, p])
    rounds, counts, accepted = 6000, np.zeros(len(p), int), 0
    q_k = None
    for r in range(rounds):
        rr = RoundRandomness(2025, f"topk-{case}", r)
        toks, q_dev, wire = _device_draft(q_logits, DraftParams(1.0, 0, 1.0, k), 16, rr.draft_generator())
        header, arrays = _roundtrip(M.draft(r, "UL", toks, q_dev, q_wire=wire, last_token=0, bits_per_prob=16,
                                            on_air_vocab=4096, timings={}, topk=k))
        d = M.parse_draft(header, arrays, mode="UL", draft_len=1, vocab_size=len(p), bits_per_prob=16,
                          on_air_vocab=4096, topk=k)
        v = verify_draft(p_rows, d.q_at, d.q_rows, d.tokens, "UL", rr)
        counts[toks[0] if v.n_accepted == 1 else v.token] += 1
        accepted += v.n_accepted
        q_k = d.q_rows[0]
    assert (q_k > 0).sum() <= k
    assert counts[p == 0].sum() == 0
    support = p > 0
    pval = stats.chisquare(counts[support], p[support] * rounds).pvalue
    assert pval > 1e-3, (case, counts)
    beta = float(np.minimum(p, q_k).sum())  # acceptance of the truncated q
    assert stats.binomtest(accepted, rounds, beta).pvalue > 1e-3


# --- UL mode and DL mode give the same tokens -------------------------------------------------------------


def test_ul_and_dl_give_identical_tokens_with_top_k_over_1000_rounds():
    """Through the real messages at 16 bits and an on-air vocabulary: UL (the edge corrects with the q it
    rebuilds from the top-k upload) and DL (the edge accepts from q_at, the device corrects with its own
    truncated q and the downloaded p_j) give the same tokens round after round."""
    rng = np.random.default_rng(77)
    v, v_air, bits = 48, 4096, 16
    rejections = 0
    for r in range(1000):
        L = int(rng.integers(1, 6))
        k = int(rng.choice([1, 3, 8, 20, 48]))
        params = DraftParams(float(rng.choice([0.0, 0.7, 1.0, 1.5])), int(rng.choice([0, 12])),
                             float(rng.choice([1.0, 0.9])), k)
        q_logits = rng.normal(size=(L, v))
        p_logits = q_logits * 0.8 + rng.normal(size=(L, v)) * 0.6
        p_wire = to_wire_precision(to_probs(np.vstack([p_logits, rng.normal(size=(1, v))]).astype(np.float32),
                                            SamplingParams(params.temperature, params.top_k, params.top_p)), bits)
        p_rows = exact_from_wire(p_wire)
        name = f"dev-{r % 5}"
        toks, q_dev, wire = _device_draft(q_logits, params, bits, RoundRandomness(7, name, r).draft_generator())
        out = {}
        for mode in ("UL", "DL"):
            h, a = _roundtrip(M.draft(r, mode, toks, q_dev, q_wire=wire, last_token=0, bits_per_prob=bits,
                                      on_air_vocab=v_air, timings={}, topk=k))
            d = M.parse_draft(h, a, mode=mode, draft_len=L, vocab_size=v, bits_per_prob=bits, on_air_vocab=v_air,
                              topk=k)
            verdict = verify_draft(p_rows, d.q_at, d.q_rows, d.tokens, mode, RoundRandomness(7, name, r))
            token = verdict.token
            if token is None:  # DL rejection: p_j down, the device corrects with its own q_j
                hv, av = _roundtrip(M.verdict(r, verdict.n_accepted, None, p_row=p_wire[verdict.n_accepted],
                                              bits_per_prob=bits, on_air_vocab=v_air))
                pv = M.parse_verdict(hv, av, draft_len=L, vocab_size=v, bits_per_prob=bits, on_air_vocab=v_air)
                token = sample_correction(pv.p_row, q_dev[verdict.n_accepted],
                                          RoundRandomness(7, name, r).final_uniform())
                rejections += 1
            out[mode] = (verdict.n_accepted, token)
        assert out["UL"] == out["DL"], r
    assert 200 < rejections < 1000  # both branches exercised


# --- the model, the optimizer's choice of k, the controller's estimates -----------------------------------


def _scenario(**kw) -> Scenario:
    data = {"vocab_size": 151936, "bits_per_prob": 16, "uplink_bandwidth_hz": 1e6, "downlink_bandwidth_hz": 2e7,
            "devices": [{"name": n, "distance_m": d, "draft_time_s": t, "acceptance": a}
                        for n, d, t, a in (("a", 100, 0.02, 0.75), ("b", 250, 0.03, 0.7), ("c", 400, 0.04, 0.8))]}
    return Scenario.from_dict(data | kw)


def test_the_target_distribution_stays_dense_on_the_downlink():
    sc = _scenario(payload_format="topk", topk_k=64)
    ev = model.evaluate(sc, ["DL"] * 3, [3] * 3)
    assert np.allclose(ev.dl_bits, model.bits_index(3) + 151936 * 16)  # p_j: dense V b_p, not top-k
    assert model.distribution_bits(sc) == 64 * (18 + 16)


def test_a_plain_option_is_its_own_scenario_and_the_others_are_rebuilt():
    """`option_scenario` returns the scenario itself where its rebuild would equal it (dense, no choices, no
    ratio, no estimate: the live controller's usual round) and rebuilds it otherwise."""
    sc = _scenario()
    assert payload.option_scenario(sc, None) is sc
    est = payload.option_scenario(sc, None, {sc.devices[0].name: 0.42})
    assert est is not sc and est.devices[0].acceptance == 0.42 and est.devices[1:] == sc.devices[1:]
    topk = _scenario(payload_format="topk", topk_k=16)
    assert payload.option_scenario(topk, 16) is topk
    as_dense = payload.option_scenario(topk, None)
    assert as_dense.payload_format == "dense" and as_dense.devices == topk.devices
    ratio = _scenario(payload_format="topk", topk_k=16, topk_acceptance_ratio={16: 0.5})
    halved = payload.option_scenario(ratio, 16)
    np.testing.assert_allclose(halved.device_array("acceptance"), 0.5 * ratio.device_array("acceptance"))


def test_the_plan_chooses_the_upload_among_dense_and_each_k():
    ratios = {16: 0.8, 64: 0.92, 256: 0.98, 1024: 0.995}
    sc = _scenario(topk_choices=[16, 64, 256, 1024], topk_acceptance_ratio=ratios)
    p = plan(sc, "proposed")
    got = {o["k"]: o["goodput_tps"] for o in p.info["payload"]["options"]}
    # each option is the policy's plan of the option's scenario (acceptance x its ratio, its payload)
    for k in (None, 16, 64, 256, 1024):
        opt = payload.option_scenario(sc, k)
        alone = plan(opt, "proposed")
        assert got[k] == pytest.approx(alone.goodput_tps, rel=1e-12)
        np.testing.assert_allclose(opt.device_array("acceptance"),
                                   sc.device_array("acceptance") * (1 if k is None else ratios[k]))
    assert p.goodput_tps == max(got.values()) and p.info["payload"]["k"] == max(got, key=got.get)
    assert p.info["payload"]["k"] is not None and p.goodput_tps > got[None]  # a 1 MHz uplink: top-k wins
    assert p.scenario.payload_format == "topk" and p.scenario.topk_k == p.info["payload"]["k"]
    ul = np.array(p.modes) == "UL"
    assert ul.any() and np.allclose(p.evaluation.ul_bits[ul], p.evaluation.draft_lens[ul]
                                    * (18 + p.info["payload"]["k"] * (18 + 16)))
    # a fast uplink and a truncation that costs acceptance: dense wins
    fast = _scenario(uplink_bandwidth_hz=1e9, topk_choices=[16], topk_acceptance_ratio={16: 0.5})
    assert plan(fast, "proposed").info["payload"]["k"] is None
    # the live estimates replace the prior per option
    low = {16: {"a": 0.05, "b": 0.05, "c": 0.05}}
    assert plan(_scenario(topk_choices=[16]), "proposed", acceptance_by_option=low).info["payload"]["k"] is None
    # no choices, dense: the plan is the policy's plan of the scenario itself (no payload entry)
    assert "payload" not in plan(_scenario(), "proposed").info


def test_simulate_rows_record_the_chosen_k_and_monte_carlo_uses_its_acceptance():
    sc = _scenario(topk_choices=[64], topk_acceptance_ratio={64: 0.9})
    rows = run_task(sc, "ul_bandwidth", 0, 1e6, 0, policies=["proposed", "all-dl"], monte_carlo_rounds=400)
    by = {r["policy"]: r for r in rows}
    assert by["proposed"]["topk_k"] == 64 and by["all-dl"]["topk_k"] is None  # DL mode gains nothing from k
    # Monte Carlo agrees with the prediction of the plan it runs (its acceptance and payload), within 4 SEM
    r = by["proposed"]
    assert abs(r["mc_goodput_tps"] - r["goodput_tps"]) < 4 * r["mc_goodput_sem"] + 0.02 * r["goodput_tps"]


def test_the_controller_learns_acceptance_per_device_and_k():
    sc = _scenario(topk_choices=[16, 256], topk_acceptance_ratio={16: 0.9})
    ctl = Controller(sc, alpha_prior_trials=8)
    assert ctl.alpha_topk("a", 16) == pytest.approx(0.75 * 0.9) and ctl.alpha_topk("a", 256) == 0.75
    for _ in range(40):  # device a drafting from its top 16 rejects at once; its dense rounds are untouched
        ctl.observe_acceptance("a", 0, 4, topk=16)
    ctl.observe_acceptance("a", 4, 4, topk=256)
    assert ctl.alpha_topk("a", 16) < 0.2 and ctl.est["a"].alpha == 0.75 and ctl.est["a"].trials == 0
    assert ctl.alpha_topk("b", 16) == pytest.approx(0.7 * 0.9)
    # k = 256's prior is its ratio (1) x the dense alpha that the k = 16 rounds tell (0 successes / 0.9 in 40
    # trials), then its own round: the rounds of one k inform every other k of the device
    dense = (0.75 * 8 + 0 / 0.9) / (8 + 40)
    assert ctl.alpha_topk("a", 256) == pytest.approx((dense * 8 + 4) / 12)
    assert ctl.alpha_dense("a") == pytest.approx((0.75 * 8 + 4) / (8 + 44))
    prior_16 = ctl.alpha_topk("b", 16)
    ctl.observe_acceptance("b", 4, 4)  # a dense round moves the dense alpha, and the top-k prior with it
    assert ctl.est["b"].alpha > 0.7 and ctl.alpha_topk("b", 16) > prior_16
    rp = ctl.plan_round(0, ["a", "b", "c"])
    assert rp.estimates["a"]["alpha_topk"]["16"] == pytest.approx(ctl.alpha_topk("a", 16))
    options = {o["k"]: o["goodput_tps"] for o in rp.plan["payload"]["options"]}
    assert set(options) == {None, 16, 256} and rp.topk == rp.plan["payload"]["k"]
    # the plan's scenario is the chosen option's, with its estimates
    if rp.topk is not None:
        assert rp.scenario.topk_k == rp.topk
        assert rp.scenario.device_array("acceptance")[0] == pytest.approx(ctl.alpha_topk("a", rp.topk), abs=1e-9)


def test_a_pinned_schedule_still_chooses_the_upload():
    sc = _scenario(topk_choices=[64])
    ctl = Controller(sc, pin_mode="UL", pin_draft_len=3)
    rp = ctl.plan_round(0, ["a", "b", "c"])
    assert rp.topk == 64 and all(d.mode == "UL" and d.draft_len == 3 for d in rp.per_device.values())
    assert rp.per_device["a"].ul_bits == pytest.approx(3 * (18 + 64 * 34) + ctl.header_bits)


def test_topk_k_is_refused_where_it_would_be_ignored_naming_payload_format():
    with pytest.raises(ScenarioError, match=r"topk_k: 64 is not allowed with payload_format 'dense'.*payload_format: "
                                            r"topk"):
        _scenario(topk_k=64)
    _scenario(topk_k=1024)  # the default: a dumped and rebuilt dense scenario carries it
    sc = _scenario(payload_format="topk", topk_k=64, topk_choices=[16, 64])  # the plan picks; k of the options
    dense = payload.option_scenario(sc, None)
    assert dense.payload_format == "dense" and payload.topk_of(dense) is None
    assert payload.option_scenario(_scenario(payload_format="topk", topk_k=64), None).payload_format == "dense"
    assert Scenario.from_dict(_scenario(payload_format="topk", topk_k=64).model_dump()).topk_k == 64
