"""Rehearsals: a busy-polling node reruns the last message's checks while it waits (`testbed.runtime.waiting`)."""

from __future__ import annotations

import json
import re
import time

import pytest
import zmq

from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.records import load_run
from testbed.runtime.waiting import REHEARSE_ENV, REHEARSE_EVERY_S, rehearsal_wanted, wait_readable


@pytest.fixture()
def pair_of_sockets():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://rehearse")
    b.connect("inproc://rehearse")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


@pytest.mark.live
def test_a_busy_wait_rehearses_at_its_pace_and_a_sleeping_one_never(pair_of_sockets):
    _, b = pair_of_sockets
    calls = []
    t = time.monotonic()
    assert not wait_readable(b, 0.1, busy=True, rehearse=lambda: calls.append(time.monotonic()))
    waited = time.monotonic() - t
    # One per REHEARSE_EVERY_S at most (the first after one period); a loaded host may fit fewer.
    assert 1 <= len(calls) <= waited / REHEARSE_EVERY_S + 1
    assert all(b - a >= REHEARSE_EVERY_S for a, b in zip(calls, calls[1:]))
    calls.clear()
    assert not wait_readable(b, 0.01, busy=False, rehearse=lambda: calls.append(1))
    assert calls == []


@pytest.mark.live
def test_a_failing_rehearsal_is_dropped_for_that_wait_and_the_message_still_comes(pair_of_sockets):
    a, b = pair_of_sockets
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("stale frames")

    assert not wait_readable(b, 0.05, busy=True, rehearse=broken)
    assert calls == [1]  # left out for the rest of that wait

    def sends_then_breaks():  # a message that comes during a failing rehearsal
        a.send(b"draft")
        raise RuntimeError("stale frames")

    assert wait_readable(b, 5.0, busy=True, rehearse=sends_then_breaks)
    assert b.recv() == b"draft"


def test_rehearsals_are_on_unless_the_environment_says_off(monkeypatch):
    monkeypatch.delenv(REHEARSE_ENV, raising=False)
    assert rehearsal_wanted()
    monkeypatch.setenv(REHEARSE_ENV, "off")
    assert not rehearsal_wanted()
    monkeypatch.setenv(REHEARSE_ENV, "maybe")
    with pytest.raises(ValueError, match="MULTISPIN_REHEARSE='maybe': must be on or off"):
        rehearsal_wanted()


def _profile(pair, **extra):
    return load_profile({
        "name": "rehearse", "rounds": 12, "seed": 5, "deadline_s": 5.0, "wait_for_devices_s": 60,
        "prompts": ["def parse(text):"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer)},
        "channel": {"mode": "passthrough"}, "pin": {"mode": "UL", "draft_len": 4},
        "scenario": {"bits_per_prob": 16, "max_draft_len": 6,
                     "devices": [{"name": "d0", "distance_m": 100, "draft_time_s": 0.001, "acceptance": 0.6}]},
        **extra,
    })


def _run(profile, run_dir):
    seen = {}

    def on_round(rec, server, launcher):
        seen["edge_rehearsals"] = server.rehearsal.count
        if server.rehearsal.run is not None:  # a rehearsal between rounds changes nothing the next round sees
            assert server.rehearsal.run() is None

    run_live(profile, run_dir, progress=False, on_round=on_round)
    _, records = load_run(run_dir)
    outputs = json.loads((run_dir / "outputs.json").read_text())
    log = (run_dir / "logs" / "device-d0.log").read_text()
    return records, outputs, seen.get("edge_rehearsals", 0), log


def test_busy_polling_nodes_rehearse_without_changing_a_token(micro_pair, tmp_path, monkeypatch):
    # A slow phone (5x its drafting time) keeps the edge waiting for each draft on any machine.
    profile = _profile(micro_pair, busy_poll="on", hardware={"d0": "phone-slow"})
    monkeypatch.setenv(REHEARSE_ENV, "off")
    recs_off, out_off, edge_off, log_off = _run(profile, tmp_path / "off")
    monkeypatch.setenv(REHEARSE_ENV, "on")  # the device process inherits it
    recs_on, out_on, edge_on, log_on = _run(profile, tmp_path / "on")
    assert len(recs_on) == len(recs_off) == 12
    assert out_on["d0"]["output_ids"] == out_off["d0"]["output_ids"]
    assert [r["devices"]["d0"]["n_accepted"] for r in recs_on] == [r["devices"]["d0"]["n_accepted"]
                                                                   for r in recs_off]
    assert edge_off == 0 and "rehearsed" not in log_off
    # The edge waits for each draft while the device drafts, the device for each verdict and for the bye.
    assert edge_on > 0, edge_on
    device_rehearsals = int(re.search(r"rehearsed a verdict's checks (\d+) times", log_on).group(1))
    assert device_rehearsals > 0 and "Traceback" not in log_on
