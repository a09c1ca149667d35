"""A registered device that uploads distributions that are not distributions (testbed/wire/validate.py): the
edge refuses each such draft with an `error` naming the field, drops it from the round (the round record says
why), keeps serving the honest devices, and ends the offender's session after `max_invalid_payloads` in a row."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from support import ScriptedDevice, V, make_server

from testbed.wire import protocol as P

pytestmark = pytest.mark.live  # the edge on real sockets


def _bad_draft(sched, last_token: int, kind: int) -> list:
    """A draft of the scheduled mode whose q is invalid: UL rows with a NaN, a negative entry or a row summing to
    0.9; DL q at a drafted token of 0, 1.5 or NaN."""
    L = sched.draft_len
    toks = np.ones(L, np.int32)
    header = {"type": P.DRAFT, "air": "ul", "round": sched.round, "mode": sched.mode, "last_token": last_token,
              "timings": {"draft_s": 0.001}}
    if sched.mode == "UL":
        q = np.full((L, V), 1.0 / V, np.float16)
        if kind == 0:
            q[0, 5] = np.nan
        elif kind == 1:
            q[L - 1, 3] = -q[L - 1, 3]
        else:
            q[0] *= np.float16(0.9)
        return P.encode(header, {"tokens": toks, "q": q})
    q_at = np.full(L, 0.5)
    q_at[0] = (0.0, 1.5, np.nan)[kind % 3]
    return P.encode(header, {"tokens": toks, "q_at": q_at})


class Offender(ScriptedDevice):
    """Sends an invalid draft whenever `pattern[i % len(pattern)]` is true for its i-th draft, else an honest one."""

    def __init__(self, *args, pattern=(True,), **kw):
        super().__init__(*args, **kw)
        self.pattern, self.sent, self.bad_sent = pattern, 0, 0

    def _draft(self, sched, last_token):
        bad = self.pattern[self.sent % len(self.pattern)]
        self.sent += 1
        if not bad:
            return super()._draft(sched, last_token)
        self.bad_sent += 1
        return _bad_draft(sched, last_token, self.bad_sent % 3)


@pytest.fixture
def ipc(tmp_path):
    return f"ipc://{tmp_path}/edge"


def _serve(ipc, rounds: int, pattern, mode: str | None = None, **kw):
    server = make_server(ipc, names=("dev0", "dev1", "dev2"), deadline_s=3.0, liveness=25, **kw)
    server.controller.pin_mode, server.controller.pin_draft_len = mode, 4 if mode else None  # every device in mode
    devices = [ScriptedDevice(ipc, "dev0"), ScriptedDevice(ipc, "dev1"), Offender(ipc, "dev2", pattern=pattern)]
    for d in devices:
        d.start()
    try:
        assert server.wait_for_devices(["dev0", "dev1", "dev2"], 10.0) == []
        records = server.run(rounds)
    finally:
        server.close()
        for d in devices:
            d.stop.set()
        for d in devices:
            d.join(5)
    return server, records, devices[2]


@pytest.mark.parametrize("mode", ["UL", "DL"])
def test_an_offender_is_refused_recorded_and_ends_its_session_after_max_invalid_payloads(ipc, caplog, mode):
    caplog.set_level(logging.WARNING, logger="multispin.edge")
    server, records, bad = _serve(ipc, 6, (True,), mode, max_invalid_payloads=3)
    assert len(records) == 6
    for rec in records:  # the honest devices are served every round, and no round waits for the deadline
        assert not rec["devices"]["dev0"]["missed"] and not rec["devices"]["dev1"]["missed"]
        assert rec["measured"]["round_s"] < 1.0, rec["measured"]["round_s"]
    # Rounds 0-2: the offender's draft is dropped, and the record says why
    offended = [rec for rec in records if "dev2" in rec["devices"]]
    assert len(offended) == 3
    for rec in offended:
        entry = rec["devices"]["dev2"]
        assert entry["mode"] == mode
        assert entry["missed"] and entry["missed_reason"].startswith("draft refused: 'draft.q"), entry
    # Each refusal got an error naming the field and why; the third ended the session
    assert bad.bad_sent == 3 and len(bad.errors) == 3, bad.errors
    assert all(e.startswith(("draft.q:", "draft.q_at:")) for e in bad.errors), bad.errors
    assert any(w in e for e in bad.errors for w in ("NaN", "negative", "sums to", "q = 0", "(0, 1]"))
    assert bad.bye is not None and "3 invalid payloads in a row" in bad.bye, bad.bye
    assert "dev2" not in server.sessions and server.refusals["invalid"] == 3
    assert any("dev2: left the session: 3 invalid payloads in a row" in r.getMessage() for r in caplog.records)
    assert all("dev2" not in rec["devices"] for rec in records[3:])  # no longer scheduled


def test_a_valid_draft_resets_the_count(ipc):
    # Two invalid drafts, then a valid one, over and over: never 3 in a row, so it stays in the run.
    server, records, bad = _serve(ipc, 7, (True, True, False), max_invalid_payloads=3)
    assert "dev2" in server.sessions and bad.bye is None
    assert bad.bad_sent >= 4 and server.refusals["invalid"] == bad.bad_sent
    assert sum(not rec["devices"]["dev2"]["missed"] for rec in records) >= 2
