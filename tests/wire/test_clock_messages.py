"""The clock exchange on the wire: requests, replies and results round-trip; bad values are refused naming the
field; `registered.clock` is optional both ways (an older edge sends none, an older device ignores it)."""

from __future__ import annotations

import pytest

from testbed.wire import messages as M
from testbed.wire import protocol as P
from testbed.wire.protocol import ProtocolError


def header(frames: list) -> dict:
    return P.decode(frames)[0]


def test_clock_messages_round_trip():
    assert M.parse_clock(header(M.clock_request(1.7e9)), reply=False) == (1.7e9,)
    assert M.parse_clock(header(M.clock_reply(1.7e9, 1.7e9 + 2, 1.7e9 + 2.001)), reply=True) == \
        (1.7e9, 1.7e9 + 2, 1.7e9 + 2.001)
    assert M.parse_clock(header(M.clock_result(-2.0, 0.004, 5)), reply=False) == \
        {"offset_s": -2.0, "rtt_s": 0.004, "exchanges": 5}
    assert P.CLOCK in M.MESSAGE_TYPES


@pytest.mark.parametrize("h, reply, field", [
    ({"type": "clock"}, False, "clock.t0: missing"),
    ({"type": "clock", "t0": float("nan")}, False, "clock.t0"),
    ({"type": "clock", "t0": -1.0}, False, "clock.t0"),
    ({"type": "clock", "t0": 1.0, "t1": 2.0}, True, "clock.t2: missing"),
    ({"type": "clock", "t0": 1.0, "t1": "x", "t2": 2.0}, True, "clock.t1"),
    ({"type": "clock", "result": {"offset_s": 1.0}}, False, "clock.result"),
    ({"type": "clock", "result": {"offset_s": 1.0, "rtt_s": -0.1, "exchanges": 3}}, False, "clock.result.rtt_s"),
    ({"type": "clock", "result": {"offset_s": 1e12, "rtt_s": 0.1, "exchanges": 3}}, False, "clock.result.offset_s"),
    ({"type": "clock", "result": {"offset_s": 1.0, "rtt_s": 0.1, "exchanges": 0}}, False, "clock.result.exchanges"),
    ({"type": "clock", "result": [1, 2, 3]}, False, "clock.result"),
])
def test_bad_clock_values_are_refused_naming_the_field(h, reply, field):
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        M.parse_clock(h, reply=reply)


def test_registered_clock_is_optional():
    common = dict(seed=1, sampling={}, bits_per_prob=16, on_air_vocab_size=None, max_draft_len=4)
    old = header(M.registered("s#0", [1, 2], **common))
    assert "clock" not in old and M.parse_registered(old, P.decode(M.registered("s#0", [1, 2], **common))[1]).clock \
        is False
    frames = M.registered("s#0", [1, 2], **common, clock=True)
    h, arrays = P.decode(frames)
    assert h["clock"] is True and M.parse_registered(h, arrays).clock is True
    with pytest.raises(ProtocolError, match=r"registered\.clock"):
        M.parse_registered({**h, "clock": "yes"}, arrays)
