"""Warm trials (`testbed.run.warm.WarmPool`): the second trial of a pool reuses the first one's target, emulator
and device processes, and gives the tokens a cold run of the same settings gives (temperature 0); its run
directory is its own (meta, records, the processes' logs of this trial only); a trial with another device set
starts cold and says why; `close` stops every process.

Real processes on private ipc:// sockets, micro model pair; every process started is stopped by its pid."""

from __future__ import annotations

import json
from pathlib import Path

from support import pid_alive, profile_data

from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.run.warm import WarmPool
from testbed.runtime.records import iter_rounds


def _profile(pair, devices: int = 2, **overrides):
    # fixed-length: draft lengths that no timing moves, so at temperature 0 the tokens of each round are given
    data = profile_data(pair, **{"rounds": 4, "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0},
                                 "channel": {"mode": "real"}, "policy": "fixed-length", "fixed_length": 3,
                                 **overrides})
    data["scenario"]["devices"] = data["scenario"]["devices"][:devices]
    return load_profile(data)


def _tokens(run_dir: Path) -> dict[str, list[int]]:
    return {n: e["output_ids"] for n, e in json.loads((run_dir / "outputs.json").read_text()).items()}


def _outcomes(run_dir: Path) -> list[dict]:
    return [{n: (d["draft_len"], d["n_accepted"], d["missed"]) for n, d in r["devices"].items()}
            for r in iter_rounds(run_dir)]


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def test_a_warm_trial_gives_a_cold_runs_tokens_and_its_own_records(micro_pair, tmp_path):
    said: list[str] = []
    base = _profile(micro_pair)
    with WarmPool(say=said.append) as pool:
        first = run_live(base.model_copy(update={"policy": "all-ul"}), tmp_path / "first", progress=False, pool=pool)
        warm = run_live(base, tmp_path / "warm", progress=False, pool=pool)
        kept = dict(pool.launcher.pids())
        assert kept and all(pid_alive(p) for p in kept.values())
        other = run_live(_profile(micro_pair, devices=1), tmp_path / "one-device", progress=False, pool=pool)
        assert not any(pid_alive(p) for p in kept.values())  # the two-device processes were stopped for it
    cold = run_live(base, tmp_path / "cold", progress=False)
    assert {first["status"], warm["status"], other["status"], cold["status"]} == {"complete"}

    assert _tokens(tmp_path / "warm") == _tokens(tmp_path / "cold")  # greedy: the target's tokens, warm or cold
    assert all(len(ids) > 0 for ids in _tokens(tmp_path / "warm").values())
    meta_first, meta_warm = _meta(tmp_path / "first"), _meta(tmp_path / "warm")
    assert meta_first["warm"] == {"trial": 1, "reused_processes": False}
    assert meta_warm["warm"] == {"trial": 2, "reused_processes": True}
    assert meta_warm["pids"] == meta_first["pids"]  # the very same processes
    assert set(meta_warm["processes"].values()) == {None}  # still running at the trial's end: the pool's
    assert _meta(tmp_path / "one-device")["warm"] == {"trial": 3, "reused_processes": False}
    # The records but their timings: round by round, each device's draft length, accepted tokens, miss.
    assert _outcomes(tmp_path / "warm") == _outcomes(tmp_path / "cold")
    assert [r["round"] for r in iter_rounds(tmp_path / "warm")] == [0, 1, 2, 3]
    # Each trial's logs hold its own part of the processes' logs: one session per device.
    for run in ("first", "warm"):
        log = (tmp_path / run / "logs" / "device-d0.log").read_text()
        assert log.count("d0: session ") == 1, log
    stats = json.loads((tmp_path / "warm" / "summary.json").read_text())["channel_stats"]
    cold_stats = json.loads((tmp_path / "cold" / "summary.json").read_text())["channel_stats"]
    assert stats["counters"]["charged"] == cold_stats["counters"]["charged"]  # the emulator was reset
    assert any(t.startswith("warm: trial 2 reuses") for t in said), said
    assert any(t.startswith("cold: trial 3") and "device set" in t for t in said), said


def test_a_pool_closes_with_no_process_left(micro_pair, tmp_path):
    """A trial whose devices share a host process (`devices_per_process`) is warm too; a kept process that
    exited makes the next trial cold (it says which); `close` stops them all."""
    said: list[str] = []
    base = _profile(micro_pair, devices_per_process=2, rounds=2)
    with WarmPool(say=said.append) as pool:
        run_live(base, tmp_path / "a", progress=False, pool=pool)
        summary = run_live(base, tmp_path / "b", progress=False, pool=pool)
        assert summary["status"] == "complete" and _meta(tmp_path / "b")["warm"]["reused_processes"]
        pool.launcher.kill("channel")  # the emulator dies between two trials
        summary = run_live(base, tmp_path / "c", progress=False, pool=pool)
        assert summary["status"] == "complete" and not _meta(tmp_path / "c")["warm"]["reused_processes"]
        assert any(t.startswith("cold: trial 3") and "channel exited" in t for t in said), said
        pids = list(pool.launcher.pids().values())
    assert pids and not any(pid_alive(p) for p in pids)
    assert pool.launcher is None and pool.model is None
