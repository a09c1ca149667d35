"""The wire format: one small versioned JSON header frame, then raw array frames sent zero-copy.

Every multipart message is ``[header, *arrays]``. The header is a UTF-8 JSON object with at least
``v`` (the protocol version) and ``type``. A message that must be charged air time by the channel
emulator carries ``"air": "ul"`` or ``"air": "dl"``; the emulator adds ``"channel": {...}`` (bytes,
rate, air time, hold) to the header it forwards.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
# Limits of the JSON a receiver parses. Real headers nest 4 deep (header -> arrays -> entry -> shape) and
# carry counters, seeds and token ids; anything beyond these is a bug or an attack, refused before it costs.
MAX_JSON_DEPTH = 16          # far below the recursion limit the C parser would otherwise hit
MAX_INT_DIGITS = 19          # int64 has at most 19 digits; int() of 4301+ digits raises, of millions stalls
MAX_INT = 2**63 - 1          # every integer fits numpy int64: no overflow in the arithmetic that follows
MAX_JSON_ITEMS = 4096        # values in one header (commas outside strings): bounds the parse work per message
MAX_TYPE_CHARS = 64


class ProtocolError(ValueError):
    """A message that does not follow the wire format; the receiver refuses it and keeps serving."""


def show(value: Any, limit: int = 80) -> str:
    """repr() for an error message, truncated; never raises (repr of a 5000-digit int does in 3.11+)."""
    try:
        text = repr(value)
    except Exception:  # a huge int, a broken __repr__: name the type instead
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- strict, bounded JSON ---------------------------------------------------------------------------

# A JSON string, closed or not ("? makes an unclosed one match to the end: linear time, no backtracking).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _nesting_depth(raw: bytes) -> int:
    """Deepest bracket nesting of JSON text, counted outside strings, without recursion (below
    MAX_JSON_DEPTH possibly an upper bound of it)."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_JSON_DEPTH:  # the common case, at the cost of two counts
        return opens
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


class _Refused:
    """A number Python's json accepts but the protocol does not (NaN, +-Infinity, an integer of too many
    digits): a placeholder, so that the refusal can name the field it sits in."""

    __slots__ = ("what", "why")

    def __init__(self, what: str, why: str) -> None:
        self.what, self.why = what, why


def _parse_constant(name: str) -> _Refused:  # json calls it for NaN, Infinity, -Infinity only
    return _Refused(name, "numbers must be finite")


def _parse_int(text: str) -> int | _Refused:
    # Length first: int() raises ValueError at 4301 digits and takes quadratic time below that. The int64
    # range itself is checked by the walk (`_leaf_problem`), on both ways.
    if len(text) > MAX_INT_DIGITS + 1:
        digits = len(text) - text.startswith("-")
        return _Refused(f"an integer of {digits} digits", f"integers must fit int64 (at most {MAX_INT_DIGITS} digits)")
    return int(text)


