"""Typed builders and validators for the testbed's messages (numpy, the protocol module, the sampling core).

Frames are built with `testbed.wire.protocol.encode` and parsed with `decode`. Every validator raises
`ProtocolError` naming the field, the value and what is allowed (and nothing else, whatever the header
holds); the receiver answers with an error message and keeps serving the others. Every field a node uses
comes typed and bounded out of a parse_* function: a node should not read the raw header.

Message flow of one round (device k, round r):
  edge -> device  schedule {round, mode, draft_len, ul_power_w, dl_power_w, deadline_s[, topk]}
  device -> edge  draft    {round, mode, last_token, timings, air: ul[, topk]}  + tokens (L,) int32
                           UL: + q (L, V_air) at the wire precision, or with topk k (`testbed.wire.sparse`)
                               q_ids (ceil(L k b_id / 8),) uint8 + q_p (L, k) at the wire precision;
                           DL: + q_at (L,) float64
  edge -> device  verdict  {round, n_accepted, token | null, air: dl}  (+ p (V_air,) when DL and rejected)
                  or       {round, dropped: true} when the device missed the deadline (no air time)
  device -> edge  report   {round, token, timings, channel of the verdict}
Between rounds on a measured real link (`channel.measure_links`), not charged:
  edge -> device  probe      {id, reply_bytes}  (+ pad (n,) uint8)
  device -> edge  probe_echo {id, hold_s}       (+ pad (reply_bytes,) uint8), at once

Distributions travel as wire rows (`testbed.core.sampling.to_wire_precision`); both ends compute with
`exact_from_wire` of those very rows, the q the draft tokens were sampled from and the p the edge verified with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.core.sampling import WIRE_DTYPES, SamplingParams, exact_from_wire
from testbed.core.vocabulary import DIRECTIONS, MODES, UL
from testbed.wire import protocol as P
from testbed.wire import sparse, validate
from testbed.wire.protocol import ProtocolError

MESSAGE_TYPES = (P.REGISTER, P.REGISTERED, P.ERROR, P.SCHEDULE, P.DRAFT, P.VERDICT, P.REPORT, P.BYE,
                 P.HEARTBEAT, P.PROBE, P.PROBE_ECHO, P.CLOCK)

# Bounds of what a peer may send. Beyond them a value is a bug or an attack, never a real run; inside them
# every later use (numpy int64, sums of seconds in the controller, buffers sized by V or L) stays finite.
MAX_ROUND = 2**31 - 1
MAX_VOCAB = 2**24            # a device pads its q rows to the on-air V: the edge must not size them freely
MAX_DRAFT_LEN = 1024
MAX_PROMPT_TOKENS = 2**20
MAX_SEED = P.MAX_INT
MAX_SECONDS = 1e9            # finite and far beyond any real phase (virtual air time at tiny rates included)
MAX_POWER_W = 1e6
MAX_BYTES = 2**40
MAX_RATE_BPS = 1e18
MAX_TEXT = 1000              # characters kept of a peer's free text (error messages, reasons)
MAX_SESSION_CHARS = 128
MAX_HARDWARE_FIELDS = 16
MAX_HARDWARE_TEXT = 1000
# Liveness (`registered.heartbeat_s`, `registered.liveness`): defaults for an edge that does not send them.
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_LIVENESS = 5
MIN_HEARTBEAT_S = 0.01       # a faster heartbeat would be a flood, not a liveness check
MAX_HEARTBEAT_S = 3600.0
MAX_LIVENESS = 1000
MAX_PROBE_BYTES = P.MAX_PROBE_BYTES  # a probe's or echo's padding, and the reply a probe may ask for

SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
# Known timing keys (seconds; compute_scale is a factor >= 0 under the same bounds). Unknown keys are
# dropped: a newer peer may time more, and nothing downstream reads what is not listed here. host_wait_s:
# a device sharing its process with others (`devices_per_process`) waited that long for the shared host
# between the message's receipt and its reply, beyond its own work (the virtual clock takes it out).
DRAFT_TIMINGS = ("draft_s", "compute_s", "emulated_extra_s", "compute_scale", "host_wait_s")
REPORT_TIMINGS = ("correction_s", "host_wait_s")
# The channel emulator's accounting ("channel" on a draft or verdict, echoed as a report's dl_channel):
# numbers as (kind, low, high), text as (str, allowed values or None, max length). null is allowed for every
# field (rate_bps is null on an unconfigured link); unknown fields are dropped. Without an emulator in
# between a device can forge it, so the edge must not trust more than these bounds.
CHANNEL_FIELDS: dict[str, tuple] = {
    "bytes": (int, 0, MAX_BYTES),
    "rate_bps": (float, 0.0, MAX_RATE_BPS),
    "airtime_s": (float, 0.0, MAX_SECONDS),
    "base_latency_s": (float, 0.0, MAX_SECONDS),
    "queued_s": (float, 0.0, MAX_SECONDS),
    "held_s": (float, 0.0, MAX_SECONDS),
    "late_s": (float, -MAX_SECONDS, MAX_SECONDS),
    "lead_s": (float, 0.0, MAX_SECONDS),
    "round": (int, 0, MAX_ROUND),
    "marker": (bool, None, None),
    "mode": (str, ("real", "virtual"), 16),
    "link": (str, DIRECTIONS, 16),
    "dl_access": (str, None, 32),
}

# A device's own reading of its link (device_node.link_probe), carried on each report. Only the age
# travels, not the device's clock: the edge dates the reading on its own clock.
LINK_FIELDS: dict[str, tuple] = {
    "snr_db": (float, -100.0, 100.0),
    "signal_dbm": (float, -200.0, 100.0),
    "noise_dbm": (float, -200.0, 100.0),
    "age_s": (float, 0.0, MAX_SECONDS),
    "source": (str, None, 64),
    "error": (str, None, 200),
}


def _kind(header: dict) -> str:
    # The message name in refusals: the header's type only when it is one of ours (it is peer text).
    kind = header.get("type")
    return kind if isinstance(kind, str) and kind in MESSAGE_TYPES else "message"


def _value(where: str, value: Any, kind, allowed: str, lo=None, hi=None, *, max_len: int | None = None):
    """`value` as `kind` within [lo, hi] (strings: at most `max_len` characters), else ProtocolError naming
    `where`. int excludes bool (JSON true is not 1); float accepts an int and must be finite."""
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and isinstance(value, int):
            ok = abs(value) <= P.MAX_INT  # float() of a 400-digit int raises OverflowError
            value = float(value) if ok else value
        ok = ok and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) <= P.MAX_INT
    else:
        ok = isinstance(value, kind)
    if ok and kind in (int, float):  # NaN never gets here: comparisons with it are all False
        ok = (lo is None or value >= lo) and (hi is None or value <= hi)
    if ok and kind is str:  # decode never yields a lone surrogate; a header dict built elsewhere might
        ok = (max_len is None or len(value) <= max_len) and P.valid_text(value)
    if not ok:
        raise ProtocolError(f"{where}: {P.show(value)} is not allowed; must be {allowed}")
    return value


def _field(header: dict, name: str, kind, allowed: str, *, optional: bool = False, lo=None, hi=None,
           max_len: int | None = None):
    """header[name] checked by `_value`; a missing or null field is None when `optional`, else refused."""
    if not isinstance(header, dict):
        raise ProtocolError(f"message: {P.show(header)} is not allowed; must be a JSON object")
    value = header.get(name)
    if value is None:
        if optional:
            return None
        raise ProtocolError(f"{_kind(header)}.{name}: missing; must be {allowed}")
    return _value(f"{_kind(header)}.{name}", value, kind, allowed, lo, hi, max_len=max_len)


def _round(header: dict) -> int:
    return _field(header, "round", int, f"an integer in 0..{MAX_ROUND}", lo=0, hi=MAX_ROUND)


def _array(arrays: dict, name: str) -> np.ndarray | None:
    value = arrays.get(name) if isinstance(arrays, dict) else None
    return value if isinstance(value, np.ndarray) else None


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    """A peer's free text as a short str that any encoder takes; never raises (str() of a 5000-digit int
    does): truncated, lone surrogates replaced."""
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.encode("utf-8", "replace").decode("utf-8")


def _timings(header: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """A message's `timings`: finite non-negative numbers under `keys`; unknown keys dropped; missing: {}."""
    where = f"{_kind(header)}.timings"
    raw = header.get("timings")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: {P.show(raw)} is not allowed; must be an object of seconds")
    return {k: _value(f"{where}.{k}", raw[k], float, f"a finite number in [0, {MAX_SECONDS:g}]", 0.0, MAX_SECONDS)
            for k in keys if raw.get(k) is not None}


