"""The payload validator (testbed/wire/validate.py) through `messages.parse_draft`, as the edge calls it.

Fixed-seed fuzz: for each class of invalid payload, 200 crafted drafts (L = 4) per format, every one refused
with `InvalidPayload`. The checks are deterministic, so any acceptance is a bug; as a statistical claim, 0 of
200 bounds a class's acceptance rate below 1.5% at 95% confidence (0.985**200 = 0.049). False alarms: 1,000
valid rows per format (Dirichlet, concentrations 0.01-1, the senders' own cast to the wire precision) must all
pass: the tolerance is twice a worst-case bound of the cast's rounding, so the false-alarm rate is 0 by
construction, and the test checks it on 1,000 rows (an alarm rate of 0.3% or more would show with 95%
probability)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from testbed.core.sampling import exact_from_wire, to_wire_precision
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire import sparse
from testbed.wire import validate as VAL

V, AIR, L, K, N = 4096, 4160, 4, 8, 200   # the default pair's V; on-air padding; draft length; top-k; drafts
BITS = sparse.id_bits(AIR)


def _valid(rng, bits: int, k: int | None = None):
    """(wire rows (L, V), tokens) as an honest device makes them: a float64 row, truncated to its top k and
    renormalised for a top-k upload, cast once to the wire precision; tokens sampled from exact_from_wire."""
    q = rng.dirichlet(np.full(V, 10 ** rng.uniform(-2, 0)), size=L)
    if k is not None:
        keep = np.argsort(-q, axis=1)[:, :k]
        t = np.zeros_like(q)
        np.put_along_axis(t, keep, np.take_along_axis(q, keep, 1), 1)
        q = t / t.sum(axis=1, keepdims=True)
    w = to_wire_precision(q, bits)
    qq = exact_from_wire(w)
    toks = np.array([rng.choice(V, p=r) for r in qq], np.int32)
    return w, toks


def _header(mode: str, topk=None) -> dict:
    h = {"type": P.DRAFT, "air": "ul", "round": 0, "mode": mode, "last_token": 1, "timings": {}}
    return h if topk is None else {**h, "topk": topk}


def _parse(frames, mode: str, bits: int, topk=None):
    h, a = P.decode([bytes(f) for f in frames])
    return M.parse_draft(h, a, mode=mode, draft_len=L, vocab_size=V, bits_per_prob=bits, on_air_vocab=AIR,
                         topk=topk)


def _dense(w, toks, bits):
    return P.encode(_header("UL"), {"tokens": toks, "q": P.to_wire(w, bits, AIR)})


def _sparse_frames(ids, vals, toks):
    return P.encode(_header("UL", K), {"tokens": toks, "q_ids": sparse.pack_ids(ids, BITS), "q_p": vals})


def _refused(frames, mode, bits, topk=None) -> bool:
    try:
        _parse(frames, mode, bits, topk)
    except VAL.InvalidPayload:
        return True
    return False


# -- the invalid classes: each crafts one bad draft from a valid one ------------------------------------------

def _entry(rng, w):
    return int(rng.integers(L)), int(rng.integers(w.shape[1]))


def _set(value):
    def craft(rng, w, toks):
        i, j = _entry(rng, w)
        w[i, j] = value
    return craft


def _negative(rng, w, toks):
    i, j = _entry(rng, w)
    w[i, j] = -max(float(w[i].max()) * rng.uniform(1e-3, 1), 2.0**-24)


def _unnormalised(rng, w, toks):
    # far enough off that no tolerance of these rows covers it (and still finite)
    i = int(rng.integers(L))
    f = rng.choice([-1, 1]) * rng.uniform(0.01, 0.5)
    w[i] = (w[i].astype(np.float64) * (1 + f)).astype(w.dtype)


def _above_one(rng, w, toks):
    i, j = _entry(rng, w)
    w[i, j] = rng.uniform(1.01, 4)


def _token_zero(rng, w, toks):
    # q = 0 at the drafted token, the row still a distribution: its mass moved to another entry
    i = int(rng.integers(L))
    other = (int(toks[i]) + 1) % w.shape[1]
    w[i, other] = w[i, other] + w[i, toks[i]]
    w[i, toks[i]] = 0


ROW_CLASSES = {"nan": _set(np.nan), "+inf": _set(np.inf), "-inf": _set(-np.inf), "negative": _negative,
               "unnormalised": _unnormalised, "above one": _above_one, "q = 0 at the drafted token": _token_zero}


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("cls", [*ROW_CLASSES, "mass beyond the vocabulary"])
def test_dense_uploads_of_each_invalid_class_are_all_refused(bits, cls):
    rng = np.random.default_rng(35)
    accepted = 0
    for _ in range(N):
        w, toks = _valid(rng, bits)
        if cls == "mass beyond the vocabulary":
            air = P.to_wire(w, bits, AIR)
            air[rng.integers(L), rng.integers(V, AIR)] = rng.uniform(1e-4, 1)
            frames = P.encode(_header("UL"), {"tokens": toks, "q": air})
        else:
            ROW_CLASSES[cls](rng, w, toks)
            frames = _dense(w, toks, bits)
        accepted += not _refused(frames, "UL", bits)
    assert accepted == 0


def _sparse_valid(rng, bits):
    w, toks = _valid(rng, bits, K)
    ids = np.sort(np.argsort(-w.astype(np.float64), axis=1, kind="stable")[:, :K], axis=1)
    return ids, np.take_along_axis(w, ids, 1), toks


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("cls", [*ROW_CLASSES, "id beyond the vocabulary", "duplicate ids"])
def test_topk_uploads_of_each_invalid_class_are_all_refused(bits, cls):
    rng = np.random.default_rng(36)
    accepted = 0
    for _ in range(N):
        ids, vals, toks = _sparse_valid(rng, bits)
        i, j = int(rng.integers(L)), int(rng.integers(K))
        if cls == "id beyond the vocabulary":
            ids[i, j] = rng.integers(V, AIR)   # inside the on-air width's bits, beyond the model's V
        elif cls == "duplicate ids":
            ids[i, j] = ids[i, (j + 1) % K]
        elif cls == "q = 0 at the drafted token":
            # the drafted token is left out of its row's ids (the id replaced by one of a zero entry)
            at = int(np.flatnonzero(ids[i] == toks[i])[0])
            ids[i, at] = next(x for x in range(V) if x not in ids[i])
            vals[i, (at + 1) % K] += vals[i, at]
            vals[i, at] = 0
        else:
            ROW_CLASSES[cls](rng, vals, toks)
        accepted += not _refused(_sparse_frames(ids, vals, toks), "UL", bits, K)
    assert accepted == 0


@pytest.mark.parametrize("value", [0.0, -0.25, 1.5, 1 + 1e-12, np.nan, np.inf, -np.inf])
def test_dl_q_at_outside_0_1_is_refused(value):
    rng = np.random.default_rng(37)
    accepted = 0
    for _ in range(N):
        q_at = rng.uniform(1e-6, 1, L)
        q_at[rng.integers(L)] = value
        frames = P.encode(_header("DL"), {"tokens": rng.integers(0, V, L).astype(np.int32), "q_at": q_at})
        accepted += not _refused(frames, "DL", 16)
    assert accepted == 0


@pytest.mark.parametrize("fmt", ["dense16", "dense32", "topk16", "topk32", "dl"])
def test_no_false_alarm_over_1000_valid_rows(fmt):
    rng = np.random.default_rng(38)
    rejected = 0
    for _ in range(1000 // L):
        bits = 32 if fmt.endswith("32") else 16
        if fmt.startswith("dense"):
            w, toks = _valid(rng, bits)
            frames, mode, topk = _dense(w, toks, bits), "UL", None
        elif fmt.startswith("topk"):
            ids, vals, toks = _sparse_valid(rng, bits)
            frames, mode, topk = _sparse_frames(ids, vals, toks), "UL", K
        else:
            w, toks = _valid(rng, 16)
            frames = M.draft(0, "DL", toks, exact_from_wire(w), last_token=1, bits_per_prob=16, on_air_vocab=AIR,
                             timings={})
            mode, topk = "DL", None
        rejected += _refused(frames, mode, bits, topk)
    assert rejected == 0


def test_the_tolerance_covers_the_worst_rounding_and_names_itself():
    # the bound u + n s of module validate, doubled: the default pair at float16 and float32
    assert VAL.sum_tolerance(4096, np.float16) == pytest.approx(2 * (2**-11 + 4096 * 2**-25) + 1e-6)
    assert VAL.sum_tolerance(4096, np.float16) < 1.3e-3 and VAL.sum_tolerance(4096, np.float32) < 1.2e-6
    # a row that is all rounding error of one sign: every entry of a subnormal-range row rounded up by half a step
    x = np.full(V, 2.0**-14 - 2.0**-25 * 0.999)  # each cast moves it by ~ s
    x[0] = 1 - x[1:].sum()
    w = to_wire_precision(x, 16)
    assert abs(w.astype(np.float64).sum() - 1) <= VAL.sum_tolerance(V, np.float16)
    VAL.check_rows("q", w)
    with pytest.raises(VAL.InvalidPayload, match=r"q: row 0 sums to 1\.0\d+; each row must sum to 1 within 0\.000978"):
        VAL.check_rows("q", np.array([[0.5, 0.502]], np.float16))


def test_messages_name_the_field_row_entry_and_value():
    rows = np.full((2, 4), 0.25)
    for value, fragment in ((np.nan, r"NaN or infinite values \(row 1, entry 2: nan\)"),
                            (-0.5, r"negative probabilities \(row 1, entry 2: -0\.5\)"),
                            (1.5, r"probabilities above 1 \(row 1, entry 2: 1\.5\)")):
        bad = rows.copy()
        bad[1, 2] = value
        with pytest.raises(VAL.InvalidPayload, match=r"^draft\.q: contains " + fragment):
            VAL.check_rows("draft.q", bad.astype(np.float16))
    with pytest.raises(VAL.InvalidPayload, match=r"draft\.q_at: a drafted token has q = 0 \(draft 1 \(id 7\)\)"):
        VAL.check_drafted("draft.q_at", [0.5, 0.0], [3, 7])


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(st.sampled_from([np.float16, np.float32]), st.tuples(st.integers(1, 3), st.integers(1, 40)),
                  elements=st.one_of(st.floats(-2, 2, width=16), st.just(0.0), st.just(np.nan), st.just(np.inf))))
def test_accepted_rows_are_distributions(rows):
    """Whatever the rows: either refused, or every entry finite in [0, 1] and each row summing to 1 within the
    stated tolerance, so `exact_from_wire` makes a distribution of them."""
    try:
        VAL.check_rows("q", rows)
    except VAL.InvalidPayload:
        return
    x = rows.astype(np.float64)
    assert np.isfinite(x).all() and (x >= 0).all() and (x <= 1).all()
    assert np.abs(x.sum(axis=1) - 1).max() <= VAL.sum_tolerance(rows.shape[1], rows.dtype)
    assert np.isfinite(exact_from_wire(rows)).all()
