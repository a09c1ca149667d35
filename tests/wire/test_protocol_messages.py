"""Wire format and message validation: round trips, and refusals that name the field."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.core.sampling import (
    RoundRandomness,
    count_accepted,
    exact_from_wire,
    sample_correction,
    sample_from,
    to_wire_precision,
)
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire import validate as VAL
from testbed.wire.protocol import ProtocolError


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
    q = np.array([[0.5, 0.2, 0.3]], np.float32)
    rows = to_wire_precision(q, 16)
    w = P.to_wire(rows, 16, on_air_vocab=8)
    assert w.shape == (1, 8) and w.dtype == np.float16 and not w[:, 3:].any()
    back = VAL.from_wire(w, 3)
    # the receiver gets exactly what the sender computes from its unpadded rows
    assert back.dtype == np.float64 and np.array_equal(back, exact_from_wire(rows))
    assert np.array_equal(back, exact_from_wire(to_wire_precision(q, 16)))
    w[0, 5] = 0.1
    with pytest.raises(ProtocolError, match="beyond the vocabulary"):
        VAL.from_wire(w, 3)
    with pytest.raises(ProtocolError, match="bits_per_prob 8"):
        P.wire_dtype(8)
    # rows not at the wire precision are refused, not rounded again (that could change them)
    with pytest.raises(ValueError, match="dtype float32; bits_per_prob 16 needs float16"):
        P.to_wire(q, 16)


def test_check_probs():
    VAL.check_rows("ok", np.array([[0.5, 0.5]]))
    for rows, fragment in ((np.array([[np.nan, 1.0]]), "NaN"), (np.array([[-0.1, 1.1]]), "negative"),
                           (np.array([[0.5, 0.5], [0.2, 0.2]]), "row 1 sums to 0.4")):
        with pytest.raises(ProtocolError, match=fragment):
            VAL.check_rows("draft.q", rows)


def _q(L, V, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.random((L, V)).astype(np.float32)
    return q / q.sum(axis=1, keepdims=True)


def test_draft_message_ul_and_dl():
    wire = to_wire_precision(_q(3, 50), 16)
    q_exact = exact_from_wire(wire)  # what the drafter sampled from
    toks = [1, 7, 49]
    for mode in ("UL", "DL"):
        frames = M.draft(4, mode, toks, q_exact, q_wire=wire, last_token=9, bits_per_prob=16, on_air_vocab=64,
                         timings={"draft_s": 0.1})
        header, arrays = _roundtrip(frames)
        assert header["air"] == "ul"
        d = M.parse_draft(header, arrays, mode=mode, draft_len=3, vocab_size=50, bits_per_prob=16, on_air_vocab=64)
        assert d.tokens.tolist() == toks and d.last_token == 9
        # Both modes give the edge the drafter's own q values at the drafted tokens, bit for bit.
        assert d.q_at.dtype == np.float64 and np.array_equal(d.q_at, q_exact[np.arange(3), toks])
        if mode == "UL":
            assert np.array_equal(d.q_rows, q_exact) and np.array_equal(arrays["q"][:, :50], wire)
        else:
            assert d.q_rows is None and arrays["q_at"].dtype == np.float64 and arrays["q_at"].nbytes == 24
    # neither mode re-rounds or sends a q that is not the one the tokens were sampled from
    with pytest.raises(ValueError, match="dtype float32"):
        M.draft(4, "UL", toks, q_exact, q_wire=_q(3, 50), last_token=9, bits_per_prob=16, on_air_vocab=64, timings={})
    with pytest.raises(ValueError, match="q_wire"):
        M.draft(4, "UL", toks, q_exact, last_token=9, bits_per_prob=16, on_air_vocab=64, timings={})
    with pytest.raises(ValueError, match="q_rows: dtype float32"):
        M.draft(4, "DL", toks, _q(3, 50), last_token=9, bits_per_prob=16, on_air_vocab=64, timings={})


def test_draft_validation_names_fields():
    q = _q(2, 50)
    w = to_wire_precision(q, 16)
    header, arrays = _roundtrip(M.draft(0, "UL", [1, 2], exact_from_wire(w), q_wire=w, last_token=0,
                                        bits_per_prob=16, on_air_vocab=None, timings={}))
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
    zero_at = to_wire_precision(q, 16)
    zero_at[0, 1] = 0
    zero_at[0] /= zero_at[0].sum()
    with pytest.raises(ProtocolError, match="q = 0"):
        M.parse_draft(header, {**arrays, "q": zero_at.astype(np.float16)}, **kw)
    header2 = dict(header, last_token=99)
    with pytest.raises(ProtocolError, match="draft.last_token"):
        M.parse_draft(header2, arrays, **kw)
    # DL: q_at must be float64 in (0, 1]
    hd, ad = _roundtrip(M.draft(0, "DL", [1, 2], exact_from_wire(w), last_token=0, bits_per_prob=16,
                                on_air_vocab=None, timings={}))
    kd = {**kw, "mode": "DL"}
    M.parse_draft(hd, ad, **kd)
    with pytest.raises(ProtocolError, match=r"draft.q_at.*must be float64"):
        M.parse_draft(hd, {**ad, "q_at": ad["q_at"].astype(np.float16)}, **kd)
    for bad_q in ([0.0, 0.5], [0.5, 1.0 + 1e-9], [np.nan, 0.5]):
        with pytest.raises(ProtocolError, match=r"draft.q_at.*\(0, 1\]"):
            M.parse_draft(hd, {**ad, "q_at": np.array(bad_q)}, **kd)


def test_verdict_and_schedule_validation():
    p = _q(1, 40)[0]
    h, a = _roundtrip(M.verdict(3, 1, None, p_row=to_wire_precision(p, 16), bits_per_prob=16, on_air_vocab=64))
    assert h["air"] == "dl"
    v = M.parse_verdict(h, a, draft_len=4, vocab_size=40, bits_per_prob=16, on_air_vocab=64)
    # the edge's p_exact, bit for bit
    assert v.token is None and np.array_equal(v.p_row, exact_from_wire(to_wire_precision(p, 16)))
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


def _draft_from(q32_rows, gen, bits):
    """The drafter's sampling (device_node/drafter.py): each row through the wire, the token from q_exact."""
    wire = to_wire_precision(q32_rows, bits)
    toks = [sample_from(exact_from_wire(w), float(gen.random())) for w in wire]
    return np.array(toks), wire


