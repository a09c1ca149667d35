"""Live runs with real processes and sockets: channel emulator + device processes + edge (micro pair).

Every run starts its processes through `testbed.run.launcher`, which stops each by its pid at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import zmq

from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.records import load_run
from testbed.wire import protocol as P


def _profile(pair, **overrides):
    data = {
        "name": "micro", "rounds": 10, "seed": 7, "deadline_s": 5.0, "max_misses": 2,
        "prompts": ["def parse(text):", "import os", "class Node:"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer)},
        "channel": {"mode": "real", "state": {"source": "model", "fading": "rayleigh"}},
        "on_air_vocab_size": 4096,
        "hardware": {"d1": "laptop"},
        "wait_for_devices_s": 60,
        "scenario": {
            "bits_per_prob": 16, "max_draft_len": 6, "uplink_bandwidth_hz": 2e6, "downlink_bandwidth_hz": 3e6,
            "downlink_power_w": 1.0,
            "devices": [{"name": f"d{i}", "distance_m": 100 + 150 * i, "draft_time_s": 0.001, "acceptance": 0.6}
                        for i in range(3)],
        },
    }
    for key, value in overrides.items():
        data[key] = value
    return load_profile(data)


def test_three_devices_ten_rounds(micro_pair, tmp_path):
    run_dir = tmp_path / "run"
    summary = run_live(_profile(micro_pair), run_dir, progress=False)
    meta, records = load_run(run_dir)
    assert meta["status"] == "complete" and meta["channel_mode"] == "real"
    assert len(records) == 10 and summary["rounds"] == 10
    outputs = json.loads((run_dir / "outputs.json").read_text())
    assert sorted(outputs) == ["d0", "d1", "d2"]
    for rec in records:
        assert sorted(rec["devices"]) == ["d0", "d1", "d2"] and not rec["missed"]
        for name, d in rec["devices"].items():
            assert d["mode"] in ("UL", "DL") and 1 <= d["draft_len"] <= 6
            assert 0 <= d["n_accepted"] <= d["draft_len"]
            assert d["measured"]["tokens"] == d["n_accepted"] + 1
            # Measured next to predicted for every phase of the device.
            for key in ("draft_s", "ul_air_s", "uplink_phase_s", "dl_air_s"):
                assert d["predicted"][key] is not None and d["measured"][key] is not None, (name, key)
            # The channel charged the real bytes: a UL-mode upload carries L rows of 4096 float16 values.
            if d["mode"] == "UL":
                assert d["measured"]["ul_bytes"] >= d["draft_len"] * 4096 * 2
            else:
                assert d["measured"]["ul_bytes"] < 4096
        assert rec["measured"]["verify_s"] > 0 and rec["measured"]["round_s"] > 0
    # Tokens recorded per round add up to the text each device produced.
    for name, out in outputs.items():
        produced = sum(r["devices"][name]["measured"]["tokens"] for r in records)
        assert out["output_tokens"] == produced == len(out["output_ids"])
    # The hardware profile was applied and reported (laptop: 1.5x).
    scales = {r["devices"]["d1"]["measured"]["compute_scale"] for r in records}
    assert scales == {1.5}
    # A device process imports no torch: its log would show the check below failing otherwise.
    assert (run_dir / "logs" / "device-d0.log").exists()


def test_ul_and_dl_modes_give_identical_text(micro_pair, tmp_path):
    texts = {}
    for mode in ("UL", "DL"):
        run_dir = tmp_path / mode
        run_live(_profile(micro_pair, pin={"mode": mode, "draft_len": 4}, rounds=8), run_dir, progress=False)
        _, records = load_run(run_dir)
        assert all(d["mode"] == mode and d["draft_len"] == 4 for r in records for d in r["devices"].values())
        texts[mode] = json.loads((run_dir / "outputs.json").read_text())
    for name in ("d0", "d1", "d2"):
        assert texts["UL"][name]["output_ids"] == texts["DL"][name]["output_ids"], name
        assert len(texts["UL"][name]["output_ids"]) >= 8
    # DL mode did exercise the device-side correction (some rejection happened somewhere).
    assert any(texts["DL"][n]["accepted"] < texts["DL"][n]["drafted"] for n in texts["DL"])


def test_killed_device_is_dropped_while_others_go_on_and_it_can_rejoin(micro_pair, tmp_path):
    run_dir = tmp_path / "kill"

    def on_round(rec, server, launcher):
        if rec["round"] == 2:
            launcher.kill("device-d2")
        if rec["round"] == 6:  # a fresh process under the same name joins again between rounds
            launcher.start_device("d2b", launcher.device_connect, str(micro_pair.draft_onnx), None, name="d2")
            assert server.wait_for_devices(["d2"], 60) == []

    profile = _profile(micro_pair, rounds=10, deadline_s=2.0, max_misses=2)
    run_live(profile, run_dir, progress=False, on_round=on_round)
    _, records = load_run(run_dir)
    assert len(records) == 10
    assert records[3]["missed"] == ["d2"] and records[4]["missed"] == ["d2"]
    # The round with the dead device ended within the deadline (plus the round's own work), not later.
    assert records[3]["measured"]["round_s"] < profile.deadline_s + 2.0
    # After max_misses consecutive misses the device left the session; the others went on every round.
    assert "d2" not in records[5]["devices"] and "d2" not in records[6]["devices"]
    for rec in records:
        for name in ("d0", "d1"):
            assert not rec["devices"][name]["missed"]
    # Rejoined: a new session from round 7 on, served like the others.
    for rec in records[7:]:
        assert "d2" in rec["devices"] and not rec["devices"]["d2"]["missed"]
    outputs = json.loads((run_dir / "outputs.json").read_text())
    assert outputs["d0"]["rounds"] == 10 and outputs["d2"]["rounds"] == 3 and outputs["d2"]["session"].endswith("#3")


def test_malformed_and_oversized_messages_are_refused(micro_pair, tmp_path):
    run_dir = tmp_path / "bad"
    ctx = zmq.Context.instance()
    rogue_sockets = []
    replies = []

    def rogue(identity: bytes, endpoint: str):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, identity)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        rogue_sockets.append(s)
        return s

    def on_round(rec, server, launcher):
        if rec["round"] != 1:
            return
        ep = server.endpoint
        a = rogue(b"intruder", ep)
        a.send(b"not json at all")
        a.send_multipart([b'{"v": 99, "type": "draft"}'])
        a.send_multipart([P.encode_header({"type": "draft", "round": 2, "mode": "UL",
                                           "arrays": [{"name": "q", "dtype": "float32", "shape": [10_000, 100_000]}]}),
                          b"\0" * 16])
        a.send_multipart(P.encode({"type": "register", "name": "intruder", "vocab_size": 320, "hardware": {}}))
        b = rogue(b"d9", ep)  # a name the profile does not know, then a wrong vocabulary
        b.send_multipart(P.encode({"type": "register", "name": "d9", "vocab_size": 7, "hardware": {}}))
        c = rogue(b"nan", ep)
        c.send_multipart(P.encode({"type": "draft", "round": 2, "mode": "UL", "last_token": 0},
                                  {"tokens": np.zeros(2, np.int32), "q": np.full((2, 4096), np.nan, np.float16)}))

    run_live(_profile(micro_pair, rounds=5), run_dir, progress=False, on_round=on_round)
    for s in rogue_sockets:
        while s.poll(200):
            replies.append(P.decode_header(s.recv_multipart()[0]))
        s.close(linger=0)
    _, records = load_run(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(records) == 5
    for rec in records:  # the real devices were served in every round
        assert sorted(rec["devices"]) == ["d0", "d1", "d2"] and not rec["missed"]
    assert summary["refused_messages"] >= 6
    assert len(replies) >= 6 and all(r["type"] == "error" for r in replies)
    text = " | ".join(r["message"] for r in replies)
    for fragment in ("not JSON", "protocol version 99", "exceeds the limit", "not a device of this profile",
                     "d9", "not registered"):
        assert fragment in text, fragment


def test_device_process_never_imports_torch():
    code = ("import sys, device_node.node, device_node.drafter, device_node.hardware, testbed.wire.messages; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _write_profile(path, pair, **overrides):
    import yaml

    data = _profile(pair, **overrides).snapshot()
    path.write_text(yaml.safe_dump(data))
    return path


# The `multispin` entry point's function, in this test's interpreter.
CLI = [sys.executable, "-c", "import sys; from testbed.cli import main; sys.exit(main(sys.argv[1:]))"]


def _multispin(*args, timeout=240):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_run_report_and_compare_commands(micro_pair, tmp_path):
    prof = _write_profile(tmp_path / "p.yaml", micro_pair, rounds=3)
    out = _multispin("run", str(prof), "--runs-dir", str(tmp_path / "runs"), "--quiet", "--channel", "virtual")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run_dirs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    for f in ("meta.json", "rounds.jsonl", "outputs.json", "summary.json", "plots/timeline.png"):
        assert (run_dir / f).exists(), f
    assert json.loads((run_dir / "meta.json").read_text())["channel_mode"] == "virtual"
    assert "goodput: measured" in out.stdout
    rep = _multispin("report", str(run_dir), "--no-plots")
    assert rep.returncode == 0 and "verify" in rep.stdout and "p95" in rep.stdout
    bad = _multispin("run", str(prof), "--set", "deadline_s=-3")
    assert bad.returncode == 2 and "deadline_s" in bad.stderr
    cmp_ = _multispin("compare", str(prof), "--policies", "all-ul,all-dl", "--rounds", "3", "--channel", "virtual",
                      "--runs-dir", str(tmp_path / "cmp"), "--quiet")
    assert cmp_.returncode == 0, cmp_.stdout[-2000:] + cmp_.stderr[-2000:]
    table = json.loads(next((tmp_path / "cmp").glob("*/compare.json")).read_text())
    assert table["policies"] == ["all-ul", "all-dl"] and table["repeats"] == 1
    assert [row["policy"] for row in table["per_policy"]] == ["all-ul", "all-dl"]
    assert all(row["runs"] == 1 and row["measured_mean_tps"] > 0 for row in table["per_policy"])
    for policy, mode in (("all-ul", "UL"), ("all-dl", "DL")):
        _, recs = load_run(next((tmp_path / "cmp").glob(f"*/{policy}")))
        assert all(d["mode"] == mode for r in recs for d in r["devices"].values())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lan_commands_over_tcp(micro_pair, tmp_path):
    """`multispin edge` and `multispin device` as separate processes over TCP (the LAN deployment)."""
    port = _free_port()
    prof = _write_profile(tmp_path / "lan.yaml", micro_pair, rounds=4, deployment="lan",
                          channel={"mode": "passthrough"}, wait_for_devices_s=60)
    edge = subprocess.Popen([*CLI, "edge", "--profile", str(prof), "--bind",
                             f"tcp://127.0.0.1:{port}", "--runs-dir", str(tmp_path / "runs"), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    devices = [subprocess.Popen([*CLI, "device", "--connect", f"tcp://127.0.0.1:{port}",
                                 "--name", f"d{i}", "--draft", str(micro_pair.draft_onnx), "--hardware", "edge-class"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(3)]
    try:
        out, _ = edge.communicate(timeout=180)
        codes = [d.wait(30) for d in devices]
    finally:
        for p in [edge, *devices]:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert edge.returncode == 0, out[-3000:]
    assert codes == [0, 0, 0]
    run_dir = next((tmp_path / "runs").iterdir())
    _, recs = load_run(run_dir)
    assert len(recs) == 4 and all(sorted(r["devices"]) == ["d0", "d1", "d2"] for r in recs)
    # No channel emulator: no air-time annotation, the edge-clock phases are still measured.
    d = recs[-1]["devices"]["d0"]
    assert d["ul_channel"] is None and d["measured"]["uplink_phase_s"] > 0


def test_sessions_end_at_max_new_tokens(micro_pair, tmp_path):
    run_dir = tmp_path / "short"
    run_live(_profile(micro_pair, rounds=30, max_new_tokens=6, channel={"mode": "virtual"}), run_dir, progress=False)
    _, records = load_run(run_dir)
    outputs = json.loads((run_dir / "outputs.json").read_text())
    assert all(6 <= o["output_tokens"] < 6 + 7 for o in outputs.values())  # stops at the first round past 6
    assert len(records) < 30  # the run ended when every session was done
    logs = sorted((run_dir / "logs").glob("device-*.log"))
    assert all("done (generated" in p.read_text() for p in logs)
