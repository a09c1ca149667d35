"""Pass-through rounds scheduled ahead (the next schedule with this round's verdicts) and busy-polling
sockets: same tokens, rounds that tile the run's time, and the rule that turns busy-polling on."""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.records import load_run
from testbed.runtime.waiting import busy_poll_wanted, wait_readable
from testbed.wire import messages as M


def _profile(pair, channel: str, mode: str, **extra):
    return load_profile({
        "name": "ahead", "rounds": 10, "seed": 3, "deadline_s": 5.0, "wait_for_devices_s": 60,
        "prompts": ["def parse(text):", "import os"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer)},
        "channel": {"mode": channel}, "pin": {"mode": mode, "draft_len": 4},
        "scenario": {"bits_per_prob": 16, "max_draft_len": 6,
                     "devices": [{"name": f"d{i}", "distance_m": 100 + 100 * i, "draft_time_s": 0.001,
                                  "acceptance": 0.6} for i in range(2)]},
        **extra,
    })


def _run(profile, run_dir):
    run_live(profile, run_dir, progress=False)
    meta, records = load_run(run_dir)
    return meta, records, json.loads((run_dir / "outputs.json").read_text())


def test_rounds_scheduled_ahead_give_the_same_tokens_and_tile_the_time(micro_pair, tmp_path):
    _, real, real_out = _run(_profile(micro_pair, "real", "UL"), tmp_path / "real")
    meta, ahead, ahead_out = _run(_profile(micro_pair, "passthrough", "UL"), tmp_path / "ahead")
    assert meta["status"] == "complete"
    assert not any(r["scheduled_ahead"] for r in real)  # an emulated channel keeps its rounds apart
    # UL mode: the edge holds every token at its verdicts, so every round after the first goes out ahead.
    assert [r["scheduled_ahead"] for r in ahead] == [False] + [True] * 9
    for name in ("d0", "d1"):
        assert ahead_out[name]["output_ids"] == real_out[name]["output_ids"], name
        produced = sum(r["devices"][name]["measured"]["tokens"] for r in ahead)
        assert produced == len(ahead_out[name]["output_ids"]), name  # every report came: all tokens credited
    # A round scheduled ahead starts where the previous one ends: the round times add up to the run's time.
    for prev, nxt in zip(ahead, ahead[1:]):
        assert nxt["t_start_s"] == pytest.approx(prev["t_start_s"] + prev["measured"]["round_s"], abs=1e-6)
        assert nxt["edge_phases_s"]["between_s"] == pytest.approx(0.0, abs=1e-6)


def _scripted_rounds(tmp_path, rounds: int, features: list[tuple]):
    """`rounds` pass-through rounds scheduled ahead with scripted devices dev0, dev1, ... listing `features`;
    the records, the (closed) edge and the devices."""
    from support import ScriptedDevice, make_server

    ep = f"ipc://{tmp_path}/edge"
    server = make_server(ep, names=[f"dev{i}" for i in range(len(features))], schedule_ahead=True, liveness=25)
    devices = [ScriptedDevice(ep, f"dev{i}", features=f) for i, f in enumerate(features)]
    try:
        for d in devices:
            d.start()
        assert server.wait_for_devices([d.name for d in devices], 10.0) == []
        records = server.run(rounds)
    finally:
        server.close()
        for d in devices:
            d.stop.set()
            d.join(5)
    return records, server, devices


@pytest.mark.live
def test_the_next_schedule_rides_in_the_verdict_of_a_device_that_lists_it(tmp_path):
    # dev0 lists schedule_in_verdict: after the first round its schedules come inside its verdicts; dev1 (a device
    # of an older release) gets each as a message of its own, right behind its verdict. Both take every round.
    records, _, (new, old) = _scripted_rounds(tmp_path, 6, [(M.SCHEDULE_IN_VERDICT,), ()])
    assert [r["scheduled_ahead"] for r in records] == [False] + [True] * 5
    assert not any(r["missed"] for r in records)
    assert (new.schedules, new.schedules_inside) == (1, 5) and (old.schedules, old.schedules_inside) == (6, 0)
    # The verdict's bytes in the records leave the schedule inside out (schedules are not charged).
    for name, d in (("dev0", new), ("dev1", old)):
        assert [r["devices"][name]["measured"]["dl_bytes"] for r in records] == d.verdict_bytes[:6], name


