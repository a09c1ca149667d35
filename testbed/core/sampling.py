"""Lossless speculative sampling primitives (numpy only: device processes import this).

One round for one device (system model, section 2):
  accept x_i while u_i < p_i(x_i) / q_i(x_i); at the first rejection j sample the correction from
  norm(max(0, p_j - q_j)); if all L drafts pass, sample the bonus from p_{L+1}.

`verify_draft` is the edge's decision in both modes: accept/reject from q at the drafted tokens, then the
bonus token, or (UL mode) the correction from the uploaded q_j. In DL mode a rejection returns no token: the
edge sends p_j and the device calls `sample_correction` with its own q_j. Both modes draw from one
`RoundRandomness`, so a device produces the same tokens in either mode.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from testbed.core.vocabulary import DL, MODES, UL


@dataclass(frozen=True)
class SamplingParams:
    """Transforms applied identically to the target's p and the draft's q."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: p and q are one-hot at their argmax (greedy decoding)."""
        return self.temperature == 0


@dataclass(frozen=True)
class DraftParams(SamplingParams):
    """A draft's transforms: the sampling parameters, then (top-k upload, `payload_format: topk`) the
    truncation of q to its `payload_topk` largest entries, renormalized. The draft only: speculative sampling
    is lossless for any q the draft token was really sampled from, and p stays the target's."""

    payload_topk: int = 0  # 0 = off (dense q)

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.payload_topk) != self.payload_topk or self.payload_topk < 0:
            raise ValueError(f"payload_topk={self.payload_topk!r}: must be an integer >= 0 (0 = off)")

    @classmethod
    def of(cls, params: SamplingParams, payload_topk: int | None) -> SamplingParams:
        """`params` with the top-k truncation of a round's upload (None or 0: `params` unchanged)."""
        if not payload_topk:
            return params
        return cls(params.temperature, params.top_k, params.top_p, int(payload_topk))


def truncate_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """Rows (..., V) kept at their k largest entries (ties towards the lower index), the rest 0, renormalized;
    computed in float64, returned in the input's float dtype. k >= V: the rows unchanged. A row with fewer
    than k positive entries keeps them all, so at most k entries of each row are positive."""
    if int(k) != k or k < 1:
        raise ValueError(f"k={k!r}: must be an integer >= 1")
    x = np.asarray(probs)
    out_dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float64
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"probs shape {x.shape}: need (..., V) with V >= 1")
    if k >= x.shape[-1]:
        return x.astype(out_dtype, copy=True)
    x = x.astype(np.float64, copy=False)
    order = np.argsort(-x, axis=-1, kind="stable")
    keep = np.zeros(x.shape, bool)
    np.put_along_axis(keep, order[..., :int(k)], True, axis=-1)
    kept = np.where(keep, x, 0.0)
    total = kept.sum(axis=-1, keepdims=True)
    if not (np.isfinite(total).all() and (total > 0).all()):
        raise ValueError("probs: every row needs a finite, positive mass in its top-k entries")
    return (kept / total).astype(out_dtype)