def _channel(header: dict, name: str, fields: dict[str, tuple] = CHANNEL_FIELDS,
             what: str = "the channel emulator's object") -> dict | None:
    """An annotation object with known `fields` (default `CHANNEL_FIELDS`), or None when absent; other keys
    are dropped."""
    where = f"{_kind(header)}.{name}"
    raw = header.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: {P.show(raw)} is not allowed; must be {what} or null")
    out: dict[str, Any] = {}
    for key, (kind, lo, hi) in fields.items():
        value = raw.get(key)
        if value is None:
            if key in raw:
                out[key] = None
            continue
        if kind is str:
            allowed = f"one of {lo}" if lo else f"a text of at most {hi} characters"
            out[key] = _value(f"{where}.{key}", value, str, allowed, max_len=hi)
            if lo and value not in lo:
                raise ProtocolError(f"{where}.{key}: {P.show(value)} is not allowed; must be {allowed}")
        elif kind is bool:
            out[key] = _value(f"{where}.{key}", value, bool, "true or false")
        else:
            out[key] = _value(f"{where}.{key}", value, kind, f"a finite number in [{lo:g}, {hi:g}]", lo, hi)
    return out


# --- registration --------------------------------------------------------------------------------

# What a device may say it understands (`register.features`); the edge uses a feature only with devices that
# listed it, so devices of an older release keep working.
SCHEDULE_IN_VERDICT = "schedule_in_verdict"  # the next round's schedule inside a verdict (`verdict.next`)
CLOCK_OFFSET = "clock_offset"  # it measures its clock's offset after `registered.clock` (`clock` messages)
FEATURES = (SCHEDULE_IN_VERDICT, CLOCK_OFFSET)
MAX_FEATURES = 16


# `register.draft_time_s`: the device's drafting time per token, timed at start (optional; s/token).
DRAFT_TIME_RANGE_S = (1e-7, 60.0)


def register(name: str, vocab_size: int, hardware: dict[str, Any], features: tuple[str, ...] = (),
             draft_time_s: float | None = None) -> list:
    """Device -> edge, the first message: the device name (= its routing id), its vocabulary size V, its hardware
    profile, the protocol `features` it understands and, optionally, `draft_time_s`: its drafting time per
    token as it timed itself at start (its emulated slowdown included), which the edge plans round 0 with."""
    header = {"type": P.REGISTER, "name": name, "vocab_size": int(vocab_size), "hardware": hardware}
    if features:
        header["features"] = list(features)
    if draft_time_s is not None:
        header["draft_time_s"] = float(draft_time_s)
    return P.encode(header)


@dataclass
class Registration:
    """A parsed `register` message."""

    name: str
    vocab_size: int
    hardware: dict
    features: frozenset[str] = frozenset()  # the known `FEATURES` the device listed
    draft_time_s: float | None = None  # the device's own timing of its drafting, s/token (None: not sent)


