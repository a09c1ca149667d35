"""Wire format and message validation: round trips, and refusals that name the field."""

from __future__ import annotations

import numpy as np
import pytest

from testbed import messages as M
from testbed import protocol as P
from testbed.protocol import ProtocolError
from testbed.sampling import RoundRandomness, count_accepted, sample_correction, sample_from


def _roundtrip(frames):
    # What a receiver sees: bytes per frame.
    return P.decode([bytes(f) if not isinstance(f, bytes) else f for f in frames])


def test_encode_decode_arrays_roundtrip():
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    b = np.array([5, 6], dtype=np.int32)
    header, arrays = _roundtrip(P.encode({"type": "x", "k": 1}, {"a": a, "b": b}))
    assert header["type"] == "x" and header["k"] == 1 and header["v"] == P.PROTOCOL_VERSION
    assert np.array_equal(arrays["a"], a) and arrays["a"].dtype == np.float16
    assert np.array_equal(arrays["b"], b)


@pytest.mark.parametrize("frames, fragment", [
    ([b"\xff\xfe"], "not JSON"),
    ([b"[1, 2]"], "not a JSON object"),
    ([b'{"v": 2, "type": "x"}'], "protocol version 2"),
    ([b'{"v": 1}'], "'type'"),
    ([b'{"v": 1, "type": "x", "arrays": [{"name": "a", "dtype": "float16", "shape": [4]}]}'], "array frames follow"),
    ([b'{"v": 1, "type": "x", "arrays": [{"name": "a", "dtype": "object", "shape": [4]}]}', b"x" * 8], "dtype"),
    ([b'{"v": 1, "type": "x", "arrays": [{"name": "a", "dtype": "float16", "shape": [4]}]}', b"x" * 7], "needs 8"),
    ([b'{"v": 1, "type": "x", "arrays": [{"name": "a", "dtype": "float32", "shape": [100000, 100000]}]}', b""],
     "exceeds the limit"),
    ([b'{"v": 1, "type": "x", "arrays": [{"name": "a", "dtype": "float32", "shape": [-1]}]}', b""], "shape"),
])
def test_decode_refuses_bad_messages(frames, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        P.decode(frames)


def test_header_size_and_frame_count_limits():
    with pytest.raises(ProtocolError, match="exceeds"):
        P.decode([b'{"v":1,"type":"x","pad":"' + b"a" * P.MAX_HEADER_BYTES + b'"}'])
    with pytest.raises(ProtocolError, match="frames"):
        P.decode([P.encode_header({"type": "x"})] + [b""] * P.MAX_FRAMES)


def test_wire_padding_and_stripping():
    q = np.array([[0.5, 0.25, 0.25]], np.float32)
    w = P.to_wire(q, 16, on_air_vocab=8)
    assert w.shape == (1, 8) and w.dtype == np.float16 and not w[:, 3:].any()
    back = P.from_wire(w, 3)
    assert back.dtype == np.float32 and np.array_equal(back, q)
    w[0, 5] = 0.1
    with pytest.raises(ProtocolError, match="beyond the vocabulary"):
        P.from_wire(w, 3)
    with pytest.raises(ProtocolError, match="bits_per_prob 8"):
        P.wire_dtype(8)


def test_check_probs():
    P.check_probs("ok", np.array([[0.5, 0.5]]))
    for rows, fragment in ((np.array([[np.nan, 1.0]]), "NaN"), (np.array([[-0.1, 1.1]]), "negative"),
                           (np.array([[0.5, 0.5], [0.2, 0.2]]), "row 1 sums to 0.4")):
        with pytest.raises(ProtocolError, match=fragment):
            P.check_probs("draft.q", rows)


def _q(L, V, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.random((L, V)).astype(np.float32)
    return q / q.sum(axis=1, keepdims=True)


def test_draft_message_ul_and_dl():
    q = _q(3, 50)
    toks = [1, 7, 49]
    for mode in ("UL", "DL"):
        frames = M.draft(4, mode, toks, q, last_token=9, bits_per_prob=16, on_air_vocab=64, timings={"draft_s": 0.1})
        header, arrays = _roundtrip(frames)
        assert header["air"] == "ul"
        d = M.parse_draft(header, arrays, mode=mode, draft_len=3, vocab_size=50, bits_per_prob=16, on_air_vocab=64)
        assert d.tokens.tolist() == toks and d.last_token == 9
        # Both modes give the edge the same q values at the drafted tokens (the wire precision).
        assert np.array_equal(d.q_at, P.quantize(q[np.arange(3), toks], 16))
        if mode == "UL":
            assert d.q_rows.shape == (3, 50)
        else:
            assert d.q_rows is None and arrays["q_at"].nbytes == 6


def test_draft_validation_names_fields():
    q = _q(2, 50)
    header, arrays = _roundtrip(M.draft(0, "UL", [1, 2], q, last_token=0, bits_per_prob=16, on_air_vocab=None,
                                        timings={}))
    kw = dict(mode="UL", draft_len=2, vocab_size=50, bits_per_prob=16, on_air_vocab=None)
    with pytest.raises(ProtocolError, match="draft.mode"):
        M.parse_draft(header, arrays, **{**kw, "mode": "DL"})
    with pytest.raises(ProtocolError, match=r"draft.tokens.*shape \(3,\)"):
        M.parse_draft(header, arrays, **{**kw, "draft_len": 3})
    with pytest.raises(ProtocolError, match=r"draft.q.*float32"):
        M.parse_draft(header, arrays, **{**kw, "bits_per_prob": 32})
    with pytest.raises(ProtocolError, match="ids must be in"):
        M.parse_draft(header, {**arrays, "tokens": np.array([1, 60], np.int32)}, **kw)
    bad = np.full((2, 50), np.nan, np.float16)
    with pytest.raises(ProtocolError, match="NaN"):
        M.parse_draft(header, {**arrays, "q": bad}, **kw)
    zero_at = P.to_wire(q, 16).copy()
    zero_at[0, 1] = 0
    zero_at[0] /= zero_at[0].sum()
    with pytest.raises(ProtocolError, match="q = 0"):
        M.parse_draft(header, {**arrays, "q": zero_at.astype(np.float16)}, **kw)
    header2 = dict(header, last_token=99)
    with pytest.raises(ProtocolError, match="draft.last_token"):
        M.parse_draft(header2, arrays, **kw)


def test_verdict_and_schedule_validation():
    p = _q(1, 40)[0]
    h, a = _roundtrip(M.verdict(3, 1, None, p_row=p, bits_per_prob=16, on_air_vocab=64))
    assert h["air"] == "dl"
    v = M.parse_verdict(h, a, draft_len=4, vocab_size=40, bits_per_prob=16, on_air_vocab=64)
    assert v.token is None and np.array_equal(v.p_row, P.quantize(p, 16))
    with pytest.raises(ProtocolError, match="verdict.n_accepted"):
        M.parse_verdict(h, a, draft_len=0, vocab_size=40, bits_per_prob=16, on_air_vocab=64)
    h, a = _roundtrip(M.dropped(3, "late"))
    assert M.parse_verdict(h, a, draft_len=4, vocab_size=40, bits_per_prob=16, on_air_vocab=None).dropped
    h, _ = _roundtrip(M.schedule(2, "DL", 5, 0.2, 0.1, 3.0))
    s = M.parse_schedule(h, max_draft_len=8)
    assert (s.round, s.mode, s.draft_len) == (2, "DL", 5)
    with pytest.raises(ProtocolError, match="schedule.draft_len: 5 is not allowed"):
        M.parse_schedule(h, max_draft_len=4)
    with pytest.raises(ProtocolError, match="schedule.mode"):
        M.parse_schedule(dict(h, mode="XX"), max_draft_len=8)
    with pytest.raises(ProtocolError, match="register.name"):
        M.parse_register({"type": "register", "name": "a b/c", "vocab_size": 3})


def test_ul_and_dl_decision_paths_agree_over_many_rounds():
    """The edge's UL path and the DL split (edge accept + device correction via the wire) give the same
    tokens: both use the wire-precision values of p and q and the same round randomness."""
    rng = np.random.default_rng(1)
    V, L = 30, 4
    for r in range(300):
        q = _q(L, V, seed=r)
        p = _q(L + 1, V, seed=10_000 + r)
        rr = RoundRandomness(5, "dev", r)
        toks = np.array([int(rng.integers(V)) for _ in range(L)])
        q[np.arange(L), toks] += 0.05
        q /= q.sum(axis=1, keepdims=True)
        # UL: everything at the edge from the received rows.
        hu, au = _roundtrip(M.draft(r, "UL", toks, q, last_token=0, bits_per_prob=16, on_air_vocab=None, timings={}))
        du = M.parse_draft(hu, au, mode="UL", draft_len=L, vocab_size=V, bits_per_prob=16, on_air_vocab=None)
        pq = P.quantize(p, 16)
        n_ul = count_accepted(toks, du.q_at, pq[np.arange(L), toks], rr.acceptance_uniforms(L))
        tok_ul = sample_correction(pq[n_ul], du.q_rows[n_ul], rr.final_uniform()) if n_ul < L \
            else sample_from(pq[L], rr.final_uniform())
        # DL: edge accepts from scalars, device corrects with its own q and the downloaded p.
        hd, ad = _roundtrip(M.draft(r, "DL", toks, q, last_token=0, bits_per_prob=16, on_air_vocab=None, timings={}))
        dd = M.parse_draft(hd, ad, mode="DL", draft_len=L, vocab_size=V, bits_per_prob=16, on_air_vocab=None)
        n_dl = count_accepted(toks, dd.q_at, pq[np.arange(L), toks], rr.acceptance_uniforms(L))
        assert n_dl == n_ul
        if n_dl < L:
            hv, av = _roundtrip(M.verdict(r, n_dl, None, p_row=pq[n_dl], bits_per_prob=16))
            v = M.parse_verdict(hv, av, draft_len=L, vocab_size=V, bits_per_prob=16, on_air_vocab=None)
            tok_dl = sample_correction(v.p_row, P.quantize(q[n_dl], 16), rr.final_uniform())
        else:
            tok_dl = sample_from(pq[L], rr.final_uniform())
        assert tok_dl == tok_ul, r
