"""The live view of a run (testbed.analysis.live_view) rendered to a string console, the serving summary it
shows (testbed.analysis.serving), and when `multispin run` turns the view on."""

from __future__ import annotations

import argparse
import io

import numpy as np
import pytest
from rich.console import Console

from testbed.analysis import serving
from testbed.analysis.live_view import LiveView
from testbed.cli.run import add_live_view_argument, live_view_wanted


def _record(r: int, tokens: int) -> dict:
    dev = {"mode": "UL", "draft_len": 5, "ul_power_w": 0.125, "n_accepted": 3,
           "measured": {"tokens": tokens, "uplink_phase_s": 0.004},
           "predicted": {"tokens": 3.5, "uplink_phase_s": 0.005}}
    missed = {"mode": "DL", "draft_len": 2, "ul_power_w": 0.2, "missed": True, "measured": None,
              "predicted": {"tokens": 2.0, "uplink_phase_s": 0.003}}
    return {"round": r, "devices": {"phone": dev, "laptop": missed},
            "measured": {"tokens": tokens, "round_s": 0.02}, "predicted": {"tokens": 5.5, "round_s": 0.025}}


def _request(i: int, ttft: float, itl: list[float]) -> dict:
    return {"id": f"phone/{i}", "device": "phone", "finished": True, "output_tokens": len(itl) + 1,
            "arrival_s": float(i), "last_token_s": i + ttft + sum(itl), "ttft_s": ttft, "itl_s": itl,
            "e2e_s": ttft + sum(itl), "queue_s": ttft / 2, "tpot_s": sum(itl) / len(itl),
            "predicted": {"itl_s": 0.02, "tpot_s": 0.006}}


def _text(view: LiveView) -> str:
    buf = io.StringIO()
    Console(file=buf, width=140, color_system=None).print(view.render())
    return buf.getvalue()


def test_the_live_view_renders_rounds_devices_and_latencies():
    view = LiveView("serve [proposed]", rounds=50)
    assert "waiting for the first round" in _text(view)
    view.update(_record(0, 4))
    text = _text(view)
    assert "round 0/50" in text and "4 tokens" in text
    assert "goodput 200.0 meas / 220.0 pred tok/s" in text  # 4 tok / 0.02 s against 5.5 tok / 0.025 s
    assert "latency" not in text  # no requests yet
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.split()[:1] in (["phone"], ["laptop"])}
    assert lines["phone"][:4] == ["phone", "UL", "5", "0.125"] and "4/3.50" in lines["phone"]
    assert "4.0/5.0" in lines["phone"] and lines["laptop"][-1] == "missed"
    reqs = [_request(i, 0.1 * (i + 1), [0.01, 0.03]) for i in range(4)]
    view.update(_record(1, 2), reqs)
    text = _text(view)
    assert "round 1/50" in text and "6 tokens" in text and "4 requests finished" in text
    ttft = next(ln for ln in text.splitlines() if ln.startswith("time to first token")).split()
    expect = [f"{1e3 * np.percentile([0.1, 0.2, 0.3, 0.4], q):.1f}" for q in (50, 95, 99)]
    assert ttft[4:7] == expect and ttft[7] == "-"  # no prediction of TTFT
    itl = next(ln for ln in text.splitlines() if ln.startswith("inter-token latency")).split()
    assert itl[2:] == ["20.0", "30.0", "30.0", "20.0"]  # measured percentiles, then the predicted p50


def test_the_live_view_as_a_context_manager_on_a_plain_file():
    buf = io.StringIO()
    with LiveView("run", console=Console(file=buf, width=100, color_system=None)) as view:
        view.on_round(_record(0, 3))  # no server: no requests
    assert "round 0" in buf.getvalue()


def test_a_campaigns_next_run_starts_from_zero_under_its_own_title():
    view = LiveView("campaign devices=2 proposed", rounds=10)
    view.update(_record(0, 4))
    view.update(_record(1, 4))
    assert "8 tokens" in _text(view)
    view.start_run("campaign devices=2 all-ul", rounds=10)
    text = _text(view)
    assert "devices=2 all-ul" in text and "waiting for the first round" in text and "8 tokens" not in text
    view.update(_record(0, 3))
    assert "round 0/10" in _text(view) and "3 tokens" in _text(view)


def test_serving_percentiles_and_lines():
    reqs = [_request(i, 0.05 * (i + 1), [0.01 * (i + 1)]) for i in range(10)]
    reqs.append({**_request(10, 9.0, [9.0]), "finished": False})  # unfinished: counted, not in the percentiles
    s = serving.summarize(reqs)
    o = s["overall"]
    assert (o["requests"], o["finished"], o["output_tokens"]) == (11, 10, 20)
    ttfts = [0.05 * (i + 1) for i in range(10)]
    assert o["ttft_s"]["p99"] == pytest.approx(np.percentile(ttfts, 99))
    assert o["ttft_s"]["p50"] <= o["ttft_s"]["p95"] <= o["ttft_s"]["p99"]
    assert o["throughput_tps"] == pytest.approx(20 / (max(r["last_token_s"] for r in reqs[:10]) - 0.0))
    assert s["devices"]["phone"]["requests"] == 11
    text = "\n".join(serving.format_lines(s))
    assert "10 of 11 requests finished" in text and "time to first token" in text
    assert serving.summarize([]) is None and serving.format_lines(None) == []


@pytest.mark.parametrize("argv, tty, want", [([], True, True), ([], False, False), (["--quiet"], True, False),
                                             (["--live-view"], False, True), (["--no-live-view"], True, False)])
def test_when_the_live_view_is_on(monkeypatch, argv, tty, want):
    p = argparse.ArgumentParser()
    p.add_argument("--quiet", action="store_true")
    add_live_view_argument(p)
    monkeypatch.setattr("sys.stdout.isatty", lambda: tty)
    assert live_view_wanted(p.parse_args(argv)) is want