def parse_register(header: dict) -> Registration:
    """Validate a `register` header: name of 1-64 letters, digits, '-', '_', '.'; vocab_size > 0; hardware an object;
    features absent or a list of at most MAX_FEATURES texts (names this edge does not know are dropped);
    draft_time_s absent, null or a number in DRAFT_TIME_RANGE_S (s/token)."""
    name = _field(header, "name", str, "a non-empty device name")
    if (not name or len(name) > 64 or not name.isascii()
            or not name.replace("-", "").replace("_", "").replace(".", "").isalnum()):
        raise ProtocolError(f"register.name: {P.show(name)} is not allowed; use 1-64 ASCII letters, digits, "
                            "'-', '_', '.'")
    vocab = _field(header, "vocab_size", int, f"an integer in 1..{MAX_VOCAB}", lo=1, hi=MAX_VOCAB)
    features = header.get("features")
    if features is None:
        features = []
    elif (not isinstance(features, list) or len(features) > MAX_FEATURES
          or not all(isinstance(f, str) for f in features)):
        raise ProtocolError(f"register.features: {P.show(features)} is not allowed; must be a list of at most "
                            f"{MAX_FEATURES} feature names")
    lo, hi = DRAFT_TIME_RANGE_S
    draft_time = _field(header, "draft_time_s", float, f"a number of seconds per token in [{lo:g}, {hi:g}]",
                        optional=True, lo=lo, hi=hi)
    return Registration(name, vocab, _hardware(header.get("hardware")), frozenset(features) & frozenset(FEATURES),
                        draft_time)


# --- clock offset (`testbed.runtime.clock_offset`) ------------------------------------------------------------

# `clock.result`: (type, lo, hi) of each field. An offset beyond ten years is a clock never set, not a LAN.
CLOCK_FIELDS = {"offset_s": (float, -3.2e8, 3.2e8), "rtt_s": (float, 0.0, 3600.0), "exchanges": (int, 1, 64)}
# A clock exchange's timestamps (`clock.t0`, `t1`, `t2`): wall-clock seconds since the epoch, finite.
CLOCK_STAMP_RANGE = (0.0, 1e11)


def _clock_result(raw: Any) -> dict:
    """clock.result: an object of CLOCK_FIELDS within their bounds."""
    where = "clock.result"
    if not isinstance(raw, dict) or set(raw) != set(CLOCK_FIELDS):
        raise ProtocolError(f"{where}: {P.show(raw)} is not allowed; must be an object of {', '.join(CLOCK_FIELDS)}")
    return {key: _value(f"{where}.{key}", raw[key], kind, f"a {kind.__name__} in [{lo:g}, {hi:g}]", lo, hi)
            for key, (kind, lo, hi) in CLOCK_FIELDS.items()}


def clock_request(t0: float) -> list:
    """Device -> edge: one clock exchange, sent at `t0` on the device's wall clock (registered or not: any peer
    may ask; the edge answers at once). A device starts its exchanges when `registered.clock` is true."""
    return P.encode({"type": P.CLOCK, "t0": float(t0)})


def clock_result(offset_s: float, rtt_s: float, exchanges: int) -> list:
    """Device -> edge, after its exchanges: the min-RTT sample's offset (edge - device clock) and round trip."""
    return P.encode({"type": P.CLOCK, "result": {"offset_s": float(offset_s), "rtt_s": float(rtt_s),
                                                 "exchanges": int(exchanges)}})


def clock_reply(t0: float, t1: float, t2: float) -> list:
    """Edge -> device: the request's `t0` echoed, its arrival `t1` and this reply's sending `t2` (edge clock)."""
    return P.encode({"type": P.CLOCK, "t0": float(t0), "t1": float(t1), "t2": float(t2)})


def parse_clock(header: dict, *, reply: bool) -> tuple[float, ...] | dict:
    """A request's (t0,), a device's result (a dict of CLOCK_FIELDS), or with `reply` an edge's (t0, t1, t2):
    timestamps are finite epoch seconds in CLOCK_STAMP_RANGE."""
    if not reply and isinstance(header, dict) and header.get("result") is not None:
        return _clock_result(header["result"])
    lo, hi = CLOCK_STAMP_RANGE
    names = ("t0", "t1", "t2") if reply else ("t0",)
    return tuple(_field(header, n, float, f"wall-clock seconds in [{lo:g}, {hi:g}]", lo=lo, hi=hi) for n in names)


# Known hardware fields and their types; other scalar fields pass (a device may describe itself more).
HARDWARE_FIELDS: dict[str, tuple] = {"name": (str, None, None), "description": (str, None, None),
                                     "compute_scale": (float, 0.0, 1e6), "threads": (int, 1, 4096)}


