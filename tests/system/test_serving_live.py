"""Request-level serving in a live run (docs/serving-metrics.md): Poisson arrivals at each device, prompts from a
JSONL file, a few tokens each, on the embedded default pair. Every request is a fresh generation served to its
token limit; TTFT, inter-token latency and the rest in requests.jsonl, their percentiles in summary.json and in
`multispin report`, consistent with the records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.cli import main
from testbed.run.live import run_live
from testbed.run.profile import load_profile
from testbed.runtime.records import load_requests

COUNT, MAX_NEW = 3, 6


def _profile(prompts_file):
    return load_profile({
        "name": "serve", "rounds": 200, "seed": 5, "deadline_s": 5.0, "wait_for_devices_s": 60,
        "channel": {"mode": "virtual"}, "estimator": {"calibrate": False},
        "requests": {"arrival": "poisson", "rate_per_s": 4.0, "count": COUNT, "prompts": str(prompts_file),
                     "max_new_tokens": MAX_NEW},
        "scenario": {"bits_per_prob": 16, "max_draft_len": 4,
                     "devices": [{"name": f"d{i}", "distance_m": 100 + 100 * i, "draft_time_s": 0.001,
                                  "acceptance": 0.6} for i in range(2)]},
    })


def test_poisson_requests_report_ttft_and_inter_token_percentiles(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "The :mod:`json` module provides", "A dictionary is a mapping of keys to values.",
        "Generators are functions that")))
    run_dir = tmp_path / "run"
    summary = run_live(_profile(prompts), run_dir, progress=False)
    assert summary["status"] == "complete", summary["reason"]
    assert summary["reason"].startswith(f"every request served ({2 * COUNT} requests")

    recs = load_requests(run_dir)
    assert sorted(r["id"] for r in recs) == sorted(f"d{i}/{k}" for i in range(2) for k in range(COUNT))
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert not any(r["missed"] for r in rounds)  # a draft on a stale context would be refused: none was
    for r in recs:
        assert r["finished"] and r["output_tokens"] == MAX_NEW == sum(r["tokens_per_delivery"])
        assert len(r["itl_s"]) == len(r["tokens_per_delivery"]) - 1 and all(g > 0 for g in r["itl_s"])
        # TTFT counts from the arrival: the wait in the queue, then the service up to the first tokens.
        assert r["queue_s"] >= 0 and r["start_s"] >= r["arrival_s"]
        assert r["ttft_s"] == pytest.approx(r["queue_s"] + (r["first_token_s"] - r["start_s"]), abs=1e-9)
        assert r["ttft_s"] > r["queue_s"]
        assert r["e2e_s"] == pytest.approx(r["ttft_s"] + sum(r["itl_s"]), abs=1e-9)
        assert r["predicted"]["itl_s"] > 0 and r["predicted"]["tpot_s"] > 0
    # A device's requests are served one after the other, in arrival order.
    for name in ("d0", "d1"):
        mine = sorted((r for r in recs if r["device"] == name), key=lambda r: r["arrival_s"])
        for a, b in zip(mine, mine[1:]):
            assert b["start_s"] >= a["last_token_s"] - 1e-9
    # One session per request: a fresh context at the edge; the device's drafts matched it (no round missed).
    assert len({r["session"] for r in recs}) == len(recs)

    serving = json.loads((run_dir / "summary.json").read_text())["serving"]
    overall = serving["overall"]
    assert overall["finished"] == 2 * COUNT and overall["output_tokens"] == 2 * COUNT * MAX_NEW
    for key, values in (("ttft_s", [r["ttft_s"] for r in recs]), ("itl_s", [g for r in recs for g in r["itl_s"]]),
                        ("e2e_s", [r["e2e_s"] for r in recs]), ("queue_s", [r["queue_s"] for r in recs])):
        p = overall[key]
        assert p["p50"] <= p["p95"] <= p["p99"] <= max(values) + 1e-12, key
        assert p["p50"] == pytest.approx(float(np.percentile(values, 50))), key
        assert p["n"] == len(values)
    assert overall["ttft_s"]["p50"] >= overall["queue_s"]["p50"]
    span = max(r["last_token_s"] for r in recs) - min(r["arrival_s"] for r in recs)
    assert overall["throughput_tps"] == pytest.approx(2 * COUNT * MAX_NEW / span)
    assert set(serving["devices"]) == {"d0", "d1"}
    assert overall["predicted"]["itl_s"]["p50"] > 0

    assert main(["report", str(run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert f"serving: {2 * COUNT} of {2 * COUNT} requests finished" in out
    assert "time to first token" in out and "inter-token latency" in out


def test_the_live_view_shows_the_requests_served_so_far(tmp_path):
    """`multispin run` with its live view at a terminal: each round's callback reads the requests finished so
    far from the edge (their records are written to requests.jsonl, not kept by the edge)."""
    import io

    from rich.console import Console

    from testbed.analysis.live_view import LiveView

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("A dictionary is a mapping of keys to values.\n")
    buf = io.StringIO()
    with LiveView("serve", console=Console(file=buf, width=120, color_system=None)) as view:
        summary = run_live(_profile(prompts), tmp_path / "run", progress=False, on_round=view.on_round)
    assert summary["status"] == "complete", summary["reason"]
    assert len(view.requests) == 2 * COUNT and all(r["finished"] for r in view.requests)
    shown = io.StringIO()
    Console(file=shown, width=140, color_system=None).print(view.render())
    assert "time to first token" in shown.getvalue()