def to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logits (..., V) -> probabilities (..., V) after temperature, top-k, then top-p; rows sum to 1.

    Computed in float64 and returned in the input's float dtype (float32 or float64). Temperature 0 gives a
    one-hot row at the argmax (lowest index on ties), which makes speculative sampling reproduce greedy
    decoding of the target exactly. `DraftParams` with `payload_topk` truncate the result last
    (`truncate_top_k`).
    """
    probs = _transformed(logits, params)
    k = getattr(params, "payload_topk", 0)
    return truncate_top_k(probs, k) if k else probs


def _transformed(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """`to_probs` before a draft's payload truncation: temperature, top-k, then top-p."""
    x = np.asarray(logits)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"logits shape {x.shape}: need (..., V) with V >= 1")
    out_dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float64
    x = x.astype(np.float64, copy=False)
    if np.isnan(x).any():
        raise ValueError("logits contain NaN")
    v = x.shape[-1]
    if params.greedy:
        probs = np.zeros_like(x)
        np.put_along_axis(probs, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return probs.astype(out_dtype)
    z = x / params.temperature
    if params.top_k and params.top_k < v:
        # Keep exactly the k largest (stable order: ties resolved towards the lower index).
        order = np.argsort(-z, axis=-1, kind="stable")
        drop = order[..., params.top_k:]
        z = z.copy()
        np.put_along_axis(z, drop, -np.inf, axis=-1)
    z = z - np.max(z, axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        # Smallest prefix of the descending order whose mass reaches top_p (always at least one token).
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each entry
        keep_sorted = before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs.astype(out_dtype)


# --- the wire precision: the one function f both ends apply ------------------------------------------------
# The draft token is sampled from f(wire rows) and the edge verifies with f(the same wire bytes), so the q
# that is used and transmitted is exactly the distribution the token was sampled from (spec, section 2).

WIRE_DTYPES = {16: np.float16, 32: np.float32}


def to_wire_precision(probs: np.ndarray, bits: int) -> np.ndarray:
    """Probabilities cast to the on-air dtype of `bits` bits per probability (b_p)."""
    if bits not in WIRE_DTYPES:
        raise ValueError(f"bits={bits!r}: not a wire precision; allowed: {sorted(WIRE_DTYPES)}")
    probs = np.asarray(probs)
    if bits == 16 and probs.dtype in (np.float32, np.float64):
        return to_half(probs)
    return probs.astype(WIRE_DTYPES[bits])


HALF_MIN_NORMAL = 2.0 ** -14


def to_half(x: np.ndarray) -> np.ndarray:
    """`x.astype(np.float16)`, bit for bit, and many times faster on probability rows: numpy casts a value
    that lands in float16's subnormal range (below 2**-14, most of a vocabulary's entries) on a slow scalar
    path. Those are multiples of 2**-24 there, so their bits are round-half-even(|x| * 2**24) (exact in float32
    and float64), and numpy's own cast does the rest (normal values, overflow to inf, NaN)."""
    tiny = np.abs(x) < HALF_MIN_NORMAL
    out = np.where(tiny, 0, x).astype(np.float16)
    small = x[tiny]
    bits = np.rint(np.abs(small) * 2.0 ** 24).astype(np.uint16) | (np.signbit(small).astype(np.uint16) << 15)
    out.view(np.uint16)[tiny] = bits
    return out


def exact_from_wire(wire: np.ndarray) -> np.ndarray:
    """Wire rows -> float64 rows normalised over the last axis: the distributions both ends compute with.

    The same wire values give bit-identical rows whether passed one row or a stack of rows: the copy is
    C-ordered, so each row is summed alone in numpy's fixed pairwise order (a Fortran-ordered copy would not
    be). For float16 the float64 sum is exact anyway (all values are multiples of 2**-24, below 1).
    """
    w = np.ascontiguousarray(wire, dtype=np.float64)
    if w.ndim < 1 or w.shape[-1] < 1:
        raise ValueError(f"wire shape {w.shape}: need (..., V) with V >= 1")
    total = w.sum(axis=-1, keepdims=True)
    if not (np.isfinite(total).all() and (total > 0).all()):
        raise ValueError("wire rows: every row needs a finite, positive sum to be a distribution")
    return w / total


def _name_key(device: str) -> int:
    # Stable across processes and machines (Python's hash() is salted per process).
    return int.from_bytes(hashlib.sha256(device.encode("utf-8")).digest()[:8], "little")


class RoundRandomness:
    """All random draws of one (session seed, device, round).

    Independent sub-streams: acceptance uniforms, the final (correction or bonus) draw, and drafting. Each
    call recreates its stream, so the edge and the device get the same numbers whichever of them asks and
    however many acceptance uniforms were consumed before.
    """

    _ACCEPT, _FINAL, _DRAFT = 0, 1, 2

    def __init__(self, seed: int, device: str, round_index: int) -> None:
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed={seed!r}: must be an integer >= 0")
        if not isinstance(device, str) or not device:
            raise ValueError(f"device={device!r}: must be a non-empty string")
        if int(round_index) != round_index or round_index < 0:
            raise ValueError(f"round_index={round_index!r}: must be an integer >= 0")
        self.seed, self.device, self.round_index = int(seed), device, int(round_index)
        self._entropy = [self.seed, _name_key(device), self.round_index]

    def _gen(self, stream: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._entropy + [stream])))

    def acceptance_uniforms(self, n: int) -> np.ndarray:
        """u_1..u_n in [0, 1); a prefix of a longer request (same round) is identical."""
        if int(n) != n or n < 0:
            raise ValueError(f"n={n!r}: must be an integer >= 0")
        return self._gen(self._ACCEPT).random(int(n))

    def final_uniform(self) -> float:
        """The single draw for the correction or the bonus token."""
        return float(self._gen(self._FINAL).random())

    def draft_generator(self) -> np.random.Generator:
        """A generator for the device's drafting in this round (independent of the verification draws)."""
        return self._gen(self._DRAFT)


