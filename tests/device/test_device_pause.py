"""A device process stopped for longer than the liveness window (SIGSTOP, as a laptop suspend does), then
continued (issue 35): it reads what the edge sent before judging it, finds its session ended, registers again
under its name and serves rounds again; the run completes with its rounds after the pause. A real device
process against a real edge (in the test's thread, a scripted second device keeping the rounds going). Every
process started here is stopped by its pid."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from support import NAME, FakeVerifier, ScriptedDevice, make_server, start_device, stop

from device_node.options import ExitCode
from edge_node.controller import Controller
from edge_node.server import EdgeServer
from testbed.core.sampling import SamplingParams
from testbed.run.scenario_file import load_scenario


def test_a_device_stopped_past_its_liveness_rejoins_and_serves_on(micro_pair, tmp_path, caplog):
    from device_node.drafter import OnnxDrafter

    vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
    ep = f"ipc://{tmp_path}/edge"
    window_s, pause_s = 1.5, 4.0  # heartbeat 0.5 s x liveness 3; stopped for more than twice that
    server = make_server(ep, names=(NAME, "dev1"), vocab=vocab, heartbeat_s=0.5, liveness=3, deadline_s=1.0)
    other = ScriptedDevice(ep, "dev1", vocab=vocab)
    log_path = tmp_path / "device.log"
    proc = start_device(micro_pair, ep, log_path)
    stopped = False
    try:
        other.start()
        assert server.wait_for_devices([NAME, "dev1"], 60) == []
        sid = server.sessions[NAME].sid
        r, records = 0, []
        t_stop = t_cont = None
        with caplog.at_level(logging.INFO, logger="multispin.edge"):
            while True:
                records += server.run(r + 1, start_round=r)
                r += 1
                server.poll(time.monotonic() + 0.05)
                mine = [rec for rec in records if NAME in rec["devices"] and NAME not in rec["missed"]]
                if t_stop is None and len(mine) >= 3:
                    os.kill(proc.pid, signal.SIGSTOP)
                    stopped, t_stop, r_stop = True, time.monotonic(), r
                elif t_cont is None and t_stop is not None and time.monotonic() - t_stop >= pause_s:
                    os.kill(proc.pid, signal.SIGCONT)
                    stopped, t_cont, r_cont = False, time.monotonic(), r
                elif t_cont is not None and sum(rec["round"] >= r_cont for rec in mine) >= 3:
                    break
                assert proc.poll() is None, f"the device left (exit {proc.returncode})"
                assert time.monotonic() - (t_cont or time.monotonic()) < 60, "the device did not come back"
        # The edge ended its session while it was stopped, and it came back as itself, under a new session.
        assert f"{NAME}: left the session: silent for" in caplog.text
        assert server.sessions[NAME].sid != sid
        while_stopped = [rec for rec in records if r_stop < rec["round"] < r_cont]
        assert while_stopped and all(set(rec["devices"]) - set(rec["missed"]) == {"dev1"} for rec in while_stopped)
        server.finish("test over")
        assert proc.wait(20) == ExitCode.OK
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        stop(proc)
        other.stop.set()
        other.join(5)
        server.close()
    text = log_path.read_text()
    assert "Traceback" not in text and "was silent" not in text, text[-3000:]
    assert "registering again" in text
    assert window_s < pause_s


def test_a_device_that_misses_rounds_takes_their_dropped_verdicts(micro_pair, tmp_path):
    """deadline_s=0.25, every device in UL mode: a device stopped for 0.5 s misses its rounds and gets a `dropped`
    verdict for each, which it takes as such (before: refused as "a distribution p for n_accepted=0 in mode
    UL"), then serves on."""
    from device_node.drafter import OnnxDrafter

    vocab = OnnxDrafter(micro_pair.draft_onnx).vocab_size
    ep = f"ipc://{tmp_path}/edge"
    scen = load_scenario({"bits_per_prob": 16, "max_draft_len": 4, "vocab_size": vocab,
                          "devices": [{"name": n, "distance_m": 100 + 50 * i, "draft_time_s": 0.001,
                                       "acceptance": 0.9} for i, n in enumerate((NAME, "dev1"))]})
    server = EdgeServer(ep, FakeVerifier(vocab), scenario=scen, controller=Controller(scen, policy="all-ul"),
                        prompts=[[1, 2, 3]], sampling=SamplingParams(), vocab_size=vocab, deadline_s=0.25,
                        max_misses=1000, heartbeat_s=0.5, liveness=10)
    other = ScriptedDevice(ep, "dev1", vocab=vocab)
    log_path = tmp_path / "device.log"
    proc = start_device(micro_pair, ep, log_path)
    timers: list[threading.Timer] = []
    try:
        other.start()
        assert server.wait_for_devices([NAME, "dev1"], 60) == []
        records = []
        for r in range(30):
            if r in (3, 10, 17):  # stopped for two deadlines: it misses this round, perhaps the next
                os.kill(proc.pid, signal.SIGSTOP)
                timers.append(threading.Timer(0.5, os.kill, (proc.pid, signal.SIGCONT)))
                timers[-1].start()
            records += server.run(r + 1, start_round=r, join_wait_s=0.05)
        assert proc.poll() is None
        missed = [rec["round"] for rec in records if NAME in rec["missed"]]
        assert {3, 10, 17} <= set(missed), missed
        assert all(rec["devices"][NAME]["mode"] == "UL" for rec in records if NAME in rec["devices"])
        served = [rec["round"] for rec in records if NAME in rec["devices"] and NAME not in rec["missed"]]
        assert served[-1] >= 25 and len(served) >= 20, served
        server.finish("test over")
        assert proc.wait(20) == ExitCode.OK
    finally:
        for t in timers:
            t.join(5)
        stop(proc)
        other.stop.set()
        other.join(5)
        server.close()
    text = log_path.read_text()
    assert "Traceback" not in text and "a distribution p" not in text and "dropped a verdict" not in text, text[-3000:]
    assert text.count("dropped by the edge") >= 3