def _hardware(raw: Any) -> dict:
    """register.hardware: null or an object of at most MAX_HARDWARE_FIELDS scalar fields (text, finite
    numbers, booleans, null): the edge stores and logs it, so nothing in it may be large or nested."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_HARDWARE_FIELDS:
        raise ProtocolError(f"register.hardware: {P.show(raw)} is not allowed; must be an object of at most "
                            f"{MAX_HARDWARE_FIELDS} scalar fields")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not 0 < len(key) <= 64:
            raise ProtocolError(f"register.hardware: key {P.show(key)} is not allowed; must be 1-64 characters")
        where = f"register.hardware.{key}"
        kind, lo, hi = HARDWARE_FIELDS.get(key, (None, None, None))
        if value is None or (kind is None and isinstance(value, bool)):
            out[key] = value
        elif kind is str or (kind is None and isinstance(value, str)):
            out[key] = _value(where, value, str, f"a text of at most {MAX_HARDWARE_TEXT} characters",
                              max_len=MAX_HARDWARE_TEXT)
        elif kind is not None:
            out[key] = _value(where, value, kind, f"a {kind.__name__} in [{lo:g}, {hi:g}]", lo, hi)
        else:  # an unknown field: any finite number, nothing nested
            out[key] = _value(where, value, float if isinstance(value, float) else int,
                              "a text, a finite number, a boolean or null")
    return out


def registered(session: str, prompt_ids: list[int], *, seed: int, sampling: dict, bits_per_prob: int,
               on_air_vocab_size: int | None, max_draft_len: int, tx_marker: bool = True,
               heartbeat_s: float | None = None, liveness: int | None = None, clock: bool = False) -> list:
    # tx_marker: whether a channel emulator sits in between (then markers absorb the transfer time).
    """Edge -> device reply to `register`: session id, seed, sampling parameters, b_p, on-air V, L_max and
    tx_marker; the prompt as an int32 array. `heartbeat_s` and `liveness` (sent when given): the edge's
    heartbeat period and how many silent periods make a peer dead (the device uses the same settings)."""
    header = {"type": P.REGISTERED, "session": session, "seed": int(seed), "sampling": sampling,
              "bits_per_prob": int(bits_per_prob), "on_air_vocab_size": on_air_vocab_size,
              "max_draft_len": int(max_draft_len), "tx_marker": bool(tx_marker)}
    if heartbeat_s is not None:
        header["heartbeat_s"] = float(heartbeat_s)
    if liveness is not None:
        header["liveness"] = int(liveness)
    if clock:  # the edge answers `clock` exchanges (an older edge would refuse them): the device measures
        header["clock"] = True
    return P.encode(header, {"prompt_ids": np.asarray(prompt_ids, dtype=np.int32)})


@dataclass
class Registered:
    """A parsed `registered` reply: everything a device needs to start its session."""

    session: str
    prompt_ids: list[int]
    seed: int
    sampling: dict           # temperature, top_k, top_p: valid keyword arguments of SamplingParams
    bits_per_prob: int
    on_air_vocab_size: int | None
    max_draft_len: int
    tx_marker: bool
    heartbeat_s: float = DEFAULT_HEARTBEAT_S   # the edge's heartbeat period (s)
    liveness: int = DEFAULT_LIVENESS           # silent periods after which a peer counts as dead
    clock: bool = False                        # the edge answers `clock` exchanges


def parse_registered(header: dict, arrays: dict, *, vocab_size: int | None = None) -> Registered:
    """Validate a `registered` reply: session id, seed in 0..2**63-1, sampling parameters SamplingParams
    accepts, bits_per_prob a wire precision, on_air_vocab_size null or in 1..MAX_VOCAB, max_draft_len in
    1..MAX_DRAFT_LEN, tx_marker a boolean, heartbeat_s finite seconds in [MIN_HEARTBEAT_S, MAX_HEARTBEAT_S]
    and liveness in 1..MAX_LIVENESS (both optional: DEFAULT_HEARTBEAT_S, DEFAULT_LIVENESS), prompt_ids a
    non-empty int32 vector of ids in [0, vocab_size)."""
    session = _field(header, "session", str, f"a text of 1-{MAX_SESSION_CHARS} characters", max_len=MAX_SESSION_CHARS)
    if not session:
        raise ProtocolError(f"registered.session: '' is not allowed; must be a text of 1-{MAX_SESSION_CHARS} "
                            "characters")
    seed = _field(header, "seed", int, "an integer in 0..2**63-1", lo=0, hi=MAX_SEED)
    bits = _field(header, "bits_per_prob", int, f"one of {sorted(WIRE_DTYPES)}")
    if bits not in WIRE_DTYPES:
        raise ProtocolError(f"registered.bits_per_prob: {bits} is not allowed; must be one of {sorted(WIRE_DTYPES)}")
    on_air = _field(header, "on_air_vocab_size", int, f"null or an integer in 1..{MAX_VOCAB}", optional=True,
                    lo=1, hi=MAX_VOCAB)
    max_len = _field(header, "max_draft_len", int, f"an integer in 1..{MAX_DRAFT_LEN}", lo=1, hi=MAX_DRAFT_LEN)
    tx_marker = _field(header, "tx_marker", bool, "true or false", optional=True)
    heartbeat = _field(header, "heartbeat_s", float, f"finite seconds in [{MIN_HEARTBEAT_S:g}, {MAX_HEARTBEAT_S:g}]",
                       optional=True, lo=MIN_HEARTBEAT_S, hi=MAX_HEARTBEAT_S)
    liveness = _field(header, "liveness", int, f"an integer in 1..{MAX_LIVENESS}", optional=True, lo=1,
                      hi=MAX_LIVENESS)
    sampling = _sampling(header.get("sampling"))
    ids = _array(arrays, "prompt_ids")
    top = MAX_VOCAB if vocab_size is None else vocab_size
    if ids is None or ids.dtype != np.int32 or ids.ndim != 1 or not 0 < ids.size <= MAX_PROMPT_TOKENS:
        raise ProtocolError(f"registered.prompt_ids: {None if ids is None else (ids.dtype.name, ids.shape)} is not "
                            f"allowed; must be int32 of shape (n,), 1 <= n <= {MAX_PROMPT_TOKENS}")
    if ids.min() < 0 or ids.max() >= top:
        raise ProtocolError(f"registered.prompt_ids: ids in [{ids.min()}, {ids.max()}] are not allowed; must be "
                            f"in [0, {top})")
    return Registered(session, ids.tolist(), seed, sampling, bits, on_air, max_len,
                      True if tx_marker is None else tx_marker,
                      DEFAULT_HEARTBEAT_S if heartbeat is None else heartbeat,
                      DEFAULT_LIVENESS if liveness is None else liveness,
                      bool(_field(header, "clock", bool, "true or false", optional=True)))


def _sampling(raw: Any) -> dict:
    """registered.sampling: an object of SAMPLING_FIELDS (missing ones take SamplingParams' defaults)."""
    where = "registered.sampling"
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where}: {P.show(raw)} is not allowed; must be an object of "
                            f"{', '.join(SAMPLING_FIELDS)}")
    unknown = sorted(set(raw) - set(SAMPLING_FIELDS))
    if unknown:  # SamplingParams(**sampling) would raise TypeError on them
        raise ProtocolError(f"{where}: unknown field(s) {P.show(unknown)}; allowed: {', '.join(SAMPLING_FIELDS)}")
    out: dict[str, Any] = {}
    if "temperature" in raw:
        out["temperature"] = _value(f"{where}.temperature", raw["temperature"], float,
                                    "a finite number in [0, 1e6] (0 = greedy)", 0.0, 1e6)
    if "top_k" in raw:
        out["top_k"] = _value(f"{where}.top_k", raw["top_k"], int, f"an integer in 0..{MAX_VOCAB} (0 = off)",
                              0, MAX_VOCAB)
    if "top_p" in raw:
        out["top_p"] = _value(f"{where}.top_p", raw["top_p"], float, "a number in (0, 1] (1 = off)", 0.0, 1.0)
        if out["top_p"] <= 0:
            raise ProtocolError(f"{where}.top_p: {out['top_p']} is not allowed; must be a number in (0, 1] (1 = off)")
    try:
        SamplingParams(**out)  # the bounds above are its own; this keeps the two from drifting apart
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}: {exc}") from None
    return out


