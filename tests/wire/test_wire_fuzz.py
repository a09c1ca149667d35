"""No input can kill a node (issue 9, the wire part): fuzzing and golden cases of the guarded decode.

Property, for every target below: whatever a peer sends, `protocol.decode` / `decode_header` / `parse_json`
and every `messages.parse_*` raise ProtocolError and nothing else; what they return is typed and bounded
(finite floats, int64 integers, short UTF-8 text); the edge's error reply to it (`messages.error`) never
raises and decodes again. Inputs: random frames, random JSON headers, valid messages of every type with
mutated fields and frames (NaN, Infinity, huge integers, booleans, wrong types, deep nesting, huge shapes,
wrong frame counts, scrambled payloads), and decoded headers mutated with Python values JSON cannot carry.

FUZZ_EXAMPLES examples in all by default (seconds); the `slow` variant runs FUZZ_EXAMPLES_SLOW
(`pytest -m slow tests/wire/test_wire_fuzz.py`). Derandomized: every run draws the same examples.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support import (
    CHANNEL_INFO,
    FUZZ_L,
    FUZZ_ON_AIR,
    FUZZ_V,
    KNOWN_KEYS,
    TIMINGS,
    VALID,
    _flat,
    _q,
    at_path,
    containers_of,
    json_values,
    mutated_messages,
    random_frames,
    random_json_headers,
)

from testbed.core.sampling import RoundRandomness, SamplingParams, exact_from_wire, to_wire_precision
from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError

FUZZ_EXAMPLES = 2_000           # all targets together, default run
FUZZ_EXAMPLES_SLOW = 100_000    # all targets together, -m slow

V, L, ON_AIR = FUZZ_V, FUZZ_L, FUZZ_ON_AIR  # the receiver's context: vocabulary, scheduled draft length, on-air width


# --- valid messages of every type (the seeds that mutations start from) --------------------------------












# Every parse function with the receiver's context, as the nodes call them.
PARSERS = {
    "register": lambda h, a: M.parse_register(h),
    "registered": lambda h, a: M.parse_registered(h, a, vocab_size=V),
    "error": lambda h, a: M.parse_error(h),
    "bye": lambda h, a: M.parse_bye(h),
    "schedule": lambda h, a: M.parse_schedule(h, max_draft_len=8),
    "draft_ul": lambda h, a: M.parse_draft(h, a, mode="UL", draft_len=L, vocab_size=V, bits_per_prob=16,
                                           on_air_vocab=ON_AIR),
    "draft_dl": lambda h, a: M.parse_draft(h, a, mode="DL", draft_len=L, vocab_size=V, bits_per_prob=16,
                                           on_air_vocab=ON_AIR),
    "verdict": lambda h, a: M.parse_verdict(h, a, draft_len=L, vocab_size=V, bits_per_prob=16,
                                            on_air_vocab=ON_AIR),
    "report": lambda h, a: M.parse_report(h, V),
}


def test_valid_messages_parse():
    """The seeds are valid: each parses with its own parser (so mutations start from accepted input)."""
    own = {"draft_ul": "draft_ul", "draft_dl": "draft_dl", "verdict_token": "verdict", "verdict_p": "verdict",
           "verdict_dropped": "verdict"}
    for name, frames in VALID.items():
        header, arrays = P.decode(frames)
        if name != "tx_start":
            _check_result(PARSERS[own.get(name, name)](header, arrays))


# --- the property ----------------------------------------------------------------------------------------

INT64 = 2**63 - 1


def _check_result(value, path: str = "result") -> None:
    """What a parse_* returns is safe to use: finite floats, int64 ints, short UTF-8 text, flat containers."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _check_result(getattr(value, f.name), f"{path}.{f.name}")
    elif value is None or isinstance(value, bool):
        pass
    elif isinstance(value, float):
        assert math.isfinite(value), path
    elif isinstance(value, int):
        assert abs(value) <= INT64, path
    elif isinstance(value, str):
        assert len(value) <= 2000, path
        value.encode("utf-8")
    elif isinstance(value, (list, tuple, frozenset)):
        for i, x in enumerate(value):
            _check_result(x, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, x in value.items():
            assert isinstance(k, str), path
            assert not isinstance(x, (dict, list)), f"{path}.{k} is nested"
            _check_result(x, f"{path}.{k}")
    elif isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            assert np.all(np.isfinite(value)), path
    elif isinstance(value, M.WireRows):  # float16 rows as received, made float64 when used: check those
        _check_result(np.asarray(value), path)
        _check_result(value[len(value) - 1], path)
    else:
        raise AssertionError(f"{path}: unexpected {type(value).__name__}")
    if isinstance(value, M.Registered):  # what the device does with it next must not raise either
        SamplingParams(**value.sampling)
        RoundRandomness(value.seed, "dev0", 0)
    if isinstance(value, (M.Draft, M.Schedule, M.Verdict, M.Report)):
        RoundRandomness(0, "dev0", value.round)


def _refuse_like_the_edge(exc: ProtocolError, header) -> None:
    """The edge answers a refusal with M.error(str(exc), round_index=header.get('round')): never raises."""
    r = header.get("round") if isinstance(header, dict) else None
    reply = P.decode(_flat(M.error(f"malformed message: {exc}", round_index=r)))[0]
    _check_result(M.parse_error(reply))


def _parse_everything(header: dict, arrays: dict) -> None:
    for parse in PARSERS.values():
        try:
            result = parse(header, arrays)
        except ProtocolError as exc:
            _refuse_like_the_edge(exc, header)
        else:
            _check_result(result)


def check_frames(frames: list) -> None:
    """A node's receive path: decode (edge and device), decode_header + annotate (emulator), then parse."""
    try:
        P.decode_header(frames[0] if frames else b"")
        P.annotate_header(frames[0], channel=CHANNEL_INFO)
    except ProtocolError:
        pass
    try:
        header, arrays = P.decode(frames)
    except ProtocolError as exc:
        _refuse_like_the_edge(exc, None)
        return
    _parse_everything(header, arrays)


def check_dict(pair: tuple[dict, dict]) -> None:
    _parse_everything(*pair)


def check_error_reply(args: tuple) -> None:
    message, round_index = args
    h = P.decode(_flat(M.error(message, round_index=round_index)))[0]
    err = M.parse_error(h)
    assert err.round is None or (type(err.round) is int and err.round >= 0)
    _check_result(err)


def check_encode(value) -> None:
    """Strict JSON on the way out: encode_header raises ProtocolError or gives what parse_json accepts."""
    try:
        raw = P.encode_header({"type": "x", "value": value})
    except ProtocolError:
        return
    P.decode_header(raw)


def check_parse_json(raw) -> None:
    try:
        P.parse_json(raw, what="control request")
    except ProtocolError:
        pass


# --- strategies -----------------------------------------------------------------------------------------


# Python values a parse_* may meet in a header dict handed to it directly (not only what JSON can carry).
python_nasty = st.one_of(json_values, st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -(10**400), 2**63,
                                                       True, False, "x" * 10_000, "\ud800", b"bytes", (1, 2)]))




















