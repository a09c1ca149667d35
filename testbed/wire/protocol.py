"""The wire format: one small versioned JSON header frame, then raw array frames sent zero-copy.

Every multipart message is ``[header, *arrays]``. The header is a UTF-8 JSON object with at least
``v`` (the protocol version) and ``type``. A message that must be charged air time by the channel
emulator carries ``"air": "ul"`` or ``"air": "dl"``; the emulator adds ``"channel": {...}`` (bytes,
rate, air time, hold) to the header it forwards.
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024


class ProtocolError(ValueError):
    """A message that does not follow the wire format; the receiver refuses it and keeps serving."""


def encode_header(header: dict[str, Any]) -> bytes:
    body = {"v": PROTOCOL_VERSION, **header}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def decode_header(frame: bytes | memoryview) -> dict[str, Any]:
    raw = bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}")
    if not isinstance(header.get("type"), str):
        raise ProtocolError("header has no string field 'type'")
    return header


def annotate_header(frame: bytes | memoryview, **fields: Any) -> bytes:
    """Re-encode a header frame with extra fields (the channel emulator adds its accounting)."""
    header = decode_header(frame)
    header.update(fields)
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()


# --- arrays: raw frames after the header, described in header["arrays"] ----------------------------

# Limits a receiver enforces before it touches a payload (a peer must not make the edge allocate freely).
MAX_FRAMES = 16
MAX_ARRAY_BYTES = 64 * 1024 * 1024
ALLOWED_DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint32")
PROB_SUM_TOLERANCE = 1e-2  # float16 rounding of thousands of entries stays well inside this (checked
# on the raw wire rows: a sanity check of the sender; the rows are normalised after it)

# Message types (see testbed/messages.py for the builders and validators).
REGISTER = "register"
REGISTERED = "registered"
ERROR = "error"
SCHEDULE = "schedule"
DRAFT = "draft"
VERDICT = "verdict"
REPORT = "report"
BYE = "bye"
# A one-frame marker a sender puts before a large payload so the emulator starts its air time when the
# transfer starts (not when the last byte arrives).
TX_START = "tx_start"


def tx_start_marker(air: str) -> bytes:
    """The header frame that opens an `air` ("ul" or "dl") transfer."""
    return encode_header({"type": TX_START, "air": air, "marker": True})


def encode(header: dict[str, Any], arrays: dict[str, Any] | None = None) -> list:
    """Frames of one message: the header (with an ``arrays`` table) then each array, zero-copy.

    Arrays are made C-contiguous; the caller must not modify them until the send completes.
    """
    import numpy as np

    arrays = arrays or {}
    table = []
    frames: list = []
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {name!r}: dtype {arr.dtype.name} not allowed; allowed: {ALLOWED_DTYPES}")
        table.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)})
        frames.append(memoryview(arr).cast("B") if arr.size else b"")
    body = dict(header)
    if table:
        body["arrays"] = table
    return [encode_header(body), *frames]


def decode(frames: list, *, max_array_bytes: int = MAX_ARRAY_BYTES) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inverse of `encode`: validates the table against the frames before building numpy views."""
    import numpy as np

    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"message has {len(frames)} frames; at most {MAX_FRAMES} allowed")
    header = decode_header(_buffer(frames[0]))
    table = header.get("arrays", [])
    if not isinstance(table, list) or len(table) != len(frames) - 1:
        raise ProtocolError(
            f"header lists {len(table) if isinstance(table, list) else table!r} arrays but "
            f"{len(frames) - 1} array frames follow"
        )
    arrays: dict[str, Any] = {}
    for spec, frame in zip(table, frames[1:]):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError(f"array entry {spec!r} has no string 'name'")
        name = spec["name"]
        dtype = spec.get("dtype")
        if dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {name!r}: dtype {dtype!r} not allowed; allowed: {ALLOWED_DTYPES}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape) or len(shape) > 4:
            raise ProtocolError(f"array {name!r}: shape {shape!r} is not a list of <= 4 non-negative ints")
        itemsize = np.dtype(dtype).itemsize
        expected = itemsize * int(np.prod(shape, dtype=np.int64)) if shape else itemsize
        if expected > max_array_bytes:
            raise ProtocolError(f"array {name!r}: {expected} bytes exceeds the limit of {max_array_bytes}")
        buf = _buffer(frame)
        if len(buf) != expected:
            raise ProtocolError(f"array {name!r}: frame has {len(buf)} bytes, shape {shape} {dtype} needs {expected}")
        arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return header, arrays