class _DuplicateKey(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # two parsers could pick different duplicates: refuse the ambiguity
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def valid_text(text: str) -> bool:
    """Whether a str encodes as UTF-8 (no lone surrogate), as everything that logs or writes it needs."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _leaf_problem(v: Any) -> tuple[str, str] | None:
    """(what, why) when a JSON leaf or key is refused: a placeholder, a NaN or infinity (a literal such as
    1e999 overflows to one), an integer beyond int64, a string with a lone surrogate (an escape such as
    \\ud800 gives one; it raises later, when logged or written as UTF-8)."""
    if isinstance(v, str):
        if not valid_text(v):
            return "a string with a lone surrogate", "text must be valid Unicode"
    elif isinstance(v, bool):
        pass
    elif isinstance(v, float):
        if not math.isfinite(v):
            return repr(v), "numbers must be finite"
    elif isinstance(v, int):
        if not -MAX_INT <= v <= MAX_INT:
            return show(v, 40), "integers must fit int64"
    elif isinstance(v, _Refused):
        return v.what, v.why
    return None


def _children(v: Any):
    if isinstance(v, dict):
        return v.items()
    return enumerate(v) if isinstance(v, (list, tuple)) else ()


def _first_problem(value: Any) -> tuple[str, str, str] | None:
    """(path, what, why) of the first refused leaf or key of an acyclic JSON-like value, or None. Iterative;
    a quick pass without paths first, so a clean header pays for no path bookkeeping."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(k for k in v if isinstance(k, str) and not k.isascii())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif _leaf_problem(v) is not None:
            break
    else:
        return None
    trails: list[tuple[Any, Any]] = [(value, None)]
    while trails:
        v, trail = trails.pop()
        problem = _leaf_problem(v)
        if problem is not None:
            return (_path(trail), *problem)
        for k, x in _children(v):
            if isinstance(k, str) and _leaf_problem(k) is not None:
                return (_path(trail), *_leaf_problem(k))
            trails.append((x, (trail, k)))
    return None


def _path(trail) -> str:
    parts = []
    while trail is not None:
        trail, key = trail
        parts.append(f"[{key}]" if isinstance(key, int) else f".{show(key, 40)[1:-1]}")
    return "".join(reversed(parts))


def parse_json(raw: bytes | memoryview | str, *, what: str = "header", max_bytes: int = MAX_HEADER_BYTES,
               max_items: int = MAX_JSON_ITEMS) -> Any:
    """Strict, bounded JSON from a peer: at most `max_bytes` of UTF-8, nesting at most MAX_JSON_DEPTH, finite
    numbers, integers within int64, no duplicate keys, no lone surrogates. Anything else (whatever the
    parser would raise) is a ProtocolError naming `what` and, where there is one, the field. The channel
    emulator's control socket should parse its requests with it too."""
    try:
        data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
        if len(data) > max_bytes:
            raise ProtocolError(f"{what} of {len(data)} bytes exceeds {max_bytes}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{what} is not JSON (not UTF-8: {exc})") from None
        depth = _nesting_depth(data)
        if depth > MAX_JSON_DEPTH:
            raise ProtocolError(f"{what}: nesting depth {depth} exceeds {MAX_JSON_DEPTH}")
        if data.count(b",") > max_items and _JSON_STRING.sub(b"", data).count(b",") > max_items:
            raise ProtocolError(f"{what}: more than {max_items} values")
        try:
            value = json.loads(text, parse_constant=_parse_constant, parse_int=_parse_int, object_pairs_hook=_object)
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"{what} is not JSON: {exc}") from None
        except _DuplicateKey as exc:
            raise ProtocolError(f"{what}: duplicate key {show(exc.args[0])}") from None
        problem = _first_problem(value)
        if problem is not None:
            path, bad, why = problem
            raise ProtocolError(f"{what}{path}: {bad} is not allowed; {why}")
        return value
    except ProtocolError:
        raise
    except Exception as exc:  # RecursionError, MemoryError, ValueError, TypeError...: refused, never fatal
        raise ProtocolError(f"{what} is not acceptable JSON ({type(exc).__name__}: {show(str(exc))})") from None