@pytest.mark.live
def test_a_verdict_that_cannot_be_sent_costs_its_device_only(tmp_path, monkeypatch):
    # Verdicts scheduled ahead go out after every verdict is decided: one that fails to build ends its device's
    # session (as an unverifiable draft does), and the other device's rounds go on.
    import edge_node.server as server_module

    build = M.verdict

    def failing(round_index, *args, **kwargs):
        if round_index == 2 and failing.once:
            failing.once = False
            raise ValueError("simulated failure")
        return build(round_index, *args, **kwargs)

    failing.once = True
    monkeypatch.setattr(server_module.M, "verdict", failing)
    records, server, _ = _scripted_rounds(tmp_path, 5, [(M.SCHEDULE_IN_VERDICT,)] * 2)
    assert len(records) == 5 and not failing.once
    # dev0's verdict of round 2 failed (the first built): it misses round 2 and round 3, scheduled with that
    # verdict, and is gone after; dev1 takes every round.
    assert [r["missed"] for r in records] == [[], [], ["dev0"], ["dev0"], []]
    assert sorted(records[4]["devices"]) == ["dev1"] and "dev0" not in server.sessions
    assert [r["scheduled_ahead"] for r in records] == [False, True, True, True, False]


def test_a_dl_correction_waits_for_its_report_before_the_next_round(micro_pair, tmp_path):
    _, ul, ul_out = _run(_profile(micro_pair, "passthrough", "UL"), tmp_path / "ul")
    _, dl, dl_out = _run(_profile(micro_pair, "passthrough", "DL"), tmp_path / "dl")
    for name in ("d0", "d1"):
        assert dl_out[name]["output_ids"] == ul_out[name]["output_ids"], name
    for prev, nxt in zip(dl, dl[1:]):
        corrected = any(d["n_accepted"] < d["draft_len"] for d in prev["devices"].values())
        # A rejection in DL mode: the device samples the token, so the next round waits for its report.
        assert nxt["scheduled_ahead"] is (not corrected), prev["round"]
    assert any(r["scheduled_ahead"] for r in dl) and not all(r["scheduled_ahead"] for r in dl[1:])


def test_busy_polling_devices_and_edge_run_the_same_rounds(micro_pair, tmp_path):
    _, _, plain_out = _run(_profile(micro_pair, "passthrough", "UL", busy_poll="off"), tmp_path / "off")
    meta, records, busy_out = _run(_profile(micro_pair, "passthrough", "UL", busy_poll="on"), tmp_path / "on")
    assert meta["busy_poll"] is True and len(records) == 10
    assert {n: o["output_ids"] for n, o in busy_out.items()} == {n: o["output_ids"] for n, o in plain_out.items()}
    log = (tmp_path / "on" / "logs" / "device-d0.log").read_text()
    assert "Traceback" not in log


def test_auto_busy_polls_only_with_a_core_per_process():
    assert busy_poll_wanted("auto", 2, cores=2) and not busy_poll_wanted("auto", 3, cores=2)
    assert busy_poll_wanted("on", 50, cores=2) and not busy_poll_wanted("off", 1, cores=64)
    with pytest.raises(ValueError, match="busy_poll: 'sometimes'"):
        busy_poll_wanted("sometimes", 1)


@pytest.mark.live
@pytest.mark.parametrize("busy", [False, True])
def test_wait_readable_sees_a_message_and_otherwise_waits_its_timeout(busy):
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://wait")
        b.connect("inproc://wait")
        t = time.monotonic()
        assert not wait_readable(b, 0.05, busy=busy)
        assert time.monotonic() - t >= 0.045
        sender = threading.Timer(0.02, lambda: a.send(b"x"))
        sender.start()
        t = time.monotonic()
        assert wait_readable(b, 5.0, busy=busy)
        assert time.monotonic() - t < 4.0 and b.recv() == b"x"
        sender.join()
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
