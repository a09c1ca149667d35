"""A top-k draft distribution on the wire (`payload_format: topk`): k (index, probability) pairs per row.

The device drafts from q truncated to its top-k entries (`testbed.core.sampling.DraftParams`), so each of its
wire rows has at most k non-zero values. On the air a row is k distinct indices, bit-packed at
b_id = ceil(log2 V_air) bits each (V_air: the on-air vocabulary when set, else the model's), and the k values
at the wire precision b_p: k (b_id + b_p) bits, the model's `distribution_bits`. A row with fewer than k
non-zero values is filled up with the lowest indices of its zero entries (value 0).

The receiver scatters the k values into a zero row of the model's V entries, at the wire precision: the
very row the sender sampled through (`exact_from_wire` of it on both ends), so the edge verifies with the q
the tokens were drawn from, bit for bit.
"""

from __future__ import annotations

import numpy as np

from testbed.wire import protocol as P
from testbed.wire import validate
from testbed.wire.protocol import ProtocolError


def id_bits(vocab_size: int) -> int:
    """b_id = ceil(log2 V) bits per index (`testbed.core.model.bits_per_id`; 1 for V <= 2)."""
    if int(vocab_size) != vocab_size or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 1")
    return max(1, (int(vocab_size) - 1).bit_length())


def packed_bytes(n_ids: int, bits: int) -> int:
    """Bytes of `n_ids` indices packed at `bits` bits each (the last byte zero-padded)."""
    return (int(n_ids) * int(bits) + 7) // 8


def pack_ids(ids, bits: int) -> np.ndarray:
    """Non-negative integers < 2**bits -> one uint8 bit stream, most significant bit first."""
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= 1 << bits):
        raise ValueError(f"ids must be in [0, 2**{bits}); got [{a.min()}, {a.max()}]")
    shifts = np.arange(bits - 1, -1, -1, dtype=np.int64)
    return np.packbits(((a[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1))


def unpack_ids(buf: np.ndarray, n_ids: int, bits: int) -> np.ndarray:
    """Inverse of `pack_ids`: `n_ids` indices (int64) from the uint8 stream `buf`."""
    flat = np.unpackbits(np.asarray(buf, dtype=np.uint8))
    weights = np.int64(1) << np.arange(bits - 1, -1, -1, dtype=np.int64)
    return flat[: n_ids * bits].reshape(n_ids, bits).astype(np.int64) @ weights


def encode(wire_rows, k: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Wire rows (L, V) with at most k non-zero values each -> (packed ids (ceil(L k bits / 8),) uint8,
    values (L, k) at the rows' dtype). Each row's ids are ascending."""
    rows = np.asarray(wire_rows)
    if rows.ndim != 2:
        raise ValueError(f"wire rows shape {rows.shape}: need (L, V)")
    L, v = rows.shape
    if not 1 <= k <= v:
        raise ValueError(f"k={k!r}: must be in 1..{v} (the vocabulary)")
    if v > 1 << bits:
        raise ValueError(f"{v} entries do not fit {bits}-bit indices")
    ids = np.empty((L, k), np.int64)
    for i, row in enumerate(rows):
        nz = np.flatnonzero(row)
        if nz.size > k:
            raise ValueError(f"wire row {i} has {nz.size} non-zero values, more than k={k}: a top-k upload needs "
                             "the draft sampled from the top-k truncation (sampling.DraftParams)")
        fill = np.flatnonzero(row == 0)[: k - nz.size]  # zero entries after the kept ones, as 0-valued pairs
        ids[i] = np.sort(np.concatenate([nz, fill]))
    return pack_ids(ids, bits), np.take_along_axis(rows, ids, axis=1)


def decode(packed, values, *, draft_len: int, k: int, bits: int, vocab_size: int, bits_per_prob: int,
           name: str = "draft") -> np.ndarray:
    """The (L, vocab_size) wire rows a top-k upload stands for (zeros outside its ids), after checking it as
    a peer's data: dtypes and shapes, ids below the vocabulary and distinct in a row, zero padding bits, and
    values that form distributions (`validate.check_sparse`). Any problem is a ProtocolError naming the array."""
    wire = P.wire_dtype(bits_per_prob)
    n = draft_len * k
    want = packed_bytes(n, bits)
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.shape != (want,):
        got = None if not isinstance(packed, np.ndarray) else (packed.dtype.name, packed.shape)
        raise ProtocolError(f"{name}.q_ids: {got} is not allowed; must be uint8 of shape ({want},) "
                            f"({draft_len} x {k} ids at {bits} bits)")
    if not isinstance(values, np.ndarray) or values.dtype.name != wire or values.shape != (draft_len, k):
        got = None if not isinstance(values, np.ndarray) else (values.dtype.name, values.shape)
        raise ProtocolError(f"{name}.q_p: {got} is not allowed; must be {wire} of shape ({draft_len}, {k})")
    spare = want * 8 - n * bits
    if spare and int(packed[-1]) & ((1 << spare) - 1):
        raise ProtocolError(f"{name}.q_ids: the {spare} padding bits after the last id must be 0")
    ids = unpack_ids(packed, n, bits).reshape(draft_len, k)
    validate.check_sparse(f"{name}.q_ids", f"{name}.q_p", ids, values, vocab_size)
    rows = np.zeros((draft_len, vocab_size), dtype=values.dtype)
    np.put_along_axis(rows, ids, values, axis=1)
    return rows