def error(message: str, *, round_index: int | None = None, fatal: bool = False) -> list:
    """Edge -> device: a refused message, with the round it concerns if any; `fatal` tells the device to exit."""
    # Built from a peer's content (the refused message's text, its round): sanitised so that it cannot raise.
    r = round_index if type(round_index) is int and 0 <= round_index <= MAX_ROUND else None
    return P.encode({"type": P.ERROR, "message": _text(message), "round": r, "fatal": bool(fatal)})


def heartbeat() -> list:
    """Either direction: "I am alive" when nothing else was sent for one heartbeat period (uncharged)."""
    return P.encode({"type": P.HEARTBEAT})


def done(reason: str) -> list:
    """Edge -> device `bye`: the session is over (run complete, token limit reached, or dropped); the device exits."""
    return P.encode({"type": P.BYE, "reason": reason})


@dataclass
class ErrorReply:
    """A parsed `error` message."""

    message: str
    round: int | None
    fatal: bool


def parse_error(header: dict) -> ErrorReply:
    """Validate an `error` message: message a text (kept to MAX_TEXT characters), round null or an int,
    fatal a boolean (missing: false)."""
    message = _field(header, "message", str, "a text", optional=True) or ""
    r = _field(header, "round", int, f"null or an integer in 0..{MAX_ROUND}", optional=True, lo=0, hi=MAX_ROUND)
    fatal = _field(header, "fatal", bool, "true or false", optional=True)
    return ErrorReply(_text(message), r, fatal is True)


def parse_bye(header: dict) -> str:
    """Validate a `bye` message; returns its reason (a text kept to MAX_TEXT characters, '' if none)."""
    return _text(_field(header, "reason", str, "a text", optional=True) or "")


# --- schedule ------------------------------------------------------------------------------------

def schedule(round_index: int, mode: str, draft_len: int, ul_power_w: float, dl_power_w: float,
             deadline_s: float, topk: int | None = None) -> list:
    """Edge -> device at the start of a round: mode, draft length L, UL and DL power (W), the draft deadline (s)
    and, for a top-k round (`payload_format: topk`), k: draft from q truncated to its top k (and in UL mode
    upload it as k pairs per position)."""
    return schedule_of(schedule_fields(round_index, mode, draft_len, ul_power_w, dl_power_w, deadline_s, topk))


def schedule_of(fields: dict) -> list:
    """A `schedule` message of `schedule_fields`."""
    return P.encode({"type": P.SCHEDULE, **fields})


def schedule_fields(round_index: int, mode: str, draft_len: int, ul_power_w: float, dl_power_w: float,
                    deadline_s: float, topk: int | None = None) -> dict:
    """A schedule's fields (no type): a `schedule` message's, or a verdict's `next`."""
    fields = {"round": int(round_index), "mode": mode, "draft_len": int(draft_len), "ul_power_w": float(ul_power_w),
              "dl_power_w": float(dl_power_w), "deadline_s": float(deadline_s)}
    if topk is not None:
        fields["topk"] = int(topk)
    return fields


def next_bytes(fields: dict) -> int:
    """The bytes a verdict's `next` (these schedule fields) adds to its header: `,"next":` and the fields as
    `encode_header` writes them (compact JSON), without encoding and checking two whole headers per verdict."""
    return len(b',"next":') + len(json.dumps(fields, separators=(",", ":")))


def schedule_in(header: dict) -> dict | None:
    """A verdict's `next` as a `schedule` header for `parse_schedule`; None when it has none."""
    nxt = header.get("next")
    if nxt is None:
        return None
    if not isinstance(nxt, dict):
        raise ProtocolError(f"verdict.next: {P.show(nxt)} is not allowed; must be a schedule's fields or absent")
    return {**nxt, "type": P.SCHEDULE}


@dataclass
class Schedule:
    """A parsed `schedule`: the fields a device acts on, and the powers (W) for its records."""

    round: int
    mode: str
    draft_len: int
    deadline_s: float
    ul_power_w: float = 0.0
    dl_power_w: float = 0.0
    topk: int | None = None      # draft from the top-k truncation of q (None: dense)


