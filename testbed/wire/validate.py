"""The one check of every probability payload before it touches a round (numpy, vectorised).

Lossless speculative sampling is defined only on distributions: a q or p row with a NaN, an infinity, a
negative entry, an entry above 1, mass beyond the target's vocabulary, or a sum far from 1 makes the
acceptance test and the residual undefined. Every distribution a node receives passes through here first,
in both communication modes:

  UL mode   `draft.q` (dense rows, `check_rows` via `from_wire` or `messages.WireRows`) and `draft.q_ids` +
            `draft.q_p` (top-k rows, `check_sparse` via `sparse.decode`), then q at the drafted tokens
            (`check_drafted`);
  DL mode   `draft.q_at` (`check_drafted`), and on the device `verdict.p` (`from_wire`).

A failure raises `InvalidPayload` (a `ProtocolError`) naming the field, the row and entry, the value and
what is allowed, e.g. `draft.q: contains NaN or infinite values (row 2, entry 17: nan); every probability
must be finite and in [0, 1]`. The edge answers it with an `error`, drops the draft from the round and
counts it against the device (`max_invalid_payloads`); see docs/wire-protocol.md.

The checks, per row of n entries at the wire dtype b_p:
  - every entry finite and in [0, 1] (float16 `-0.0` is 0);
  - the row's float64 sum within `sum_tolerance(n, b_p)` of 1 (the receiver then normalises it exactly,
    `exact_from_wire`, as the sender did: the tolerance is a sanity check of the sender, not a precision);
  - dense rows: exactly the target's V entries (on-air padding beyond V must be zero);
  - top-k rows: ids in [0, V), distinct within the row; values as above (0 only on filler pairs);
  - q at each drafted token in (0, 1]: a token sampled from q has q > 0 in its own row.
"""

from __future__ import annotations

import numpy as np

from testbed.core.sampling import exact_from_wire
from testbed.wire.protocol import ProtocolError, show


class InvalidPayload(ProtocolError):
    """A probability payload that is not a distribution over the target's vocabulary (the edge counts these
    against the device: `max_invalid_payloads`)."""


# The row-sum tolerance. A sender computes a row in float64 (`sampling.to_probs`), so its sum is 1 to ~1e-16,
# then casts each entry once to the wire dtype (`sampling.to_wire_precision`). A cast moves a normal entry x by
# at most u * x (u: the unit roundoff) and a subnormal one by at most half the smallest subnormal s. So the
# sum of a row of n entries is 1 within u + n * s, whatever the row:
#   dtype    u        s         default pair (V = 4,096)   Qwen2.5 (V = 151,936)
#   float16  2**-11   2**-25    6.1e-4                     5.0e-3
#   float32  2**-24   2**-150   6.0e-8                     6.0e-8
# Measured on the shipped pair's draft rows (864 rows, temperatures 0.7, 1.0, 1.3): worst |sum - 1| = 2.44e-4
# at float16, 3.0e-8 at float32 (`tools/bench_validate.py --measure`), inside the bounds. The tolerance is
# SUM_TOL_MARGIN times that bound, plus PRODUCER_SLACK for a sender that normalised in float32 before the
# cast (a few float32 ulps of the sum): 1.2e-3 for the default pair at float16, 1.1e-6 at float32 (the old
# fixed 1e-2 let a row 1% off through on the default pair).
ROUNDING: dict[str, tuple[float, float]] = {   # wire dtype -> (u, s)
    "float16": (2.0**-11, 2.0**-25),
    "float32": (2.0**-24, 2.0**-150),
    "float64": (2.0**-53, 2.0**-1075),
}
SUM_TOL_MARGIN = 2.0
PRODUCER_SLACK = 1e-6


def sum_tolerance(n_entries: int, dtype) -> float:
    """How far from 1 the float64 sum of a row of `n_entries` entries at `dtype` may be (module docstring)."""
    u, s = ROUNDING[np.dtype(dtype).name]
    return SUM_TOL_MARGIN * (u + int(n_entries) * s) + PRODUCER_SLACK


_RULE = "every probability must be finite and in [0, 1]"
_HALF_ONE = 0x3C00    # float16 1.0: the bits of 0 .. 1 are 0x0000 .. 0x3C00 (and -0.0 is 0x8000)
_HALF_NEG_ZERO = 0x8000


def _explain(name: str, rows) -> None:
    """Raise for the first entry of `rows` that is not finite or not in [0, 1] (the slow path: a failure)."""
    x = np.asarray(rows, dtype=np.float64)
    x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    for bad, what in ((~np.isfinite(x), "contains NaN or infinite values"), (x < 0, "contains negative probabilities"),
                      (x > 1, "contains probabilities above 1")):
        if bad.any():
            r, j = (int(i) for i in np.argwhere(bad)[0])
            raise InvalidPayload(f"{name}: {what} (row {r}, entry {j}: {float(x[r, j])!r}); {_RULE}")


def check_sums(name: str, sums, tol: float) -> None:
    """Each row's float64 sum (`sums`, one per row) is 1 within `tol`, else InvalidPayload naming the worst row."""
    err = np.abs(np.asarray(sums, dtype=np.float64) - 1.0).reshape(-1)
    if not err.size:
        return
    worst = int(err.argmax())
    if not err[worst] <= tol:  # NaN too
        raise InvalidPayload(f"{name}: row {worst} sums to {float(np.reshape(sums, -1)[worst]):.6g}; each row must "
                             f"sum to 1 within {tol:.3g}")