def count_accepted(
    draft_tokens: Sequence[int],
    q_at_tokens: Sequence[float],
    p_at_tokens: Sequence[float],
    uniforms: Sequence[float],
) -> int:
    """Number of drafts accepted before the first rejection.

    x_i is accepted iff u_i * q_i(x_i) < p_i(x_i), i.e. u_i < p/q with u_i in [0, 1): probability exactly
    min(1, p/q), and p(x) = 0 always rejects.
    """
    n = len(draft_tokens)
    q = np.asarray(q_at_tokens, dtype=np.float64)
    p = np.asarray(p_at_tokens, dtype=np.float64)
    u = np.asarray(uniforms, dtype=np.float64)
    if not (q.shape == (n,) and p.shape == (n,) and u.shape[0] >= n):
        raise ValueError(
            f"lengths: {n} draft tokens, q_at_tokens {q.shape}, p_at_tokens {p.shape}, uniforms {u.shape}:"
            " q and p need one value per draft token, uniforms at least as many")
    for i in range(n):
        if not q[i] > 0:
            # A token sampled from q has q > 0; anything else means the wrong q was sent.
            raise ValueError(f"q_at_tokens[{i}]={q[i]!r} for draft token {draft_tokens[i]}: a sampled token"
                             " must have q > 0 (is q the distribution it was sampled from?)")
        if not u[i] * q[i] < p[i]:
            return i
    return n


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """Index i with cdf[i-1] <= u * total < cdf[i]: never an entry of weight 0."""
    cdf = np.cumsum(weights)
    total = cdf[-1]
    i = int(np.searchsorted(cdf, u * total, side="right"))
    if i >= len(cdf):  # u * total rounded up to total: take the last entry with weight
        i = int(np.flatnonzero(weights > 0)[-1])
    return i


def _check_row(name: str, row: np.ndarray) -> np.ndarray:
    r = np.asarray(row, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"{name} shape {r.shape}: must be a non-empty 1-D distribution")
    if not np.isfinite(r).all() or (r < 0).any():
        raise ValueError(f"{name}: values must be finite and >= 0")
    if not r.sum() > 0:
        raise ValueError(f"{name}: all zero, not a distribution")
    return r


def _check_u(u: float) -> float:
    if not (0.0 <= u < 1.0):
        raise ValueError(f"u={u!r}: must be in [0, 1)")
    return float(u)


def sample_from(p_row: np.ndarray, u: float) -> int:
    """Inverse-CDF sample from a (possibly unnormalised) distribution with the uniform u."""
    return _inverse_cdf(_check_row("p_row", p_row), _check_u(u))