def parse_schedule(header: dict, max_draft_len: int, vocab_size: int = MAX_VOCAB) -> Schedule:
    """Validate a `schedule` header: round in 0..MAX_ROUND, mode 'UL' or 'DL', draft_len in 1..L_max, deadline_s
    finite seconds >= 0, ul_power_w and dl_power_w finite watts >= 0 (missing: 0), topk null or in
    1..vocab_size."""
    r = _round(header)
    mode = _field(header, "mode", str, f"one of {MODES}")
    if mode not in MODES:
        raise ProtocolError(f"schedule.mode: {P.show(mode)} is not allowed; must be one of {MODES}")
    n = _field(header, "draft_len", int, f"an integer in 1..{max_draft_len}", lo=1, hi=max_draft_len)
    deadline = _field(header, "deadline_s", float, f"finite seconds in [0, {MAX_SECONDS:g}]", lo=0.0, hi=MAX_SECONDS)
    powers = [_field(header, k, float, f"finite watts in [0, {MAX_POWER_W:g}]", optional=True, lo=0.0,
                     hi=MAX_POWER_W) or 0.0 for k in ("ul_power_w", "dl_power_w")]
    topk = _field(header, "topk", int, f"null or an integer in 1..{vocab_size} (the vocabulary)", optional=True,
                  lo=1, hi=vocab_size)
    return Schedule(r, mode, n, deadline, *powers, topk)


# --- draft upload --------------------------------------------------------------------------------

def draft(round_index: int, mode: str, tokens, q_rows, *, q_wire=None, last_token: int, bits_per_prob: int,
          on_air_vocab: int | None, timings: dict, topk: int | None = None) -> list:
    """`q_rows`: the float64 rows the tokens were sampled from (exact_from_wire of `q_wire`, as
    `OnnxDrafter.draft(..., wire_bits=b)` returns them); `q_wire`: those wire rows (`Draft.wire`).

    UL mode sends `q_wire` as it is (padded to the on-air size; never re-rounded from q_rows, which could
    change it); with `topk` k, as k (index, value) pairs per row (`testbed.wire.sparse`; the rows must have
    at most k non-zero values: drafted with `sampling.DraftParams`). DL mode sends q_at = q_rows[i, x_i] as
    float64 scalars: 8 bytes each, negligible next to a distribution, and exact (a rounded scalar would no
    longer be the q the token was sampled from).
    """
    toks = np.asarray(tokens, dtype=np.int32)
    if mode == UL and topk is not None:
        if q_wire is None:
            raise ValueError("q_wire: UL mode uploads the wire rows the drafts were sampled through; got None")
        P.to_wire(q_wire, bits_per_prob)  # the dtype check: rows at the wire precision, never re-rounded
        bits = sparse.id_bits(max(np.shape(q_wire)[-1], on_air_vocab or 0))
        ids, values = sparse.encode(q_wire, int(topk), bits)
        payload = {"tokens": toks, "q_ids": ids, "q_p": values}
    elif mode == UL:
        if q_wire is None:
            raise ValueError("q_wire: UL mode uploads the wire rows the drafts were sampled through; got None")
        payload = {"tokens": toks, "q": P.to_wire(q_wire, bits_per_prob, on_air_vocab)}
    else:
        q = np.asarray(q_rows)
        if q.dtype != np.float64:
            raise ValueError(f"q_rows: dtype {q.dtype.name}; DL mode sends the float64 rows the drafts were "
                             "sampled from (exact_from_wire of the wire rows)")
        payload = {"tokens": toks, "q_at": q[np.arange(len(toks)), toks]}
    header = {"type": P.DRAFT, "air": "ul", "round": int(round_index), "mode": mode,
              "last_token": int(last_token), "timings": timings}
    if topk is not None:
        header["topk"] = int(topk)
    return P.encode(header, payload)


class WireRows:
    """float16 wire rows (L, V), checked as `validate.from_wire` checks them, that give a row as `exact_from_wire`
    does only when it is used: a UL draft's verification reads q at the drafted tokens (`at`) and at most
    one whole row (a correction), so the L x V float64 copy `from_wire` makes is skipped. Bit-identical to
    it: the float64 sum of a float16 row that passes the check is exact in any order, so the sums here are
    `exact_from_wire`'s, and a row is exact_from_wire of that row alone. `np.asarray(rows)` gives them all.
    A check that fails says what `from_wire` would say."""

    def __init__(self, wire: np.ndarray, sums: np.ndarray):
        self.wire, self.sums = wire, sums
        self.shape, self.dtype = wire.shape, np.dtype(np.float64)

    @classmethod
    def checked(cls, arr: np.ndarray, vocab_size: int, *, name: str) -> WireRows:
        """`validate.from_wire`'s checks (`validate.check_rows`, on the float16 bits and float64 sums)."""
        rows = validate.vocab_rows(arr, vocab_size, name=name)
        return cls(rows, validate.check_rows(name, rows))

    def at(self, tokens: np.ndarray) -> np.ndarray:
        """q of each row's token: row i at tokens[i] (float64)."""
        idx = np.arange(len(tokens))
        return self.wire[idx, tokens].astype(np.float64) / self.sums[idx]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return exact_from_wire(self.wire[key])
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):
        rows = exact_from_wire(self.wire)
        return rows if dtype is None else rows.astype(dtype, copy=False)


@dataclass
class Draft:
    """A parsed draft upload; q as both ends compute with it (exact_from_wire of the wire rows)."""

    round: int
    mode: str
    tokens: np.ndarray           # (L,) int64
    # UL: (L, V) float64, exact_from_wire of the received rows (float16 rows: a `WireRows`, the same values)
    q_rows: np.ndarray | WireRows | None
    q_at: np.ndarray             # (L,) float64, q of each drafted token
    last_token: int
    timings: dict                # DRAFT_TIMINGS present in the message: finite seconds >= 0
    channel: dict | None         # CHANNEL_FIELDS present in the annotation
    topk: int | None = None      # drafted from the top-k truncation of q (UL: uploaded as k pairs per row)
    q_bytes: int = 0             # bytes of the uploaded distributions (q, or q_ids + q_p); 0 in DL mode