def check_rows(name: str, rows, *, dtype=None) -> np.ndarray:
    """Every entry of `rows` (..., n) finite and in [0, 1], each row summing to 1 within `sum_tolerance(n, dtype)`
    (`dtype`: the wire dtype the rows came at; default theirs). Returns the float64 row sums.

    float16 rows are checked on their bits (0 .. 1 is 0x0000 .. 0x3C00; -0.0 is allowed) and their float64 sums,
    exact for a row that passes (multiples of 2**-24 below 2), without a float64 copy."""
    rows = np.asarray(rows)
    dtype = np.dtype(dtype or rows.dtype)
    if not rows.size:
        return np.zeros(rows.shape[:-1])
    if rows.dtype == np.float16:
        bits = rows.view(np.uint16)
        sums = rows.sum(axis=-1, dtype=np.float64)
        if bits.max() > _HALF_ONE and ((bits > _HALF_ONE) & (bits != _HALF_NEG_ZERO)).any():
            _explain(name, rows)
    else:
        x = np.asarray(rows, dtype=np.float64)
        sums = x.sum(axis=-1)
        # A NaN or an infinity makes its row's sum non-finite (NaN compares false below)
        if not np.isfinite(sums).all() or x.min() < 0 or x.max() > 1:
            _explain(name, x)
    check_sums(name, sums, sum_tolerance(rows.shape[-1], dtype))
    return sums


def vocab_rows(arr, vocab_size: int, *, name: str, check_padding: bool = True):
    """`arr`'s first `vocab_size` entries of each row (a view); InvalidPayload when it has fewer, or (with
    `check_padding`) non-zero mass beyond them (the on-air padding)."""
    if arr.shape[-1] < vocab_size:
        raise InvalidPayload(f"{name} has {arr.shape[-1]} entries, fewer than the vocabulary {vocab_size}")
    pad = arr[..., vocab_size:]
    # On its bits first (numpy's float16 any() has no fast path: 2 ms for 4 rows padded to 151,936 entries);
    # only a pad with bits set (at least a -0.0) is looked at as numbers.
    if check_padding and pad.size and pad.view(f"u{pad.itemsize}").any() and pad.any():
        r, j = (int(i) for i in np.argwhere(np.reshape(arr[..., vocab_size:], (-1, arr.shape[-1] - vocab_size)))[0])
        raise InvalidPayload(f"{name} has non-zero mass beyond the vocabulary size {vocab_size} (row {r}, entry "
                             f"{vocab_size + j}); the on-air padding must be 0")
    return arr[..., :vocab_size]


def from_wire(arr, vocab_size: int, *, name: str = "distribution", check_padding: bool = True) -> np.ndarray:
    """Strip the on-air padding, check the rows (`check_rows`), and return them as `exact_from_wire` gives them:
    the float64 distributions the sender computed from the same wire values (bit-identical)."""
    arr = np.asarray(arr)
    # Stripped before normalising (the sender normalised over V entries); one float64 copy serves the check
    # and exact_from_wire (which takes a float64 C-ordered array as it is: the same values, the same rows).
    rows = np.ascontiguousarray(vocab_rows(arr, vocab_size, name=name, check_padding=check_padding),
                                dtype=np.float64)
    check_rows(name, rows, dtype=arr.dtype)
    return exact_from_wire(rows)


def check_tokens(name: str, tokens, vocab_size: int) -> None:
    """Drafted token ids in [0, V)."""
    ids = np.asarray(tokens)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidPayload(f"{name}: {show(ids.tolist(), 200)} is not allowed; ids must be in [0, {vocab_size})")


def check_sparse(ids_name: str, values_name: str, ids, values, vocab_size: int) -> None:
    """A top-k upload's rows: ids (L, k) in [0, V) and distinct within a row; values (L, k) as `check_rows`
    (each row summing to 1 within the tolerance of its k entries; 0 only on filler pairs)."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
        raise InvalidPayload(f"{ids_name}: id {bad} is not allowed; ids must be in [0, {vocab_size})")
    if ids.shape[-1] > 1:
        ordered = np.sort(ids, axis=-1)
        dup = np.any(ordered[..., 1:] == ordered[..., :-1], axis=-1)
        if dup.any():
            raise InvalidPayload(f"{ids_name}: row {int(np.flatnonzero(dup)[0])} repeats an id; the k ids of a row "
                                 "must be distinct")
    check_rows(values_name, values)


def check_drafted(name: str, q_at, tokens=None) -> None:
    """q at each drafted token in (0, 1]: finite, and > 0 (the token was sampled from that row)."""
    q = np.asarray(q_at, dtype=np.float64)
    ok = (q > 0) & (q <= 1)  # NaN fails both
    if ok.all():
        return
    i = int(np.flatnonzero(~ok)[0])
    v = float(q[i])
    tok = "" if tokens is None else f" (id {int(np.asarray(tokens)[i])})"
    if v == 0:
        raise InvalidPayload(f"{name}: a drafted token has q = 0 (draft {i}{tok}); q must be the distribution it "
                             "was sampled from: the q of a sampled token is in (0, 1]")
    raise InvalidPayload(f"{name}: q at draft {i}{tok} is {v!r}; the q of a sampled token must be in (0, 1]")