@st.composite
def mutated_dicts(draw) -> tuple[dict, dict]:
    """A decoded valid message, its header and arrays altered with Python values JSON cannot carry."""
    header, arrays = P.decode(VALID[draw(st.sampled_from(sorted(VALID)))])
    header, arrays = json.loads(json.dumps(header)), dict(arrays)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(containers_of(header))) + (draw(st.sampled_from(KNOWN_KEYS)),)
        at_path(header, path[:-1])[path[-1]] = draw(python_nasty)
    if draw(st.booleans()):
        name = draw(st.sampled_from(["tokens", "q", "q_at", "p", "prompt_ids"]))
        arrays[name] = draw(st.one_of(
            hnp.arrays(st.sampled_from([np.int32, np.int64, np.float16, np.float32, np.float64, np.uint32]),
                       hnp.array_shapes(min_dims=0, max_dims=3, max_side=ON_AIR + 2)),
            st.sampled_from([None, [1, 2, 3], "q", 7])))
    return header, arrays


@st.composite
def canonical_headers(draw) -> bytes:
    """A round's header as the builders write it (the shortcut of `decode_header`), with random numbers, maybe
    one byte changed, inserted or deleted."""
    ints = st.integers(0, 2**63 - 1)
    nums = st.one_of(ints, st.floats(allow_nan=False, allow_infinity=False))
    kind = draw(st.sampled_from(["schedule", "verdict", "report", "draft_UL", "draft_DL"]))
    if kind == "schedule":
        frames = M.schedule(draw(ints), draw(st.sampled_from(["UL", "DL"])), draw(ints), draw(nums), draw(nums),
                            draw(nums), topk=draw(st.one_of(st.none(), ints)))
    elif kind == "verdict":
        nxt = draw(st.one_of(st.none(), st.builds(M.schedule_fields, ints, st.sampled_from(["UL", "DL"]), ints, nums,
                                                  nums, nums, st.one_of(st.none(), ints))))
        frames = M.verdict(draw(ints), draw(ints), draw(st.one_of(st.none(), ints)), next_schedule=nxt)
    elif kind == "report":
        timings = {"correction_s": draw(nums)}
        if draw(st.booleans()):  # a device of a shared host process
            timings["host_wait_s"] = draw(nums)
        frames = M.report(draw(ints), draw(ints), draw(ints), timings, None)
    else:
        wire = to_wire_precision(_q(L), 16)
        frames = M.draft(draw(ints), kind[-2:], [1, 7, 49], exact_from_wire(wire), q_wire=wire, last_token=draw(ints),
                         bits_per_prob=16, on_air_vocab=ON_AIR,
                         timings={k: draw(nums) for k in ("draft_s", "compute_s", "emulated_extra_s", "compute_scale",
                                                          "host_wait_s")[:draw(st.sampled_from([4, 5]))]})
    text = bytes(frames[0])
    action = draw(st.sampled_from(["none", "replace", "insert", "delete"]))
    if action != "none":
        i = draw(st.integers(0, len(text) - 1))
        byte = draw(st.sampled_from(list(b'0123456789.eE-+",:{}[]nulaUDLqx ')))
        text = (text[:i] + bytes([byte]) + text[i + (action == "replace"):] if action != "delete"
                else text[:i] + text[i + 1:])
    return text