def parse_draft(header: dict, arrays: dict, *, mode: str, draft_len: int, vocab_size: int,
                bits_per_prob: int, on_air_vocab: int | None, topk: int | None = None) -> Draft:
    """Validate a draft against the round's schedule (mode, L, topk), V, b_p and the on-air width; q_at for both
    modes, q_rows in UL mode only."""
    r = _round(header)
    got_mode = _field(header, "mode", str, f"one of {MODES}")
    if got_mode != mode:
        raise ProtocolError(f"draft.mode: {P.show(got_mode)} is not allowed; this round scheduled {mode!r}")
    got_topk = _field(header, "topk", int, "null or an integer", optional=True)
    if got_topk != topk:
        raise ProtocolError(f"draft.topk: {P.show(got_topk)} is not allowed; this round scheduled "
                            f"{'a dense draft (no topk)' if topk is None else f'topk {topk}'}")
    wire = P.wire_dtype(bits_per_prob)
    toks = _array(arrays, "tokens")
    if toks is None or toks.dtype != np.int32 or toks.shape != (draft_len,):
        raise ProtocolError(f"draft.tokens: {None if toks is None else (toks.dtype.name, toks.shape)} is not "
                            f"allowed; must be int32 of shape ({draft_len},)")
    ids = toks.tolist()
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # a few ids: Python is quicker than numpy here
        validate.check_tokens("draft.tokens", toks, vocab_size)
    width = max(vocab_size, on_air_vocab or 0)
    q_bytes = 0
    if mode == UL and topk is not None:
        ids, values = _array(arrays, "q_ids"), _array(arrays, "q_p")
        rows = sparse.decode(ids, values, draft_len=draft_len, k=topk, bits=sparse.id_bits(width),
                             vocab_size=vocab_size, bits_per_prob=bits_per_prob)
        q_rows = validate.from_wire(rows, vocab_size, name="draft.q_p")
        q_at = q_rows[np.arange(draft_len), toks]
        q_bytes = ids.nbytes + values.nbytes
    elif mode == UL:
        q = _array(arrays, "q")
        if q is None or q.dtype.name != wire or q.shape != (draft_len, width):
            raise ProtocolError(f"draft.q: {None if q is None else (q.dtype.name, q.shape)} is not allowed; "
                                f"must be {wire} of shape ({draft_len}, {width})")
        if q.dtype == np.float16:
            q_rows = WireRows.checked(q, vocab_size, name="draft.q")
            q_at = q_rows.at(toks)
        else:
            q_rows = validate.from_wire(q, vocab_size, name="draft.q")
            q_at = q_rows[np.arange(draft_len), toks]
        q_bytes = q.nbytes
    else:
        qa = _array(arrays, "q_at")
        if qa is None or qa.dtype != np.float64 or qa.shape != (draft_len,):
            raise ProtocolError(f"draft.q_at: {None if qa is None else (qa.dtype.name, qa.shape)} is not "
                                f"allowed; must be float64 of shape ({draft_len},)")
        q_rows, q_at = None, qa.copy()
    # q of each drafted token in (0, 1], either mode: q = 0 is impossible for an honest device (the token was
    # sampled from this q), a protocol violation.
    validate.check_drafted("draft.q" if mode == UL else "draft.q_at", q_at, toks)
    last = _field(header, "last_token", int, f"a token id in [0, {vocab_size})", lo=0, hi=vocab_size - 1)
    return Draft(r, mode, toks.astype(np.int64), q_rows, q_at, last, _timings(header, DRAFT_TIMINGS),
                 _channel(header, "channel"), topk, q_bytes)


# --- verdict -------------------------------------------------------------------------------------

def verdict(round_index: int, n_accepted: int, token: int | None, *, p_row=None, bits_per_prob: int = 16,
            on_air_vocab: int | None = None, next_schedule: dict | None = None) -> list:
    """`p_row`: the wire row of p_j (the edge verified with exact_from_wire of it; so will the device).
    `next_schedule`: the next round's `schedule_fields`, sent inside the verdict (`verdict.next`) to a device that
    listed `SCHEDULE_IN_VERDICT`."""
    arrays = {} if p_row is None else {"p": P.to_wire(p_row, bits_per_prob, on_air_vocab)}
    header = {"type": P.VERDICT, "air": "dl", "round": int(round_index), "n_accepted": int(n_accepted),
              "token": None if token is None else int(token)}
    if next_schedule is not None:
        header["next"] = next_schedule
    return P.encode(header, arrays)


def dropped(round_index: int, reason: str) -> list:
    """Edge -> device: this device's round is dropped (its draft missed the deadline); not charged air time."""
    return P.encode({"type": P.VERDICT, "round": int(round_index), "dropped": True, "reason": reason})


@dataclass
class Verdict:
    """A parsed verdict: accepted count and token, or p_j for a DL-mode correction, or a dropped round."""

    round: int
    dropped: bool
    n_accepted: int
    token: int | None
    p_row: np.ndarray | None
    channel: dict | None
    reason: str | None = None    # why a round was dropped


def parse_verdict(header: dict, arrays: dict, *, draft_len: int, vocab_size: int, bits_per_prob: int,
                  on_air_vocab: int | None) -> Verdict:
    """Validate a verdict: n_accepted in 0..L; a token id in [0, V) and/or p at the wire dtype and on-air width (one
    of them at least)."""
    r = _round(header)
    channel = _channel(header, "channel")
    if _field(header, "dropped", bool, "true or false", optional=True):
        reason = _text(_field(header, "reason", str, "a text", optional=True) or "")
        return Verdict(r, True, 0, None, None, channel, reason)
    n = _field(header, "n_accepted", int, f"an integer in 0..{draft_len}", lo=0, hi=draft_len)
    token = _field(header, "token", int, f"a token id in [0, {vocab_size})", optional=True, lo=0, hi=vocab_size - 1)
    p_row = None
    p = _array(arrays, "p")
    if p is not None:
        wire = P.wire_dtype(bits_per_prob)
        width = max(vocab_size, on_air_vocab or 0)
        if p.dtype.name != wire or p.shape != (width,):
            raise ProtocolError(f"verdict.p: {(p.dtype.name, p.shape)} is not allowed; must be {wire} ({width},)")
        p_row = validate.from_wire(p, vocab_size, name="verdict.p")
    if token is None and p_row is None:
        raise ProtocolError("verdict: carries neither a token nor a distribution p")
    return Verdict(r, False, n, token, p_row, channel)