def _buffer(frame) -> memoryview:
    # zmq.Frame exposes .buffer; bytes and memoryviews pass through.
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf)


# --- on-air precision -------------------------------------------------------------------------------

def wire_dtype(bits_per_prob: int) -> str:
    """The numpy dtype that carries probabilities on the air (b_p of the spec)."""
    import numpy as np

    from testbed.core.sampling import WIRE_DTYPES

    if bits_per_prob not in WIRE_DTYPES:
        raise ProtocolError(f"bits_per_prob {bits_per_prob} is not allowed on the wire; allowed: "
                            f"{', '.join(map(str, sorted(WIRE_DTYPES)))}")
    return np.dtype(WIRE_DTYPES[bits_per_prob]).name


def to_wire(wire_rows, bits_per_prob: int, on_air_vocab: int | None = None):
    """Rows already at the wire precision, padded with zeros to `on_air_vocab` entries (last axis).

    Rounding here is refused: the receiver must get the very values the sender sampled from, and rounding
    a normalised row again can change it (fp16(normalise(fp16(q))) != fp16(q) in general).
    """
    import numpy as np

    arr = np.asarray(wire_rows)
    want = wire_dtype(bits_per_prob)
    if arr.dtype.name != want:
        raise ValueError(f"wire rows have dtype {arr.dtype.name}; bits_per_prob {bits_per_prob} needs {want}"
                         " (cast once with testbed.core.sampling.to_wire_precision and send those rows)")
    if on_air_vocab and on_air_vocab > arr.shape[-1]:
        pad = [(0, 0)] * (arr.ndim - 1) + [(0, on_air_vocab - arr.shape[-1])]
        arr = np.pad(arr, pad)
    return arr


def from_wire(arr, vocab_size: int, *, name: str = "distribution", check_padding: bool = True):
    """Strip the on-air padding, check the rows, and return them as `exact_from_wire` gives them: the
    float64 distributions the sender computed from the same wire values (bit-identical)."""
    import numpy as np

    from testbed.core.sampling import exact_from_wire

    arr = np.asarray(arr)
    if arr.shape[-1] < vocab_size:
        raise ProtocolError(f"{name} has {arr.shape[-1]} entries, fewer than the vocabulary {vocab_size}")
    if check_padding and arr.shape[-1] > vocab_size and np.any(arr[..., vocab_size:]):
        raise ProtocolError(f"{name} has non-zero mass beyond the vocabulary size {vocab_size}")
    rows = arr[..., :vocab_size]  # stripped before normalising: the sender normalised over V entries
    check_probs(name, rows)
    return exact_from_wire(rows)


def check_probs(name: str, rows, *, tol: float = PROB_SUM_TOLERANCE) -> None:
    """Finite, non-negative, each row summing to 1 within `tol`."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.float64)
    if not np.all(np.isfinite(rows)):
        raise ProtocolError(f"{name}: contains NaN or infinite values")
    if np.any(rows < 0):
        raise ProtocolError(f"{name}: contains negative probabilities")
    if rows.size:
        err = np.abs(rows.sum(axis=-1) - 1.0).reshape(-1)
        worst = int(np.argmax(err))
        if err[worst] > tol:
            total = float(rows.reshape(-1, rows.shape[-1])[worst].sum())
            raise ProtocolError(f"{name}: row {worst} sums to {total:.6g}; each row must sum to 1 within {tol}")