def _dumps(body: Any, what: str, max_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """Strict JSON on the way out, the receiver's rules (`parse_json`): what we send, a peer accepts."""
    try:
        raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        where = _nonfinite_path(body)
        detail = f"{what}{where}: a non-finite number" if where is not None else f"{what}: {exc}"
        raise ProtocolError(f"{detail} cannot be sent as strict JSON") from None
    if _canonical_match(raw) is not None:
        return raw  # the text of a round's own header: what the checks below would pass (see `_canonical`)
    if len(raw) > max_bytes:
        raise ProtocolError(f"{what} of {len(raw)} bytes exceeds {max_bytes}")
    depth = _nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ProtocolError(f"{what}: nesting depth {depth} exceeds {MAX_JSON_DEPTH}; a peer would refuse it")
    problem = _first_problem(body)  # acyclic: json.dumps refused circular bodies above
    if problem is not None:
        path, bad, why = problem
        raise ProtocolError(f"{what}{path}: {bad} cannot be sent; {why}")
    return raw


def _nonfinite_path(value: Any) -> str | None:
    """Where the first NaN or infinity sits in an outgoing header (for the error message); ends on cycles."""
    stack: list[tuple[Any, Any]] = [(value, None)]
    seen: set[int] = set()
    while stack:
        v, trail = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return _path(trail)
        if isinstance(v, (dict, list, tuple)) and id(v) not in seen:
            seen.add(id(v))
            stack.extend((x, (trail, k)) for k, x in _children(v))
    return None


def encode_header(header: dict[str, Any], max_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """The header frame: ``{"v": PROTOCOL_VERSION, **header}`` as compact strict JSON; ProtocolError (naming
    the field) on a NaN or infinity, a value JSON cannot carry, or more than `max_bytes` (MAX_HEADER_BYTES:
    what a device may send; the emulator's control channel, which only the edge uses, allows more)."""
    try:
        body = {"v": PROTOCOL_VERSION, **header}
    except TypeError as exc:
        raise ProtocolError(f"header: {show(header)} is not a mapping ({exc})") from None
    return _dumps(body, "header", max_bytes)


def decode_header(frame: bytes | memoryview, max_bytes: int = MAX_HEADER_BYTES,
                  max_items: int = MAX_JSON_ITEMS) -> dict[str, Any]:
    """The guarded header decode every node uses (edge, device, emulator): strict JSON (`parse_json`), an
    object with ``v`` == PROTOCOL_VERSION and a short string ``type``; anything else is a ProtocolError.
    A round's own headers as `encode_header` writes them take a shortcut to the same dict (`_canonical`)."""
    header = _canonical(frame)
    if header is not None:
        return header
    header = parse_json(frame, what="header", max_bytes=max_bytes, max_items=max_items)
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:  # true == 1 and 1.0 == 1 in Python: compare the type too
        raise ProtocolError(f"protocol version {show(v)}, expected {PROTOCOL_VERSION}")
    kind = header.get("type")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_TYPE_CHARS:
        raise ProtocolError(f"header has no string field 'type' of 1-{MAX_TYPE_CHARS} characters: {show(kind)}")
    return header


# --- the hot headers' shortcut --------------------------------------------------------------------------
# Every round each device gets a schedule and a verdict and sends a draft and a report; their strict parse
# costs more than all the rest of their handling. As `encode_header` writes them (compact, the builders' keys
# in their order, `testbed.wire.messages`), they match these patterns: non-negative integers of at most 18
# digits, numbers of at most 16 integer digits and a 2-digit exponent (finite), fixed strings, no escapes. A
# text that matches is JSON `parse_json` accepts, and the dict built from it is the one it returns (the same
# keys in the same order, int for an integer literal, float() of any other number, as json does); any other
# text (an emulator's annotation, a link reading, a top-k upload, a peer's own spelling) takes the strict way.
_INT = rb"(0|[1-9][0-9]{0,17})"
_NUM = rb"(-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,25})?(?:[eE][-+]?[0-9]{1,2})?)"
# A schedule's fields, in a `schedule` or in a verdict's `next` (7 groups; the last, topk, optional).
_SCHEDULE_FIELDS = (rb'"round":' + _INT + rb',"mode":"(UL|DL)","draft_len":' + _INT + rb',"ul_power_w":' + _NUM
                    + rb',"dl_power_w":' + _NUM + rb',"deadline_s":' + _NUM + rb'(?:,"topk":' + _INT + rb')?')
_CANONICAL = {
    b"schedule": re.compile(rb'\{"v":1,"type":"schedule",' + _SCHEDULE_FIELDS + rb'\}'),
    b"verdict": re.compile(rb'\{"v":1,"type":"verdict","air":"dl","round":' + _INT + rb',"n_accepted":' + _INT
                           + rb',"token":(?:null|' + _INT + rb')(?:,"next":\{' + _SCHEDULE_FIELDS + rb'\})?\}'),
    b"report": re.compile(rb'\{"v":1,"type":"report","round":' + _INT + rb',"token":' + _INT + rb',"n_accepted":'
                          + _INT + rb',"timings":\{"correction_s":' + _NUM + rb'(?:,"host_wait_s":' + _NUM
                          + rb')?\},"dl_channel":null\}'),
    b"draft": re.compile(rb'\{"v":1,"type":"draft","air":"ul","round":' + _INT + rb',"mode":"(UL|DL)","last_token":'
                         + _INT + rb',"timings":\{"draft_s":' + _NUM + rb',"compute_s":' + _NUM
                         + rb',"emulated_extra_s":' + _NUM + rb',"compute_scale":' + _NUM
                         + rb'(?:,"host_wait_s":' + _NUM + rb')?\}(?:,"topk":' + _INT
                         + rb')?,"arrays":\[\{"name":"tokens","dtype":"int32","shape":\[' + _INT
                         + rb'\]\},\{"name":"(q|q_at)","dtype":"(float16|float32|float64)","shape":\[' + _INT
                         + rb'(?:,' + _INT + rb')?\]\}\]\}'),
}
_CANONICAL_PREFIX = b'{"v":1,"type":"'


def _schedule_fields(g: tuple) -> dict[str, Any]:
    """The dict of a `_SCHEDULE_FIELDS` match's 7 groups."""
    h = {"round": int(g[0]), "mode": g[1].decode(), "draft_len": int(g[2]), "ul_power_w": _number(g[3]),
         "dl_power_w": _number(g[4]), "deadline_s": _number(g[5])}
    if g[6] is not None:
        h["topk"] = int(g[6])
    return h


def _number(text: bytes) -> int | float:
    return float(text) if b"." in text or b"e" in text or b"E" in text else int(text)


def _canonical_match(data: bytes) -> tuple[bytes, re.Match] | None:
    """(type, match) when `data` is a canonical schedule, draft, verdict or report (see above), else None."""
    if len(data) > 1024 or not data.startswith(_CANONICAL_PREFIX):
        return None
    kind = data[15:data.find(b'"', 15)]
    pattern = _CANONICAL.get(kind)
    m = pattern.fullmatch(data) if pattern is not None else None
    return None if m is None else (kind, m)


def _canonical(frame) -> dict[str, Any] | None:
    """The header of a canonical schedule, draft, verdict or report (see above), else None."""
    found = _canonical_match(frame if isinstance(frame, bytes) else bytes(frame))
    if found is None:
        return None
    kind, m = found
    g = m.groups()
    if kind == b"schedule":
        return {"v": 1, "type": "schedule", **_schedule_fields(g)}
    if kind == b"verdict":
        h = {"v": 1, "type": "verdict", "air": "dl", "round": int(g[0]), "n_accepted": int(g[1]),
             "token": None if g[2] is None else int(g[2])}
        if g[3] is not None:
            h["next"] = _schedule_fields(g[3:])
        return h
    if kind == b"report":
        timings = {"correction_s": _number(g[3])}
        if g[4] is not None:
            timings["host_wait_s"] = _number(g[4])
        return {"v": 1, "type": "report", "round": int(g[0]), "token": int(g[1]), "n_accepted": int(g[2]),
                "timings": timings, "dl_channel": None}
    timings = {"draft_s": _number(g[3]), "compute_s": _number(g[4]), "emulated_extra_s": _number(g[5]),
               "compute_scale": _number(g[6])}
    if g[7] is not None:
        timings["host_wait_s"] = _number(g[7])
    h = {"v": 1, "type": "draft", "air": "ul", "round": int(g[0]), "mode": g[1].decode(), "last_token": int(g[2]),
         "timings": timings}
    if g[8] is not None:
        h["topk"] = int(g[8])
    shape = [int(g[12])] if g[13] is None else [int(g[12]), int(g[13])]
    h["arrays"] = [{"name": "tokens", "dtype": "int32", "shape": [int(g[9])]},
                   {"name": g[10].decode(), "dtype": g[11].decode(), "shape": shape}]
    return h


def annotate_header(frame: bytes | memoryview, **fields: Any) -> bytes:
    """Re-encode a header frame with extra fields (the channel emulator adds its accounting); strict both
    ways: ProtocolError for a header the receiver would refuse or for fields JSON cannot carry."""
    header = decode_header(frame)
    header.update(fields)
    return _dumps(header, "annotated header")


# --- arrays: raw frames after the header, described in header["arrays"] ----------------------------

# Limits a receiver enforces before it touches a payload (a peer must not make the edge allocate freely).
MAX_FRAMES = 16
MAX_ARRAY_BYTES = 64 * 1024 * 1024
MAX_RANK = 4
MAX_NAME_CHARS = 64
ALLOWED_DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint32", "uint8")  # uint8: bit-packed ids
# Distributions are checked in testbed/wire/validate.py (`from_wire`, the row-sum tolerance).

# Message types (see testbed/wire/messages.py for the builders and validators).
REGISTER = "register"
REGISTERED = "registered"
ERROR = "error"
SCHEDULE = "schedule"
DRAFT = "draft"
VERDICT = "verdict"
REPORT = "report"
BYE = "bye"
HEARTBEAT = "heartbeat"  # either way, when a peer has sent nothing else for one heartbeat period
PROBE = "probe"            # edge -> device: a rate probe of a real link (`channel.measure_links`)
PROBE_ECHO = "probe_echo"  # device -> edge: its answer, sent at once
CLOCK = "clock"  # device -> edge -> device: one NTP-style exchange of timestamps before registering
# The padding a probe or echo may carry either way, and the reply a probe may ask for: a device allocates
# at most this for its echoes, whatever the edge asks (here, not in messages.py: profiles check against it
# without importing numpy).
MAX_PROBE_BYTES = 16 * 2**20
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
    """Inverse of `encode`: validates the table against the frames before building numpy views.

    The one guarded decode of every node: whatever the frames hold, the only exception is ProtocolError.
    """
    try:
        return _decode(frames, max_array_bytes)
    except ProtocolError:
        raise
    except Exception as exc:  # an unforeseen corner of a peer's bytes must cost one message, not the node
        raise ProtocolError(f"message refused ({type(exc).__name__}: {show(str(exc))})") from None


def _decode(frames: list, max_array_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    import numpy as np

    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"message has {len(frames)} frames; at most {MAX_FRAMES} allowed")
    header = decode_header(_buffer(frames[0]))
    table = header.get("arrays", [])
    if not isinstance(table, list) or len(table) != len(frames) - 1:
        raise ProtocolError(
            f"header lists {len(table) if isinstance(table, list) else show(table)} arrays but "
            f"{len(frames) - 1} array frames follow"
        )
    arrays: dict[str, Any] = {}
    for i, (spec, frame) in enumerate(zip(table, frames[1:])):
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ProtocolError(f"header.arrays[{i}]: array entry {show(spec)} has no string 'name' of "
                                f"1-{MAX_NAME_CHARS} characters")
        if name in arrays:
            raise ProtocolError(f"header.arrays[{i}]: array {name!r} listed twice")
        dtype = spec.get("dtype")
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {name!r}: dtype {show(dtype)} not allowed; allowed: {ALLOWED_DTYPES}")
        shape = spec.get("shape")
        # type(d) is int: JSON true would pass isinstance(d, int).
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise ProtocolError(f"array {name!r}: shape {show(shape)} is not a list of <= {MAX_RANK} "
                                "non-negative ints")
        itemsize = np.dtype(dtype).itemsize
        # math.prod on Python ints is exact: [2**32, 2**32] is 2**64 elements, not an int64 overflow to 0.
        # Each dimension is bounded on its own too, so a zero elsewhere cannot hide a 2**62 dimension.
        expected = itemsize * math.prod(shape)
        if expected > max_array_bytes or max(shape, default=0) > max_array_bytes:
            raise ProtocolError(f"array {name!r}: shape {shape} {dtype}: {expected} bytes exceeds the limit of "
                                f"{max_array_bytes}")
        buf = _buffer(frame)
        if buf.nbytes != expected:
            raise ProtocolError(f"array {name!r}: frame has {buf.nbytes} bytes, shape {shape} {dtype} needs "
                                f"{expected}")
        arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape) if expected else np.empty(shape, dtype)
    return header, arrays


def _buffer(frame) -> memoryview:
    # zmq.Frame exposes .buffer; bytes and memoryviews pass through, as flat bytes (len() of a 2-D
    # memoryview counts rows, not bytes).
    buf = memoryview(getattr(frame, "buffer", frame))
    return buf if buf.ndim == 1 and buf.format == "B" else buf.cast("B")


# --- on-air precision -------------------------------------------------------------------------------

_WIRE_NAMES: dict = {}  # bits -> dtype name, of the precisions asked for so far (called for every message)


def wire_dtype(bits_per_prob: int) -> str:
    """The numpy dtype that carries probabilities on the air (b_p of the spec)."""
    try:
        return _WIRE_NAMES[bits_per_prob]
    except (KeyError, TypeError):  # not asked for yet, or unhashable (refused below)
        pass
    import numpy as np

    from testbed.core.sampling import WIRE_DTYPES

    try:
        known = bits_per_prob in WIRE_DTYPES
    except TypeError:  # unhashable (a list from a peer's JSON): not a precision either
        known = False
    if not known:
        raise ProtocolError(f"bits_per_prob {show(bits_per_prob)} is not allowed on the wire; allowed: "
                            f"{', '.join(map(str, sorted(WIRE_DTYPES)))}")
    name = _WIRE_NAMES[bits_per_prob] = np.dtype(WIRE_DTYPES[bits_per_prob]).name
    return name


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