# --- report --------------------------------------------------------------------------------------

def report(round_index: int, token: int, n_accepted: int, timings: dict, dl_channel: dict | None,
           link: dict | None = None) -> list:
    """Device -> edge after each verdict: the round's final token, n_accepted, its correction time (s), the
    verdict's channel annotation and, with a link probe, the device's latest link reading (`LINK_FIELDS`)."""
    header = {"type": P.REPORT, "round": int(round_index), "token": int(token),
              "n_accepted": int(n_accepted), "timings": timings, "dl_channel": dl_channel}
    if link is not None:
        header["link"] = link
    return P.encode(header)


@dataclass
class Report:
    """A parsed `report` message."""

    round: int
    token: int
    n_accepted: int
    timings: dict
    dl_channel: dict | None
    link: dict | None = None


def parse_report(header: dict, vocab_size: int) -> Report:
    """Validate a `report` header: round, token id in [0, V), n_accepted in 0..MAX_DRAFT_LEN, timings
    (REPORT_TIMINGS: finite seconds >= 0) and dl_channel (a channel annotation or null)."""
    r = _round(header)
    token = _field(header, "token", int, f"a token id in [0, {vocab_size})", lo=0, hi=vocab_size - 1)
    n = _field(header, "n_accepted", int, f"an integer in 0..{MAX_DRAFT_LEN}", lo=0, hi=MAX_DRAFT_LEN)
    return Report(r, token, n, _timings(header, REPORT_TIMINGS), _channel(header, "dl_channel"), parse_link(header))


def parse_link(header: dict) -> dict | None:
    """The device's link reading a report or a heartbeat may carry (`LINK_FIELDS`), or None."""
    return _channel(header, "link", LINK_FIELDS, "a link reading {snr_db, signal_dbm, noise_dbm, age_s, ...}")


# --- rate probes (`channel.measure_links`) ---------------------------------------------------------------

def probe(probe_id: int, reply_bytes: int, pad=None) -> list:
    """Edge -> device, not charged: a rate probe of the real link. `pad`: a uint8 vector (its bytes are the
    downlink's load; None: none); `reply_bytes`: how much padding the echo carries back (the uplink's load)."""
    arrays = {} if pad is None else {"pad": pad}
    return P.encode({"type": P.PROBE, "id": int(probe_id), "reply_bytes": int(reply_bytes)}, arrays)


@dataclass
class Probe:
    """A parsed `probe`."""

    id: int
    pad_bytes: int
    reply_bytes: int


def _pad(header: dict, arrays: dict) -> int:
    """Bytes of a probe's or echo's padding (0 without one): only `pad`, uint8 of shape (n,), n bounded."""
    where = f"{_kind(header)}.pad"
    extra = sorted(set(arrays or {}) - {"pad"})
    if extra:
        raise ProtocolError(f"{_kind(header)}: array(s) {P.show(extra)} are not allowed; only 'pad'")
    pad = _array(arrays, "pad")
    if pad is None:
        return 0
    if pad.dtype != np.uint8 or pad.ndim != 1 or pad.size > MAX_PROBE_BYTES:
        raise ProtocolError(f"{where}: {(pad.dtype.name, pad.shape)} is not allowed; must be uint8 (n,), "
                            f"n <= {MAX_PROBE_BYTES}")
    return int(pad.size)


def parse_probe(header: dict, arrays: dict) -> Probe:
    """Validate a `probe`: id in 0..MAX_ROUND, reply_bytes in 0..MAX_PROBE_BYTES (a larger one is refused
    before anything is allocated), padding at most MAX_PROBE_BYTES of uint8."""
    pid = _field(header, "id", int, f"an integer in 0..{MAX_ROUND}", lo=0, hi=MAX_ROUND)
    reply = _field(header, "reply_bytes", int, f"an integer in 0..{MAX_PROBE_BYTES} (bytes of the echo's padding)",
                   lo=0, hi=MAX_PROBE_BYTES)
    return Probe(pid, _pad(header, arrays), reply)


def probe_echo(probe_id: int, pad=None, *, hold_s: float = 0.0) -> list:
    """Device -> edge, not charged: the answer to `probe` `probe_id`, sent at once, with `pad` (uint8, the
    probe's reply_bytes) and `hold_s`, the seconds the device held the probe (its own clock, a duration)."""
    arrays = {} if pad is None else {"pad": pad}
    return P.encode({"type": P.PROBE_ECHO, "id": int(probe_id), "hold_s": float(hold_s)}, arrays)


@dataclass
class ProbeEcho:
    """A parsed `probe_echo`."""

    id: int
    pad_bytes: int
    hold_s: float


def parse_probe_echo(header: dict, arrays: dict) -> ProbeEcho:
    """Validate a `probe_echo`: id in 0..MAX_ROUND, hold_s finite seconds >= 0 (missing: 0), padding at most
    MAX_PROBE_BYTES of uint8."""
    pid = _field(header, "id", int, f"an integer in 0..{MAX_ROUND}", lo=0, hi=MAX_ROUND)
    hold = _field(header, "hold_s", float, f"finite seconds in [0, {MAX_SECONDS:g}]", optional=True, lo=0.0,
                  hi=MAX_SECONDS)
    return ProbeEcho(pid, _pad(header, arrays), hold or 0.0)
