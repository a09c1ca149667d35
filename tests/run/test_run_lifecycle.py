"""How a run ends, and that it loses nothing: SIGTERM, SIGINT and kill -9 of `multispin run` (no orphan,
status and summary written, every recorded round a valid JSON line), `--resume`, a run whose devices all
left, the emulator's control token, a paused device, and the clear errors (unwritable runs directory, a
port in use, a non-loopback endpoint without keys, a draft model that does not load, a full disk).

Real processes on loopback (ipc://) sockets, micro model pair; every process started here is stopped by
its pid."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from support import CLI, child_pids, kill_all, pid_alive, profile_data, start_run, wait_rounds, wait_until

from testbed.run.launcher import Launcher, RunInterrupted, interrupt_signals
from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.errors import TestbedError
from testbed.runtime.records import RunRecorder, load_progress, load_run, new_run_dir


def _write_profile(path: Path, pair, **overrides) -> Path:
    path.write_text(yaml.safe_dump(profile_data(pair, **overrides)))
    return path










def _check_rounds_file(run_dir: Path) -> list[int]:
    """Every line of rounds.jsonl is one complete JSON record; returns the round indices."""
    raw = (run_dir / "rounds.jsonl").read_text()
    assert raw.endswith("\n") or raw == ""
    return [json.loads(line)["round"] for line in raw.splitlines()]




@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT", "ctrl-c-at-a-terminal"])
def test_a_signal_ends_the_run_cleanly_and_resume_goes_on(micro_pair, tmp_path, sig, to_group):
    """`to_group`: the signal goes to the run's whole process group, as a terminal's Ctrl-C does. The children
    leave it to the run: the emulator is alive to give its stats (before: it died of the SIGINT, the run waited
    out the control timeout and lost them) and no child log holds a KeyboardInterrupt."""
    prof = _write_profile(tmp_path / "p.yaml", micro_pair, rounds=400)
    proc = start_run(prof, tmp_path / "runs", new_session=True)  # its own group, as a shell's job is
    children: list[int] = []
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        assert len(children) == 3  # the emulator and two devices
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_all([proc, *children])
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "--resume" in out
    wait_until(lambda: not [p for p in children if pid_alive(p)], 10, "the run's children gone (no orphan)")
    summary = json.loads((run_dir / "summary.json").read_text())
    meta = json.loads((run_dir / "meta.json").read_text())
    assert summary["status"] == meta["status"] == "interrupted"
    assert signal.Signals(sig).name in summary["reason"]
    assert summary["channel_stats"]["counters"]["charged"] > 0, out[-3000:]
    for log_file in (run_dir / "logs").glob("*.log"):
        assert "KeyboardInterrupt" not in log_file.read_text(), log_file.name
    rounds = _check_rounds_file(run_dir)
    assert rounds == list(range(len(rounds))) and len(rounds) >= 3 and summary["rounds"] == len(rounds)
    assert sorted(json.loads((run_dir / "outputs.json").read_text())) == ["d0", "d1"]
    assert set(meta["processes"]) == {"channel", "device-d0", "device-d1"}
    if sig != signal.SIGINT or to_group:
        return
    # --resume: the same profile (made shorter here, so that the test stays short), rounds numbered on.
    before = json.loads((run_dir / "outputs.json").read_text())
    meta["profile"]["rounds"] = len(rounds) + 3
    (run_dir / "meta.json").write_text(json.dumps(meta))
    again = subprocess.run([*CLI, "run", "--resume", str(run_dir), "--quiet", "--no-plots"], capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _check_rounds_file(run_dir) == list(range(len(rounds) + 3))
    meta = json.loads((run_dir / "meta.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert meta["status"] == summary["status"] == "complete" and summary["rounds"] == len(rounds) + 3
    assert meta["resumed"][0]["from_round"] == len(rounds) and meta["resumed"][0]["previous_status"] == "interrupted"
    after = json.loads((run_dir / "outputs.json").read_text())
    for name in ("d0", "d1"):  # each device went on from what it had generated
        old = before[name]["output_ids"]
        assert after[name]["output_ids"][: len(old)] == old and len(after[name]["output_ids"]) > len(old)
    # A complete run cannot be resumed.
    done = subprocess.run([*CLI, "run", "--resume", str(run_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "complete" in done.stderr


def test_kill_9_leaves_no_orphan_and_the_run_resumes(micro_pair, tmp_path):
    prof = _write_profile(tmp_path / "p.yaml", micro_pair, rounds=400)
    proc = start_run(prof, tmp_path / "runs")
    children: list[int] = []
    try:
        run_dir = wait_rounds(tmp_path / "runs", 3, proc)
        children = child_pids(proc.pid)
        assert len(children) == 3
        proc.kill()
        proc.wait(10)
        wait_until(lambda: not [p for p in children if pid_alive(p)], 10, "the run's children gone (no orphan)")
    finally:
        kill_all([proc, *children])
    rounds = _check_rounds_file(run_dir)
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "running"  # nobody could say otherwise
    progress = load_progress(run_dir)  # every line written survives kill -9
    assert progress["round"] >= rounds[-1] and sorted(progress["devices"]) == ["d0", "d1"]
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["profile"]["rounds"] = len(rounds) + 2
    (run_dir / "meta.json").write_text(json.dumps(meta))
    again = subprocess.run([*CLI, "run", "--resume", str(run_dir), "--quiet", "--no-plots"], capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = _check_rounds_file(run_dir)
    assert resumed[: len(rounds)] == rounds and resumed[-1] == len(rounds) + 1
    assert len(set(resumed)) == len(resumed)


def test_a_rounds_progress_line_is_on_disk_before_its_record(micro_pair, tmp_path):
    # The order that makes kill -9 lose no tokens: (round, progress log's round, last record on disk), as the
    # record is about to be written.
    run_dir, seen = tmp_path / "run", []

    def on_round(rec, server, launcher):
        if rec["round"] == 0:
            progress_line = server.before_record

            def check(r):
                progress_line(r)
                lines = (run_dir / "rounds.jsonl").read_text().splitlines()
                seen.append((r["round"], load_progress(run_dir)["round"], json.loads(lines[-1])["round"]))

            server.before_record = check

    run_live(load_profile(profile_data(micro_pair, rounds=4)), run_dir, progress=False, on_round=on_round)
    assert seen == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]


def test_a_run_whose_devices_all_left_is_incomplete(micro_pair, tmp_path):
    run_dir = tmp_path / "run"

    def on_round(rec, server, launcher):
        if rec["round"] == 1:
            for name in ("d0", "d1"):
                launcher.kill(f"device-{name}")

    summary = run_live(load_profile(profile_data(micro_pair, rounds=20, deadline_s=1.0, max_misses=1)), run_dir,
                       progress=False, on_round=on_round)
    meta, records = load_run(run_dir)
    assert summary["status"] == meta["status"] == "incomplete"
    assert "every device left" in summary["reason"] and len(records) < 20
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "incomplete"


def test_the_emulator_refuses_control_without_the_token_and_a_paused_device_comes_back(micro_pair, tmp_path):
    from channel_emulator.proxy import ChannelControl

    run_dir = tmp_path / "run"
    seen: dict = {}

    def on_round(rec, server, launcher):
        if rec["round"] == 1:
            for token in (None, "wrong"):
                ctl = ChannelControl(server.channel.endpoint, timeout_s=5.0, token=token)
                try:
                    with pytest.raises(RuntimeError, match="token"):
                        ctl.stop()
                finally:
                    ctl.close()
            # Pause a device longer than one deadline (it misses a round), then let it go on.
            pid = launcher.procs["device-d1"].pid
            os.kill(pid, signal.SIGSTOP)
            seen["stopped_at"] = rec["round"]
            threading.Timer(2.0, os.kill, (pid, signal.SIGCONT)).start()

    profile = load_profile(profile_data(micro_pair, rounds=14, deadline_s=1.0, max_misses=3,
                                         channel={"mode": "real"}))
    summary = run_live(profile, run_dir, progress=False, on_round=on_round)
    _, records = load_run(run_dir)
    assert summary["status"] == "complete" and len(records) == 14  # the emulator was not stopped
    assert any("d1" in r["missed"] for r in records[2:6])  # the paused device missed a round ...
    assert all(not r["devices"]["d1"]["missed"] for r in records[-3:])  # ... and came back
    assert summary["channel_stats"]["ok"]


def test_a_bad_draft_model_fails_the_run_fast_with_the_devices_reason(micro_pair, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    data = profile_data(micro_pair, wait_for_devices_s=120)
    data["model"]["draft_onnx"] = str(bad)
    t0 = time.monotonic()
    with pytest.raises(TestbedError) as exc:
        run_live(load_profile(data), tmp_path / "run", progress=False)
    assert time.monotonic() - t0 < 60  # not the 120 s of wait_for_devices_s
    assert "not a loadable ONNX model" in str(exc.value) and "status 2" in str(exc.value)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "no device registered" in summary["reason"]


def test_a_port_in_use_is_named_with_its_holder(micro_pair, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        data = profile_data(micro_pair, endpoints={"edge_bind": f"tcp://127.0.0.1:{port}"})
        with pytest.raises(TestbedError) as exc:
            run_live(load_profile(data), tmp_path / "run", progress=False)
    text = str(exc.value)
    assert f"port {port} is already in use" in text and f"pid {os.getpid()}" in text
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["status"] == "failed"


def test_a_lan_endpoint_needs_keys_or_insecure(micro_pair, tmp_path):
    data = profile_data(micro_pair, endpoints={"edge_bind": "tcp://0.0.0.0:0"}, channel={"mode": "passthrough"})
    with pytest.raises(TestbedError, match="without keys"):
        run_live(load_profile(data), tmp_path / "run", progress=False)
    data["security"] = {"keys": str(tmp_path / "no-such-keys")}
    with pytest.raises(TestbedError, match="no-such-keys"):
        run_live(load_profile(data), tmp_path / "run2", progress=False)


@pytest.mark.live
def test_multispin_edge_on_all_interfaces_refuses_without_keys(tmp_path):
    out = subprocess.run([*CLI, "edge", "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "tcp://0.0.0.0:5555" in out.stderr and "security: insecure" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_run_with_keys_uses_curve_everywhere(micro_pair, tmp_path, monkeypatch):
    import dataclasses

    from edge_node.server import EdgeConfig
    from testbed.runtime import records as records_module
    from testbed.runtime.security import generate_keys, stop_authenticators

    generate_keys(tmp_path / "keys", ["d0", "d1"])
    profile = load_profile(profile_data(micro_pair, rounds=4, channel={"mode": "real"},
                                         security={"keys": str(tmp_path / "keys")}, records_sync_interval_s=30))
    intervals = []  # the profile's records_sync_interval_s reaches the run's recorder
    real_init = records_module.RunRecorder.__init__

    def spy(self, *args, **kw):
        intervals.append(kw.get("sync_interval_s"))
        real_init(self, *args, **kw)

    monkeypatch.setattr(records_module.RunRecorder, "__init__", spy)
    try:
        if "keys_dir" not in {f.name for f in dataclasses.fields(EdgeConfig)}:  # an edge without CURVE: said clearly
            with pytest.raises(TestbedError, match="takes no keys_dir"):
                run_live(profile, tmp_path / "run", progress=False)
            return
        summary = run_live(profile, tmp_path / "run", progress=False)
    finally:
        stop_authenticators()
    meta, records = load_run(tmp_path / "run")
    assert summary["status"] == "complete" and len(records) == 4 and meta["security"] == "keys"
    assert intervals == [30.0]
    log = (tmp_path / "run" / "logs" / "device-d0.log").read_text()
    assert "registered" in log or "session" in log


def test_an_unwritable_runs_directory_is_a_clear_error(micro_pair, tmp_path):
    prof = _write_profile(tmp_path / "p.yaml", micro_pair)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run([*CLI, "run", str(prof), "--runs-dir", str(blocker / "runs"), "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "runs directory full or unwritable" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_profile_refuses_infinite_values_and_unknown_hardware(micro_pair):
    from testbed.run.profile import ProfileError

    data = profile_data(micro_pair)
    data["scenario"]["uplink_bandwidth_hz"] = float("inf")
    with pytest.raises(ProfileError, match="uplink_bandwidth_hz: inf"):
        load_profile(data)
    with pytest.raises(ProfileError, match="hardware.d0: hardware profile 'no-such-phone' not found"):
        load_profile(profile_data(micro_pair, hardware={"d0": "no-such-phone"}))
    assert load_profile(profile_data(micro_pair, security="insecure")).insecure
    with pytest.raises(ProfileError, match="security"):
        load_profile(profile_data(micro_pair, security="yes please"))


# --- units: records, signals, parent death ---------------------------------------------------------

def test_a_failed_write_leaves_no_torn_line_and_ends_with_a_clear_error(tmp_path, monkeypatch):
    rec = RunRecorder(tmp_path)
    rec.append_round({"round": 0, "x": 1})
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data)[:7])  # part of the line reaches the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(TestbedError, match="runs directory full or unwritable: .*No space left"):
        rec.append_round({"round": 1, "x": 2})
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / "rounds.jsonl").read_text() == '{"round":0,"x":1}\n'
    rec.append_round({"round": 1, "x": 2})
    rec.append_round({"round": 1, "x": 2})  # a repeated write of the same round is skipped
    rec.close()
    # A torn tail (a process killed mid-write by an older version) is cut when the run is reopened.
    with open(tmp_path / "rounds.jsonl", "a") as fh:
        fh.write('{"round": 2, "tru')
    rec = RunRecorder(tmp_path)
    assert rec.last_round == 1
    rec.append_round({"round": 2})
    rec.close()
    assert [json.loads(x)["round"] for x in (tmp_path / "rounds.jsonl").read_text().splitlines()] == [0, 1, 2]
    rec.end_run("failed", "why", {"rounds": 3})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"rounds": 3, "status": "failed", "reason": "why"}


def test_a_run_folder_named_after_a_plug_in_policy_is_a_plain_name(tmp_path):
    path = new_run_dir(tmp_path, "edge-mypkg.policies:My/Policy")
    assert path.parent == tmp_path and path.name.endswith("-edge-mypkg.policies-My-Policy")


def test_a_signal_during_fsync_keeps_the_whole_line_it_interrupted(tmp_path, monkeypatch):
    # A reader (the user, a test) may already have seen the line: only a partial write is cut back. (Inline
    # fsyncs: there a signal can strike between the write and the fsync.)
    rec = RunRecorder(tmp_path, sync_interval_s=0)

    def interrupted_fsync(fd):
        raise RunInterrupted(signal.SIGTERM)

    monkeypatch.setattr(os, "fsync", interrupted_fsync)
    with pytest.raises(RunInterrupted):
        rec.append_round({"round": 0, "x": 1})
    monkeypatch.undo()
    rec.append_round({"round": 0, "x": 1})  # the retry of the shutdown path is a no-op
    rec.close()
    assert (tmp_path / "rounds.jsonl").read_text() == '{"round":0,"x":1}\n'


def test_a_signal_right_after_the_write_keeps_the_line_and_the_retry_adds_none(tmp_path, monkeypatch):
    # CI: a run stopped by SIGTERM had 3 lines when the test read them and 2 after; the handler had raised
    # between the last os.write and the recorder's bookkeeping, and the line was cut back as if torn.
    rec = RunRecorder(tmp_path)
    real_write = os.write

    def write_then_signal(fd, data):
        n = real_write(fd, data)
        raise RunInterrupted(signal.SIGTERM) if n == len(data) else AssertionError("a short write")

    monkeypatch.setattr(os, "write", write_then_signal)
    with pytest.raises(RunInterrupted):
        rec.append_round({"round": 0, "x": 1})
    monkeypatch.undo()
    assert (tmp_path / "rounds.jsonl").read_text() == '{"round":0,"x":1}\n'  # as a reader may have seen it
    assert rec.last_round == 0
    rec.append_round({"round": 0, "x": 1})  # the retry of the shutdown path is a no-op
    rec.append_round({"round": 1, "x": 2})
    rec.close()
    assert (tmp_path / "rounds.jsonl").read_text() == '{"round":0,"x":1}\n{"round":1,"x":2}\n'
    assert rec.count == 2


def test_sigterm_raises_run_interrupted_once_then_the_shutdown_is_shielded():
    with interrupt_signals() as guard:
        with pytest.raises(RunInterrupted) as exc:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # not a delay: the handler's RunInterrupted ends this sleep as soon as the signal lands
        assert exc.value.signum == signal.SIGTERM and isinstance(exc.value, KeyboardInterrupt)
        guard.shield()
        os.kill(os.getpid(), signal.SIGTERM)  # logged, not raised
        time.sleep(0.05)  # the behaviour under test: the handler runs within this window and must not raise
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.live
def test_children_die_with_their_parent(tmp_path):
    code = ("import sys, time; from pathlib import Path; from testbed.run.launcher import Launcher; "
            f"p = Launcher(Path({str(tmp_path)!r})).start('sleeper', ['sleep', '60']); "
            "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        parent.kill()
        parent.wait(5)
        wait_until(lambda: not pid_alive(child), 5, "the launcher's child gone with its parent")
    finally:
        kill_all([parent, *([child] if child else [])])


@pytest.mark.live
def test_launcher_passes_the_token_in_the_environment(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(Launcher, "start", lambda self, label, argv, env=None: seen.update(argv=argv, env=env))
    Launcher(tmp_path).start_channel("ipc://f", "ipc://e", "ipc://c", "real", 0.001, token="abc", keys_dir="/k")
    assert seen["env"] == {"MULTISPIN_CHANNEL_TOKEN": "abc"}
    assert "abc" not in seen["argv"] and seen["argv"][-2:] == ["--keys", "/k"]


def test_a_killed_edge_resumed_gets_its_reconnecting_devices_back(micro_pair, tmp_path):
    """LAN workflow: `multispin edge` and two `multispin device --reconnect` processes; kill -9 of the edge
    after 3 rounds, then `multispin edge --resume RUN_DIR`: the devices notice the silence, register again
    with the new edge, and the run completes with every round once (before, devices registered once and then
    waited a fixed 300 s)."""
    prof = _write_profile(tmp_path / "p.yaml", micro_pair, rounds=5000, channel={"mode": "passthrough"},
                          heartbeat_s=0.2, liveness=5)
    ep = f"ipc://{tmp_path}/edge"
    runs = tmp_path / "runs"
    edge_cmd = [*CLI, "edge", "--bind", ep, "--quiet"]
    edge = subprocess.Popen([*edge_cmd, "--profile", str(prof), "--runs-dir", str(runs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    devices = [subprocess.Popen([*CLI, "device", "--connect", ep, "--name", name, "--draft", str(micro_pair.draft_onnx),
                                 "--reconnect"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for name in ("d0", "d1")]
    again = None
    try:
        run_dir = wait_rounds(runs, 3, edge)
        edge.kill()
        edge.wait(10)
        before = _check_rounds_file(run_dir)
        rounds = len(before) + 3  # the resumed edge runs three more (the profile asked for 5,000)
        meta = json.loads((run_dir / "meta.json").read_text())
        meta["profile"]["rounds"] = rounds
        (run_dir / "meta.json").write_text(json.dumps(meta))
        again = subprocess.Popen([*edge_cmd, "--resume", str(run_dir)], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        out, _ = again.communicate(timeout=240)
        assert again.returncode == 0, out[-3000:]
        logs = [d.communicate(timeout=30)[1] for d in devices]
        assert [d.returncode for d in devices] == [0, 0], [x[-2000:] for x in logs]
    finally:
        kill_all([p for p in (edge, again, *devices) if p is not None])
    resumed = _check_rounds_file(run_dir)
    assert resumed[: len(before)] == before and resumed == list(range(rounds))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "complete"
    assert all("registering again" in x for x in logs), [x[-1500:] for x in logs]


def test_an_interrupted_runs_outputs_are_the_progress_a_resume_starts_from(tmp_path):
    """A signal between a round's progress update in memory and its line on disk leaves the memory a round
    ahead; outputs.json must hold what `--resume` reads (the file), or the resumed run's tokens do not extend it."""
    from testbed.run.session import interrupted_outputs

    recorder = RunRecorder(tmp_path)
    on_disk = {"d0": {"output_ids": [5, 6, 7], "rounds": 2, "prompt": "def f():"}}
    recorder.write_progress({"round": 1, "devices": on_disk})
    recorder.close()
    ahead = {"d0": {"output_ids": [5, 6, 7, 8, 9], "rounds": 3, "prompt": "def f():"}}
    assert interrupted_outputs(tmp_path, ahead) == on_disk
    assert load_progress(tmp_path)["devices"] == on_disk  # what a resume starts from
    assert interrupted_outputs(tmp_path / "none", ahead) == ahead  # no progress written: what the memory holds