def sample_correction(p_row: np.ndarray, q_row: np.ndarray, u: float) -> int:
    """Correction token from norm(max(0, p - q)) with the uniform u."""
    p = _check_row("p_row", p_row)
    q = _check_row("q_row", q_row)
    if p.shape != q.shape:
        raise ValueError(f"p_row has {p.size} entries, q_row {q.size}: compare over a common vocabulary")
    # Both normalised so the residual is the textbook one even for float32 rows that sum to 1 +- 1e-7.
    residual = np.maximum(0.0, p / p.sum() - q / q.sum())
    if not residual.sum() > 0:
        # p == q: a rejection then has probability 0 and only rounding can reach here; the residual's
        # limit as q -> p is undefined, and sampling p keeps the output distributed as the target.
        residual = p
    return _inverse_cdf(residual, _check_u(u))


def speculative_round(
    draft_tokens: Sequence[int],
    q_rows: np.ndarray,
    p_rows: np.ndarray,
    rr: RoundRandomness,
) -> tuple[int, int]:
    """UL-mode round at the edge: returns (accepted count, correction or bonus token)."""
    n = len(draft_tokens)
    q_rows = np.asarray(q_rows)
    p_rows = np.asarray(p_rows)
    if q_rows.ndim != 2 or q_rows.shape[0] != n:
        raise ValueError(f"q_rows shape {q_rows.shape}: need ({n}, V) for {n} draft tokens")
    if p_rows.ndim != 2 or p_rows.shape[0] != n + 1:
        raise ValueError(f"p_rows shape {p_rows.shape}: need ({n + 1}, V) for {n} draft tokens")
    if n and q_rows.shape[1] != p_rows.shape[1]:
        raise ValueError(f"q_rows V={q_rows.shape[1]} but p_rows V={p_rows.shape[1]}: must match")
    toks = np.asarray(draft_tokens, dtype=np.int64)
    v = p_rows.shape[1]
    if n and ((toks < 0).any() or (toks >= v).any()):
        raise ValueError(f"draft_tokens {list(draft_tokens)}: ids must be in [0, {v})")
    verdict = verify_draft(p_rows, q_rows[np.arange(n), toks], q_rows, toks, UL, rr)
    return verdict.n_accepted, verdict.token


@dataclass(frozen=True)
class Verdict:
    """The edge's decision on one device's drafts."""

    n_accepted: int
    token: int | None  # the correction or bonus token; None: a DL-mode rejection, the device corrects


def verify_draft(
    p_rows: np.ndarray,
    q_at: Sequence[float],
    q_rows: np.ndarray | None,
    tokens: Sequence[int],
    mode: str,
    rr: RoundRandomness,
) -> Verdict:
    """Accept/reject L drafted `tokens`, then the token that ends the round, as the edge decides it.

    `p_rows` (L+1, V): the target's rows the device also uses (in DL mode it rebuilds p_j from the row it
    downloads, so these must be the exact rows of the wire values); `q_at` (L,): q of each drafted token;
    `q_rows` (L, V): the draft rows, needed only for a UL-mode correction. All accepted: the bonus token from
    p_{L+1}, in either mode. A rejection at j: UL mode samples the correction from norm(max(0, p_j - q_j));
    DL mode returns token None, and the device samples it with `sample_correction` and the same uniform.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be 'UL' or 'DL'")
    L = len(tokens)
    if len(p_rows) < L + 1:
        raise ValueError(f"p_rows: {len(p_rows)} rows for {L} draft tokens; need L + 1 (the bonus row too)")
    n = count_accepted(tokens, q_at, p_rows[np.arange(L), tokens], rr.acceptance_uniforms(L))
    if n == L:
        return Verdict(n, sample_from(p_rows[L], rr.final_uniform()))
    if mode == DL:
        return Verdict(n, None)
    if q_rows is None:
        raise ValueError("q_rows: a UL-mode correction needs the uploaded draft rows")
    return Verdict(n, sample_correction(p_rows[n], q_rows[n], rr.final_uniform()))
