"""Serving metrics of a run's requests (requests.jsonl, `edge_node.requests`): TTFT, inter-token latency, time per
output token, end-to-end latency and queueing delay as p50/p95/p99, throughput, per device and overall, with the
model's prediction beside them. docs/serving-metrics.md."""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s")
LABELS = {"ttft_s": "time to first token", "itl_s": "inter-token latency", "tpot_s": "time per output token",
          "e2e_s": "end-to-end latency", "queue_s": "queueing delay"}


def percentiles(values: list[float]) -> dict | None:
    """{p50, p95, p99, mean, n} of the values (linear interpolation between order statistics); None if empty."""
    xs = np.asarray([v for v in values if v is not None], dtype=float)
    if xs.size == 0:
        return None
    out = {f"p{q}": float(np.percentile(xs, q)) for q in PERCENTILES}
    out.update(mean=float(xs.mean()), n=int(xs.size))
    return out


def _values(records: list[dict], key: str) -> list[float]:
    if key == "itl_s":  # every gap between two deliveries of every request
        return [g for r in records for g in (r.get("itl_s") or [])]
    return [r[key] for r in records if r.get(key) is not None]


def _group(records: list[dict], finished: list[dict]) -> dict:
    out: dict = {"requests": len(records), "finished": len(finished),
                 "output_tokens": sum(int(r.get("output_tokens") or 0) for r in finished)}
    for key in LATENCIES:
        out[key] = percentiles(_values(finished, key))
    arrivals = [r["arrival_s"] for r in finished if r.get("arrival_s") is not None]
    ends = [r["last_token_s"] for r in finished if r.get("last_token_s") is not None]
    span = max(ends) - min(arrivals) if arrivals and ends else None
    out["span_s"] = span
    out["throughput_tps"] = out["output_tokens"] / span if span else None
    out["requests_per_s"] = len(finished) / span if span else None
    predicted = {}
    for key in ("itl_s", "tpot_s"):
        xs = [(r.get("predicted") or {}).get(key) for r in finished]
        predicted[key] = percentiles([x for x in xs if x is not None])
    out["predicted"] = predicted
    return out


def summarize(records: list[dict]) -> dict | None:
    """summary.json's `serving`: overall and per device; None for a run that served no requests."""
    if not records:
        return None
    finished = [r for r in records if r.get("finished")]
    devices = sorted({r.get("device") for r in records if r.get("device") is not None})
    return {"overall": _group(records, finished),
            "devices": {d: _group([r for r in records if r.get("device") == d],
                                  [r for r in finished if r.get("device") == d]) for d in devices}}


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def format_lines(serving: dict | None) -> list[str]:
    """The serving block of a run's printed summary."""
    if not serving:
        return []
    o = serving["overall"]
    tput, rps = o.get("throughput_tps"), o.get("requests_per_s")
    lines = [f"serving: {o['finished']} of {o['requests']} requests finished, {o['output_tokens']} tokens, "
             f"throughput {'-' if tput is None else f'{tput:.1f}'} tok/s"
             f" ({'-' if rps is None else f'{rps:.2f}'} req/s)",
             f"  {'latency (ms)':<24}{'p50':>9}{'p95':>9}{'p99':>9}   predicted p50"]
    for key in LATENCIES:
        p = o.get(key)
        pred = (o.get("predicted") or {}).get(key)
        if p is None:
            continue
        lines.append(f"  {LABELS[key]:<24}{_ms(p['p50']):>9}{_ms(p['p95']):>9}{_ms(p['p99']):>9}"
                     f"   {_ms(pred['p50']) if pred else '-'}")
    for name, d in serving.get("devices", {}).items():
        t, i = d.get("ttft_s") or {}, d.get("itl_s") or {}
        tp = d.get("throughput_tps")
        lines.append(f"  {name}: {d['finished']}/{d['requests']} requests, TTFT p50 {_ms(t.get('p50'))} ms, "
                     f"ITL p50 {_ms(i.get('p50'))} ms, {'-' if tp is None else f'{tp:.1f}'} tok/s")
    return lines