def check_canonical(text: bytes) -> None:
    """The shortcut gives exactly what the strict parse gives (types and key order too), or stands aside."""
    fast = P._canonical(text)
    try:
        strict = P.parse_json(text)
    except ProtocolError:
        assert fast is None, text
        return
    assert fast is None or repr(fast) == repr(strict), text


error_args = st.tuples(st.one_of(st.text(max_size=3000), python_nasty),
                       st.one_of(python_nasty, st.integers(-(2**70), 2**70)))

# name -> (strategy, check, weight in the example budget)
TARGETS = {
    "random_frames": (random_frames, check_frames, 2),
    "random_json_headers": (random_json_headers(), check_frames, 3),
    "mutated_messages": (mutated_messages(), check_frames, 8),
    "mutated_dicts": (mutated_dicts(), check_dict, 4),
    "error_reply": (error_args, check_error_reply, 1),
    "encode_header": (python_nasty, check_encode, 1),
    "parse_json": (st.one_of(st.binary(max_size=256), st.text(max_size=256)), check_parse_json, 1),
    "canonical_headers": (canonical_headers(), check_canonical, 2),
}


def _examples(total: int, name: str) -> int:
    return max(1, round(total * TARGETS[name][2] / sum(w for _, _, w in TARGETS.values())))


