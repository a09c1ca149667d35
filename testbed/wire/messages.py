"""Typed builders and validators for the testbed's messages (numpy + the protocol module only).

Frames are built with `testbed.wire.protocol.encode` and parsed with `decode`. Every validator raises
`ProtocolError` naming the field, the value and what is allowed; the receiver answers with an error
message and keeps serving the others.

Message flow of one round (device k, round r):
  edge -> device  schedule {round, mode, draft_len, ul_power_w, dl_power_w, deadline_s}
  device -> edge  draft    {round, mode, last_token, timings, air: ul}  + tokens (L,) int32
                           UL: + q (L, V_air) at the wire precision;  DL: + q_at (L,) float64
  edge -> device  verdict  {round, n_accepted, token | null, air: dl}  (+ p (V_air,) when DL and rejected)
                  or       {round, dropped: true} when the device missed the deadline (no air time)
  device -> edge  report   {round, token, timings, channel of the verdict}

Distributions travel as wire rows (`testbed.core.sampling.to_wire_precision`); both ends compute with
`exact_from_wire` of those very rows, the q the draft tokens were sampled from and the p the edge verified with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

MODES = ("UL", "DL")


def _field(header: dict, name: str, kind, allowed: str, *, optional: bool = False):
    if name not in header or header[name] is None:
        if optional:
            return None
        raise ProtocolError(f"{header.get('type', 'message')}.{name}: missing; must be {allowed}")
    value = header[name]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ProtocolError(f"{header.get('type', 'message')}.{name}: {value!r} is not allowed; must be {allowed}")
    return value


# --- registration --------------------------------------------------------------------------------

def register(name: str, vocab_size: int, hardware: dict[str, Any]) -> list:
    return P.encode({"type": P.REGISTER, "name": name, "vocab_size": int(vocab_size), "hardware": hardware})


@dataclass
class Registration:
    name: str
    vocab_size: int
    hardware: dict


def parse_register(header: dict) -> Registration:
    name = _field(header, "name", str, "a non-empty device name")
    if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ProtocolError(f"register.name: {name!r} is not allowed; use 1-64 letters, digits, '-', '_', '.'")
    vocab = _field(header, "vocab_size", int, "a positive integer")
    if vocab <= 0:
        raise ProtocolError(f"register.vocab_size: {vocab} is not allowed; must be > 0")
    hardware = header.get("hardware") or {}
    if not isinstance(hardware, dict):
        raise ProtocolError(f"register.hardware: {hardware!r} is not allowed; must be an object")
    return Registration(name, vocab, hardware)


def registered(session: str, prompt_ids: list[int], *, seed: int, sampling: dict, bits_per_prob: int,
               on_air_vocab_size: int | None, max_draft_len: int, tx_marker: bool = True) -> list:
    # tx_marker: whether a channel emulator sits in between (then markers absorb the transfer time).
    return P.encode(
        {"type": P.REGISTERED, "session": session, "seed": int(seed), "sampling": sampling,
         "bits_per_prob": int(bits_per_prob), "on_air_vocab_size": on_air_vocab_size,
         "max_draft_len": int(max_draft_len), "tx_marker": bool(tx_marker)},
        {"prompt_ids": np.asarray(prompt_ids, dtype=np.int32)},
    )


def error(message: str, *, round_index: int | None = None, fatal: bool = False) -> list:
    return P.encode({"type": P.ERROR, "message": message, "round": round_index, "fatal": fatal})


def done(reason: str) -> list:
    return P.encode({"type": P.BYE, "reason": reason})


# --- schedule ------------------------------------------------------------------------------------

def schedule(round_index: int, mode: str, draft_len: int, ul_power_w: float, dl_power_w: float,
             deadline_s: float) -> list:
    return P.encode({"type": P.SCHEDULE, "round": int(round_index), "mode": mode, "draft_len": int(draft_len),
                     "ul_power_w": float(ul_power_w), "dl_power_w": float(dl_power_w),
                     "deadline_s": float(deadline_s)})


@dataclass
class Schedule:
    round: int
    mode: str
    draft_len: int
    deadline_s: float


def parse_schedule(header: dict, max_draft_len: int) -> Schedule:
    r = _field(header, "round", int, "an integer >= 0")
    mode = _field(header, "mode", str, f"one of {MODES}")
    if mode not in MODES:
        raise ProtocolError(f"schedule.mode: {mode!r} is not allowed; must be one of {MODES}")
    n = _field(header, "draft_len", int, f"an integer in 1..{max_draft_len}")
    if not 1 <= n <= max_draft_len:
        raise ProtocolError(f"schedule.draft_len: {n} is not allowed; must be in 1..{max_draft_len}")
    return Schedule(r, mode, n, _field(header, "deadline_s", float, "seconds"))


# --- draft upload --------------------------------------------------------------------------------

def draft(round_index: int, mode: str, tokens, q_rows, *, q_wire=None, last_token: int, bits_per_prob: int,
          on_air_vocab: int | None, timings: dict) -> list:
    """`q_rows`: the float64 rows the tokens were sampled from (exact_from_wire of `q_wire`, as
    `OnnxDrafter.draft(..., wire_bits=b)` returns them); `q_wire`: those wire rows (`OnnxDrafter.last_wire`).

    UL mode sends `q_wire` as it is (padded to the on-air size; never re-rounded from q_rows, which could
    change it). DL mode sends q_at = q_rows[i, x_i] as float64 scalars: 8 bytes each, negligible next to a
    distribution, and exact (a rounded scalar would no longer be the q the token was sampled from).
    """
    toks = np.asarray(tokens, dtype=np.int32)
    if mode == "UL":
        if q_wire is None:
            raise ValueError("q_wire: UL mode uploads the wire rows the drafts were sampled through; got None")
        payload = {"tokens": toks, "q": P.to_wire(q_wire, bits_per_prob, on_air_vocab)}
    else:
        q = np.asarray(q_rows)
        if q.dtype != np.float64:
            raise ValueError(f"q_rows: dtype {q.dtype.name}; DL mode sends the float64 rows the drafts were "
                             "sampled from (exact_from_wire of the wire rows)")
        payload = {"tokens": toks, "q_at": q[np.arange(len(toks)), toks]}
    return P.encode({"type": P.DRAFT, "air": "ul", "round": int(round_index), "mode": mode,
                     "last_token": int(last_token), "timings": timings}, payload)


@dataclass
class Draft:
    round: int
    mode: str
    tokens: np.ndarray           # (L,) int64
    q_rows: np.ndarray | None    # UL: (L, V) float64, exact_from_wire of the received rows
    q_at: np.ndarray             # (L,) float64, q of each drafted token
    last_token: int
    timings: dict
    channel: dict | None


def parse_draft(header: dict, arrays: dict, *, mode: str, draft_len: int, vocab_size: int,
                bits_per_prob: int, on_air_vocab: int | None) -> Draft:
    got_mode = _field(header, "mode", str, f"one of {MODES}")
    if got_mode != mode:
        raise ProtocolError(f"draft.mode: {got_mode!r} is not allowed; this round scheduled {mode!r}")
    wire = P.wire_dtype(bits_per_prob)
    toks = arrays.get("tokens")
    if toks is None or toks.dtype != np.int32 or toks.shape != (draft_len,):
        raise ProtocolError(f"draft.tokens: {None if toks is None else (toks.dtype.name, toks.shape)} is not "
                            f"allowed; must be int32 of shape ({draft_len},)")
    if np.any(toks < 0) or np.any(toks >= vocab_size):
        raise ProtocolError(f"draft.tokens: {toks.tolist()} is not allowed; ids must be in [0, {vocab_size})")
    width = max(vocab_size, on_air_vocab or 0)
    if mode == "UL":
        q = arrays.get("q")
        if q is None or q.dtype.name != wire or q.shape != (draft_len, width):
            raise ProtocolError(f"draft.q: {None if q is None else (q.dtype.name, q.shape)} is not allowed; "
                                f"must be {wire} of shape ({draft_len}, {width})")
        q_rows = P.from_wire(q, vocab_size, name="draft.q")
        q_at = q_rows[np.arange(draft_len), toks]
    else:
        qa = arrays.get("q_at")
        if qa is None or qa.dtype != np.float64 or qa.shape != (draft_len,):
            raise ProtocolError(f"draft.q_at: {None if qa is None else (qa.dtype.name, qa.shape)} is not "
                                f"allowed; must be float64 of shape ({draft_len},)")
        q_rows, q_at = None, qa.copy()
        if not np.all(np.isfinite(q_at)) or np.any(q_at <= 0) or np.any(q_at > 1):
            raise ProtocolError(f"draft.q_at: {q_at.tolist()} is not allowed; sampled tokens need q in (0, 1]")
    if np.any(q_at <= 0):
        # Impossible for an honest device (the token was sampled from this q): a protocol violation.
        raise ProtocolError("draft.q: a drafted token has q = 0; q must be the distribution it was sampled from")
    last = _field(header, "last_token", int, f"a token id in [0, {vocab_size})")
    if not 0 <= last < vocab_size:
        raise ProtocolError(f"draft.last_token: {last} is not allowed; must be in [0, {vocab_size})")
    timings = header.get("timings") or {}
    if not isinstance(timings, dict):
        raise ProtocolError(f"draft.timings: {timings!r} is not allowed; must be an object")
    return Draft(header["round"], mode, toks.astype(np.int64), q_rows, q_at, last, timings, header.get("channel"))


# --- verdict -------------------------------------------------------------------------------------

def verdict(round_index: int, n_accepted: int, token: int | None, *, p_row=None, bits_per_prob: int = 16,
            on_air_vocab: int | None = None) -> list:
    """`p_row`: the wire row of p_j (the edge verified with exact_from_wire of it; so will the device)."""
    arrays = {} if p_row is None else {"p": P.to_wire(p_row, bits_per_prob, on_air_vocab)}
    return P.encode({"type": P.VERDICT, "air": "dl", "round": int(round_index), "n_accepted": int(n_accepted),
                     "token": None if token is None else int(token)}, arrays)


def dropped(round_index: int, reason: str) -> list:
    return P.encode({"type": P.VERDICT, "round": int(round_index), "dropped": True, "reason": reason})


@dataclass
class Verdict:
    round: int
    dropped: bool
    n_accepted: int
    token: int | None
    p_row: np.ndarray | None
    channel: dict | None


def parse_verdict(header: dict, arrays: dict, *, draft_len: int, vocab_size: int, bits_per_prob: int,
                  on_air_vocab: int | None) -> Verdict:
    r = _field(header, "round", int, "an integer >= 0")
    if header.get("dropped"):
        return Verdict(r, True, 0, None, None, header.get("channel"))
    n = _field(header, "n_accepted", int, f"an integer in 0..{draft_len}")
    if not 0 <= n <= draft_len:
        raise ProtocolError(f"verdict.n_accepted: {n} is not allowed; must be in 0..{draft_len}")
    token = _field(header, "token", int, f"a token id in [0, {vocab_size})", optional=True)
    if token is not None and not 0 <= token < vocab_size:
        raise ProtocolError(f"verdict.token: {token} is not allowed; must be in [0, {vocab_size})")
    p_row = None
    if "p" in arrays:
        wire = P.wire_dtype(bits_per_prob)
        width = max(vocab_size, on_air_vocab or 0)
        p = arrays["p"]
        if p.dtype.name != wire or p.shape != (width,):
            raise ProtocolError(f"verdict.p: {(p.dtype.name, p.shape)} is not allowed; must be {wire} ({width},)")
        p_row = P.from_wire(p, vocab_size, name="verdict.p")
    if token is None and p_row is None:
        raise ProtocolError("verdict: carries neither a token nor a distribution p")
    return Verdict(r, False, n, token, p_row, header.get("channel"))


# --- report --------------------------------------------------------------------------------------

def report(round_index: int, token: int, n_accepted: int, timings: dict, dl_channel: dict | None) -> list:
    return P.encode({"type": P.REPORT, "round": int(round_index), "token": int(token),
                     "n_accepted": int(n_accepted), "timings": timings, "dl_channel": dl_channel})


@dataclass
class Report:
    round: int
    token: int
    n_accepted: int
    timings: dict
    dl_channel: dict | None


def parse_report(header: dict, vocab_size: int) -> Report:
    r = _field(header, "round", int, "an integer >= 0")
    token = _field(header, "token", int, f"a token id in [0, {vocab_size})")
    if not 0 <= token < vocab_size:
        raise ProtocolError(f"report.token: {token} is not allowed; must be in [0, {vocab_size})")
    n = _field(header, "n_accepted", int, "an integer >= 0")
    timings = header.get("timings") or {}
    ch = header.get("dl_channel")
    if not isinstance(timings, dict) or (ch is not None and not isinstance(ch, dict)):
        raise ProtocolError("report.timings / report.dl_channel: must be objects")
    return Report(r, token, n, timings, ch)