def _edge_round(p32, bits, toks, q_at, q_rows, rr):
    """The edge's decision (edge_node/server.py _decide): (n, token or None, p wire rows)."""
    p_wire = to_wire_precision(p32, bits)
    p = exact_from_wire(p_wire)
    L = len(toks)
    n = count_accepted(toks, q_at, p[np.arange(L), toks], rr.acceptance_uniforms(L))
    if n == L:
        return n, sample_from(p[L], rr.final_uniform()), p_wire
    if q_rows is not None:  # UL: the edge corrects
        return n, sample_correction(p[n], q_rows[n], rr.final_uniform()), p_wire
    return n, None, p_wire


def test_ul_and_dl_decision_paths_agree_over_many_rounds():
    """Through the real message encode/parse path at 16 bits, UL (the edge corrects with the uploaded rows)
    and DL (the edge accepts from q_at scalars, the device corrects with its own q_exact and the downloaded p)
    give the same tokens, also when many q and p entries underflow to 0 in float16."""
    V, L, bits = 30, 4, 16
    rejections = underflow_rows = 0
    for r in range(300):
        q32 = _q(L, V, seed=r)
        p32 = _q(L + 1, V, seed=10_000 + r)
        if r % 2:  # peaked rows: entries > 0 in float32 that are 0 in float16 (and low-mass tails)
            q32 = q32 ** 12
            q32[:, : V // 3] = 1e-9
            q32 /= q32.sum(axis=1, keepdims=True)
            p32 = (p32 ** 8).astype(np.float32)
            p32[:, V // 2:] = 1e-10
            p32 /= p32.sum(axis=1, keepdims=True)
        underflow_rows += int(((q32 > 0) & (to_wire_precision(q32, bits) == 0)).any(axis=1).sum())
        device = f"dev-{r % 3}"
        toks, q_wire = _draft_from(q32, RoundRandomness(5, device, r).draft_generator(), bits)
        q_exact = exact_from_wire(q_wire)  # the device keeps these for a DL correction
        # UL: everything at the edge from the received rows.
        hu, au = _roundtrip(M.draft(r, "UL", toks, q_exact, q_wire=q_wire, last_token=0, bits_per_prob=bits,
                                    on_air_vocab=32, timings={}))
        du = M.parse_draft(hu, au, mode="UL", draft_len=L, vocab_size=V, bits_per_prob=bits, on_air_vocab=32)
        assert np.array_equal(du.q_rows, q_exact)
        n_ul, tok_ul, _ = _edge_round(p32, bits, du.tokens, du.q_at, du.q_rows, RoundRandomness(5, device, r))
        # DL: edge accepts from scalars; on a rejection the device corrects with its own q and the downloaded p.
        hd, ad = _roundtrip(M.draft(r, "DL", toks, q_exact, q_wire=q_wire, last_token=0, bits_per_prob=bits,
                                    on_air_vocab=32, timings={}))
        dd = M.parse_draft(hd, ad, mode="DL", draft_len=L, vocab_size=V, bits_per_prob=bits, on_air_vocab=32)
        n_dl, tok_dl, p_wire = _edge_round(p32, bits, dd.tokens, dd.q_at, None, RoundRandomness(5, device, r))
        assert n_dl == n_ul, r
        if tok_dl is None:
            rejections += 1
            hv, av = _roundtrip(M.verdict(r, n_dl, None, p_row=p_wire[n_dl], bits_per_prob=bits, on_air_vocab=32))
            v = M.parse_verdict(hv, av, draft_len=L, vocab_size=V, bits_per_prob=bits, on_air_vocab=32)
            assert np.array_equal(v.p_row, exact_from_wire(p_wire)[n_dl])  # the p the edge verified with
            tok_dl = sample_correction(v.p_row, q_exact[n_dl], RoundRandomness(5, device, r).final_uniform())
        assert tok_dl == tok_ul, r
    assert 50 < rejections < 300 and underflow_rows > 100  # both branches and the underflow case exercised


def test_a_token_whose_float32_q_underflows_in_float16_cannot_be_drafted():
    """The old defect: a token sampled from float32 q with q(x) > 0 but fp16(q(x)) = 0 made the edge refuse the
    draft. Sampling through the wire never picks it, and the draft is accepted by the parser."""
    q32 = np.array([[1e-9, 0.25, 0.75 - 1e-9]], np.float32)
    u = 1e-10  # inverse CDF of float32 q picks entry 0
    assert sample_from(q32[0], u) == 0
    old = M.draft(0, "UL", [0], q32, q_wire=to_wire_precision(q32, 16), last_token=0, bits_per_prob=16,
                  on_air_vocab=None, timings={})
    with pytest.raises(ProtocolError, match="q = 0"):
        M.parse_draft(*_roundtrip(old), mode="UL", draft_len=1, vocab_size=3, bits_per_prob=16, on_air_vocab=None)

    class _U:  # a generator whose next uniform is u
        def random(self):
            return u

    toks, wire = _draft_from(q32, _U(), 16)
    assert toks.tolist() == [1] and wire[0, 0] == 0
    for mode in ("UL", "DL"):
        d = M.parse_draft(*_roundtrip(M.draft(0, mode, toks, exact_from_wire(wire), q_wire=wire, last_token=0,
                                              bits_per_prob=16, on_air_vocab=None, timings={})),
                          mode=mode, draft_len=1, vocab_size=3, bits_per_prob=16, on_air_vocab=None)
        assert d.q_at[0] == exact_from_wire(wire)[0, 1] > 0


def test_registered_error_and_bye_roundtrip():
    h, a = _roundtrip(M.registered("dev0#1", [3, 4, 5], seed=2**40, sampling={"temperature": 0.7, "top_k": 5,
                                                                                "top_p": 0.9},
                                   bits_per_prob=32, on_air_vocab_size=None, max_draft_len=6, tx_marker=False))
    reg = M.parse_registered(h, a, vocab_size=10)
    assert (reg.session, reg.prompt_ids, reg.seed, reg.bits_per_prob) == ("dev0#1", [3, 4, 5], 2**40, 32)
    assert (reg.on_air_vocab_size, reg.max_draft_len, reg.tx_marker) == (None, 6, False)
    assert reg.sampling == {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
    with pytest.raises(ProtocolError, match=r"registered.prompt_ids: ids in \[3, 5\] .* \[0, 5\)"):
        M.parse_registered(h, a, vocab_size=5)
    err = M.parse_error(_roundtrip(M.error("bad draft", round_index=3, fatal=True))[0])
    assert (err.message, err.round, err.fatal) == ("bad draft", 3, True)
    assert M.parse_bye(_roundtrip(M.done("run complete"))[0]) == "run complete"


def test_schedule_powers_and_dropped_reason_are_parsed():
    s = M.parse_schedule(_roundtrip(M.schedule(2, "UL", 3, 0.25, 0.5, 3.0))[0], max_draft_len=8)
    assert (s.ul_power_w, s.dl_power_w, s.deadline_s) == (0.25, 0.5, 3.0)
    v = M.parse_verdict(*_roundtrip(M.dropped(3, "late")), draft_len=4, vocab_size=40, bits_per_prob=16,
                        on_air_vocab=None)
    assert v.dropped and v.reason == "late"


def test_register_hardware_keeps_scalars():
    hw = {"name": "phone", "compute_scale": 3, "threads": 2, "description": "slow", "soc": "x1", "npu": False}
    reg = M.parse_register(_roundtrip(M.register("dev0", 50, hw))[0])
    assert reg.hardware == {**hw, "compute_scale": 3.0} and reg.vocab_size == 50
    assert M.parse_register({"type": "register", "name": "d", "vocab_size": 3}).hardware == {}


def test_report_carries_a_validated_link_reading():
    link = {"snr_db": 21.5, "signal_dbm": -60.0, "noise_dbm": -81.5, "age_s": 0.25, "source": "file:/tmp/snr",
            "error": None, "extra": "dropped"}
    h, _ = P.decode(M.report(7, 3, 2, {"correction_s": 0.001}, None, link=link))
    rep = M.parse_report(h, 40)
    assert rep.link == {"snr_db": 21.5, "signal_dbm": -60.0, "noise_dbm": -81.5, "age_s": 0.25,
                        "source": "file:/tmp/snr", "error": None}
    h, _ = P.decode(M.report(7, 3, 2, {}, None))
    assert M.parse_report(h, 40).link is None
    for bad, field in (({"snr_db": "high"}, "report.link.snr_db"), ({"age_s": -1.0}, "report.link.age_s"),
                       ([1, 2], "report.link")):
        h, _ = P.decode(M.report(7, 3, 2, {}, None, link=bad))
        with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
            M.parse_report(h, 40)


def test_register_features_known_ones_kept_others_dropped_and_a_bad_list_refused():
    h = P.decode(M.register("dev0", 100, {}, features=(M.SCHEDULE_IN_VERDICT,)))[0]
    assert M.parse_register(h).features == {M.SCHEDULE_IN_VERDICT}
    assert M.parse_register(P.decode(M.register("dev0", 100, {}))[0]).features == frozenset()  # an older device
    assert M.parse_register({**h, "features": ["from_the_future", M.SCHEDULE_IN_VERDICT]}).features == {
        M.SCHEDULE_IN_VERDICT}
    for bad in ("schedule_in_verdict", [1], ["x"] * (M.MAX_FEATURES + 1), {"a": 1}):
        with pytest.raises(ProtocolError, match="register.features"):
            M.parse_register({**h, "features": bad})


def test_a_verdict_carries_the_next_schedule_and_the_device_reads_it_as_a_schedule():
    fields = M.schedule_fields(8, "DL", 3, 0.2, 0.1, 2.5, topk=16)
    frames = M.verdict(7, 1, 42, next_schedule=fields)
    h, a = P.decode(frames)
    v = M.parse_verdict(h, a, draft_len=3, vocab_size=100, bits_per_prob=16, on_air_vocab=None)
    assert (v.round, v.n_accepted, v.token) == (7, 1, 42)
    assert M.parse_schedule(M.schedule_in(h), 6, 100) == M.parse_schedule(P.decode(M.schedule(8, "DL", 3, 0.2, 0.1, 2.5,
                                                                                              topk=16))[0], 6, 100)
    assert sum(len(f) for f in frames) - M.next_bytes(fields) == sum(len(f) for f in M.verdict(7, 1, 42))
    assert M.schedule_in(P.decode(M.verdict(7, 1, 42))[0]) is None
    with pytest.raises(ProtocolError, match="verdict.next"):
        M.schedule_in({**h, "next": [1, 2]})
    with pytest.raises(ProtocolError, match="schedule.draft_len"):
        M.parse_schedule(M.schedule_in({**h, "next": {**fields, "draft_len": 99}}), 6, 100)