def _run(name: str, total: int) -> None:
    strategy, check, _ = TARGETS[name]
    run = settings(max_examples=_examples(total, name), derandomize=True, database=None, deadline=None,
                   suppress_health_check=list(HealthCheck))(given(strategy)(check))
    run()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz(name):
    _run(name, FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_slow(name):
    _run(name, FUZZ_EXAMPLES_SLOW)


# --- golden cases: the known killers, each about 100 bytes ----------------------------------------------

def _hdr(fields: bytes) -> bytes:
    return b'{"v":1,"type":"draft",' + fields + b"}"


@pytest.mark.parametrize("fields, fragment", [
    (b'"round":NaN', r"header\.round: NaN is not allowed; numbers must be finite"),
    (b'"round":Infinity', r"header\.round: Infinity is not allowed"),
    (b'"timings":{"draft_s":-Infinity}', r"header\.timings\.draft_s: -Infinity"),
    (b'"round":1e999', r"header\.round: inf is not allowed; numbers must be finite"),
    (b'"round":' + b"9" * 4301, r"header\.round: an integer of 4301 digits is not allowed"),
    (b'"round":' + b"9" * 21, r"header\.round: an integer of 21 digits"),
    (b'"round":-' + b"9" * 19, r"header\.round: -9{19} is not allowed; integers must fit int64"),
    (b'"round":9223372036854775808', r"header\.round: 9223372036854775808 is not allowed; integers must fit int64"),
    (b'"x":' + b"[" * 5000 + b"]" * 5000, "nesting depth 5001 exceeds 16"),
    (b'"x":"\\ud800"', r"header\.x: a string with a lone surrogate"),
    (b'"round":1,"round":2', "duplicate key 'round'"),
    (b'"x":[' + b"0," * 5000 + b"0]", "more than 4096 values"),  # CPU per message stays bounded
])
def test_killer_headers_are_refused(fields, fragment):
    raw = _hdr(fields)
    for decode in (lambda: P.decode([raw]), lambda: P.decode_header(raw), lambda: P.annotate_header(raw, a=1)):
        with pytest.raises(ProtocolError, match=fragment):
            decode()


@pytest.mark.parametrize("shape, fragment", [
    (b"[4294967296,4294967296]", "exceeds the limit"),  # the int64 product overflowed to 0: b"" matched it
    (b"[0,4611686018427387904]", "exceeds the limit"),  # 0 elements, but numpy refuses the dimension
    (b"[65536,65536,65536,65536]", "exceeds the limit"),
    (b"[true]", "shape"),  # bool passed as int
    (b"[2.0]", "shape"),
    (b"[1,1,1,1,1]", "shape"),
    (b'"4"', "shape"),
])
def test_killer_array_shapes_are_refused(shape, fragment):
    raw = b'{"v":1,"type":"draft","arrays":[{"name":"q","dtype":"float16","shape":' + shape + b"}]}"
    with pytest.raises(ProtocolError, match=fragment):
        P.decode([raw, b""])


def test_a_rounds_own_headers_take_the_shortcut_to_the_strict_result():
    wire = to_wire_precision(_q(L), 16)
    timings = {"draft_s": 0.0030253099994297372, "compute_s": 0.003, "emulated_extra_s": 0.0, "compute_scale": 1.0}
    for frames in (M.schedule(2, "DL", L, 0.2, 0.0, 3.0), M.schedule(2, "UL", L, 0.2, 0.1, 3.0, topk=5),
                   M.verdict(4, 2, 17), M.verdict(4, 3, None),
                   M.verdict(4, 2, 17, next_schedule=M.schedule_fields(5, "UL", L, 0.2, 0.0, 3.0)),
                   M.verdict(4, 4, 9, next_schedule=M.schedule_fields(5, "DL", L, 0.2, 0.1, 3.0, topk=5)),
                   M.report(4, 17, 2, {"correction_s": 1e-05}, None),
                   M.report(4, 17, 2, {"correction_s": 1e-05, "host_wait_s": 0.0125}, None),
                   M.draft(4, "UL", [1, 7, 49], exact_from_wire(wire), q_wire=wire, last_token=9, bits_per_prob=16,
                           on_air_vocab=ON_AIR, timings=timings),
                   M.draft(4, "UL", [1, 7, 49], exact_from_wire(wire), q_wire=wire, last_token=9, bits_per_prob=16,
                           on_air_vocab=ON_AIR, timings={**timings, "host_wait_s": 0.25}, topk=None),
                   M.draft(4, "DL", [1, 7, 49], exact_from_wire(wire), last_token=9, bits_per_prob=16,
                           on_air_vocab=None, timings=timings)):
        text = bytes(frames[0])
        assert P._canonical(text) is not None, text
        assert repr(P.decode_header(text)) == repr(P.parse_json(text))
    # What the emulator adds, a link reading, a top-k upload, a p row: the strict way.
    for frames in (VALID["draft_ul"], VALID["verdict_token"], VALID["report"], VALID["verdict_p"],
                   _flat(M.report(4, 17, 2, {"correction_s": 0.001}, None, link={"snr_db": 3.0}))):
        assert P._canonical(frames[0]) is None


def test_decode_turns_any_exception_into_protocol_error():
    with pytest.raises(ProtocolError):
        P.decode([object()])
    with pytest.raises(ProtocolError):
        P.decode(None)
    with pytest.raises(ProtocolError, match="not JSON"):
        P.decode([b'{"v":1,"type":"x","m":"' + b'\\"' * 20000])  # an unclosed string: linear, refused


def test_error_reply_never_raises_on_peer_content():
    """The edge answered a NaN round with M.error(..., round_index=nan), which raised while encoding."""
    for r in (math.nan, math.inf, 10**400, -1, True, "3", [3], {"r": 3}, 2**63):
        h = P.decode(_flat(M.error("x" * 10_000 + "\ud800", round_index=r)))[0]
        assert h["round"] is None and len(h["message"]) <= M.MAX_TEXT
    assert P.decode(_flat(M.error(10**5000, round_index=7)))[0] == {  # str() of it raises
        "v": 1, "type": "error", "message": "<int>", "round": 7, "fatal": False}


def test_encode_header_is_strict():
    with pytest.raises(ProtocolError, match=r"header\.timings\.draft_s: a non-finite number"):
        P.encode_header({"type": "draft", "timings": {"draft_s": math.inf}})
    with pytest.raises(ProtocolError, match=r"header\.x\[1\]"):
        P.encode_header({"type": "x", "x": [1.0, math.nan]})
    with pytest.raises(ProtocolError, match="strict JSON"):
        P.encode_header({"type": "x", "x": np.float32(1)})
    with pytest.raises(ProtocolError, match="exceeds"):
        P.encode_header({"type": "x", "pad": "a" * P.MAX_HEADER_BYTES})


def _draft_header(**changes) -> tuple[dict, dict]:
    header, arrays = P.decode(VALID["draft_dl"])
    header.update(changes)
    return header, arrays


@pytest.mark.parametrize("changes, fragment", [
    ({"timings": {"draft_s": "fast"}}, r"draft\.timings\.draft_s: 'fast' is not allowed"),
    ({"timings": {"draft_s": math.inf}}, r"draft\.timings\.draft_s: inf"),
    ({"timings": {"compute_s": -1.0}}, r"draft\.timings\.compute_s: -1\.0"),
    ({"timings": ["draft_s"]}, r"draft\.timings: \['draft_s'\] is not allowed"),
    ({"channel": {"bytes": "lots"}}, r"draft\.channel\.bytes: 'lots'"),
    ({"channel": {"bytes": 10**30}}, r"draft\.channel\.bytes"),
    ({"channel": {"held_s": math.nan}}, r"draft\.channel\.held_s: nan"),
    ({"channel": {"airtime_s": -5.0}}, r"draft\.channel\.airtime_s"),
    ({"channel": {"mode": "warp"}}, r"draft\.channel\.mode: 'warp'"),
    ({"channel": {"marker": 1}}, r"draft\.channel\.marker: 1"),
    ({"channel": "forged"}, r"draft\.channel: 'forged'"),
    ({"round": True}, r"draft\.round: True"),
    ({"round": -1}, r"draft\.round: -1"),
    ({"last_token": 2.0}, r"draft\.last_token: 2\.0"),
])
def test_draft_fields_that_crashed_the_edge_later_are_refused(changes, fragment):
    header, arrays = _draft_header(**changes)
    with pytest.raises(ProtocolError, match=fragment):
        PARSERS["draft_dl"](header, arrays)


def test_draft_timings_and_channel_come_out_typed():
    header, arrays = _draft_header(timings={**TIMINGS, "draft_s": 1, "gpu_s": "n/a"},
                                   channel={**CHANNEL_INFO, "rate_bps": None, "extra": [1]})
    d = PARSERS["draft_dl"](header, arrays)
    assert d.timings == {**TIMINGS, "draft_s": 1.0} and type(d.timings["draft_s"]) is float  # unknown key dropped
    assert d.channel == {**CHANNEL_INFO, "rate_bps": None}
    _check_result(d)


@pytest.mark.parametrize("changes, fragment", [
    ({"dl_channel": {"airtime_s": math.inf}}, r"report\.dl_channel\.airtime_s: inf"),
    ({"dl_channel": {"queued_s": "0"}}, r"report\.dl_channel\.queued_s"),
    ({"dl_channel": [1]}, r"report\.dl_channel: \[1\]"),
    ({"timings": {"correction_s": math.inf}}, r"report\.timings\.correction_s: inf"),
    ({"n_accepted": 10**6}, r"report\.n_accepted"),
    ({"token": True}, r"report\.token: True"),
])
def test_report_fields_are_refused(changes, fragment):
    header, _ = P.decode(VALID["report"])
    header.update(changes)
    with pytest.raises(ProtocolError, match=fragment):
        M.parse_report(header, V)


@pytest.mark.parametrize("changes, fragment", [
    ({"seed": -1}, r"registered\.seed: -1"),
    ({"seed": 1.5}, r"registered\.seed: 1\.5"),
    ({"sampling": {"temperature": math.nan}}, r"registered\.sampling\.temperature: nan"),
    ({"sampling": {"top_p": 0.0}}, r"registered\.sampling\.top_p: 0\.0"),
    ({"sampling": {"top_k": True}}, r"registered\.sampling\.top_k: True"),
    ({"sampling": {"beam": 4}}, r"registered\.sampling: unknown field\(s\) \['beam'\]"),
    ({"sampling": None}, r"registered\.sampling: None"),
    ({"bits_per_prob": 8}, r"registered\.bits_per_prob: 8"),
    ({"on_air_vocab_size": 2**40}, r"registered\.on_air_vocab_size"),
    ({"max_draft_len": 0}, r"registered\.max_draft_len: 0"),
    ({"tx_marker": "yes"}, r"registered\.tx_marker: 'yes'"),
    ({"session": ""}, r"registered\.session"),
])
def test_registered_fields_are_refused(changes, fragment):
    header, arrays = P.decode(VALID["registered"])
    header.update(changes)
    with pytest.raises(ProtocolError, match=fragment):
        M.parse_registered(header, arrays, vocab_size=V)


def test_registered_prompt_ids_are_checked():
    header, arrays = P.decode(VALID["registered"])
    for bad, fragment in ((np.array([1, -2], np.int32), r"\[-2, 1\]"), (np.array([V], np.int32), rf"\[0, {V}\)"),
                          (np.array([], np.int32), "shape"), (np.array([1.0]), "float64")):
        with pytest.raises(ProtocolError, match=r"registered\.prompt_ids.*" + fragment):
            M.parse_registered(header, {**arrays, "prompt_ids": bad}, vocab_size=V)


@pytest.mark.parametrize("hardware, fragment", [
    ([1], r"register\.hardware: \[1\]"),
    ({f"k{i}": 1 for i in range(M.MAX_HARDWARE_FIELDS + 1)}, r"register\.hardware: .* at most 16"),
    ({"compute_scale": math.inf}, r"register\.hardware\.compute_scale: inf"),
    ({"threads": True}, r"register\.hardware\.threads: True"),
    ({"name": 7}, r"register\.hardware\.name: 7"),
    ({"extra": {"nested": 1}}, r"register\.hardware\.extra"),
    ({"extra": "x" * 5000}, r"register\.hardware\.extra"),
])
def test_register_hardware_is_bounded(hardware, fragment):
    header, _ = P.decode(VALID["register"])
    with pytest.raises(ProtocolError, match=fragment):
        M.parse_register({**header, "hardware": hardware})


def test_schedule_and_verdict_fields_are_refused():
    h, a = P.decode(VALID["schedule"])
    for changes, fragment in (({"deadline_s": math.inf}, "schedule.deadline_s: inf"),
                              ({"ul_power_w": -1}, "schedule.ul_power_w: -1"),
                              ({"round": 2**31}, "schedule.round"), ({"draft_len": True}, "schedule.draft_len: True")):
        with pytest.raises(ProtocolError, match=fragment):
            M.parse_schedule({**h, **changes}, max_draft_len=8)
    h, a = P.decode(VALID["verdict_token"])
    for changes, fragment in (({"dropped": "no"}, "verdict.dropped: 'no'"), ({"token": 1.0}, "verdict.token: 1.0"),
                              ({"channel": {"late_s": math.inf}}, "verdict.channel.late_s: inf")):
        with pytest.raises(ProtocolError, match=fragment):
            PARSERS["verdict"]({**h, **changes}, a)
