"""Summaries and plots of a run directory: measured next to predicted, per phase.

`summarize(records)` is pure (used at the end of a run and by `multispin report`); `write_plots` draws
goodput over rounds, predicted vs measured per phase, and the mode / draft-length timeline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.analysis.phases import (
    NO_LINK_BASIS,
    PHASES,
    RATE_PHASES,
    phase_pairs,
    round_rate_basis,
)
from testbed.core.vocabulary import DL, MODES, UL
from testbed.runtime.energy import summarize_energy


def error_stats(pairs: list[tuple[float, float]]) -> dict | None:
    """Relative error (measured - predicted) / predicted: median (signed), median and p95 of |error|; the
    median of |measured - predicted| in the phase's own unit; the means."""
    rel = np.array([(m - p) / p for p, m in pairs if p and p > 0])
    if rel.size == 0:
        return None
    diff = np.array([m - p for p, m in pairs])
    return {"n": int(rel.size), "median_abs_diff": float(np.median(np.abs(diff))),
            "median_error": float(np.median(rel)), "median_abs_error": float(np.median(np.abs(rel))),
            "p95_abs_error": float(np.percentile(np.abs(rel), 95)),
            "predicted_mean": float(np.mean([p for p, _ in pairs])),
            "measured_mean": float(np.mean([m for _, m in pairs]))}


def _dl_mode_verdicts(records: list[dict]) -> dict:
    """What DL-mode verdicts carried against what the prediction provisioned for them."""
    p = tokens = 0
    token_bytes, provisioned = [], []
    for rec in records:
        for dev in rec["devices"].values():
            if dev["mode"] != DL or dev.get("missed") or not dev.get("measured"):
                continue
            provisioned.append(dev["predicted"].get("dl_bits") or 0.0)
            if dev.get("dl_payload") == "p":
                p += 1
            else:
                tokens += 1
                token_bytes.append(dev["measured"].get("dl_bytes") or 0)
    return {"with_distribution": p, "with_token": tokens,
            "token_bytes_median": float(np.median(token_bytes)) if token_bytes else None,
            "provisioned_bits_median": float(np.median(provisioned)) if provisioned else None}


def _ul_unmodeled(records: list[dict], mode: str) -> dict | None:
    """Upload bits the model did not count (`ul_unmodeled_bits`), for one mode: its own term in the report."""
    bits, secs, share, excess = [], [], [], []
    for rec in records:
        for dev in rec["devices"].values():
            m = dev.get("measured") or {}
            x = m.get("ul_unmodeled_bits")
            if dev["mode"] != mode or dev.get("missed") or x is None:
                continue
            rate = dev["predicted"].get("ul_rate_bps")
            bits.append(x)
            secs.append(x / rate if rate else 0.0)
            share.append(x / (8.0 * m["ul_bytes"]) if m.get("ul_bytes") else 0.0)
            if m.get("ul_air_excess_s") is not None:
                excess.append(m["ul_air_excess_s"])
    if not bits:
        return None
    return {"n": len(bits), "median_bits": float(np.median(bits)), "median_s": float(np.median(secs)),
            "median_share": float(np.median(share)),
            # Held beyond the modeled air time (real mode: marker-to-payload gap, release lateness).
            "air_excess_median_s": float(np.median(excess)) if excess else None,
            "air_excess_p95_s": float(np.percentile(excess, 95)) if excess else None}


def prediction_basis(records: list[dict]) -> dict:
    """What the predicted figures rest on, derived from the records: `rates` (`RATE_BASES`), `timings`
    ("prior": the drafting times, t_0, t_1 and T_0 the controller started from; "measured": refitted from the
    run's measurements, edge_node/controller.py), `acceptance` ("prior" or "estimated": the Beta posterior
    has moved). A round counts as measured / estimated once any of its estimates left its first value (a
    device's first round is planned on its prior). Each is the basis of most rounds; `rounds` counts each."""
    first_t: dict[str, float] = {}
    first_a: dict[str, float] = {}
    first_fit = None
    counts: dict[str, dict[str, int]] = {"rates": {}, "timings": {}, "acceptance": {}}
    for rec in records:
        fit = ((rec.get("verify_model") or {}).get("t0_s"), (rec.get("verify_model") or {}).get("t1_s"),
               rec.get("round_overhead_s"))
        first_fit = first_fit or fit
        timed = fit != first_fit
        est_alpha = False
        for name, d in (rec.get("devices") or {}).items():
            e = d.get("estimate") or {}
            if e.get("draft_time_s") is not None:
                timed |= e["draft_time_s"] != first_t.setdefault(name, e["draft_time_s"])
            if e.get("alpha") is not None:
                est_alpha |= e["alpha"] != first_a.setdefault(name, e["alpha"])
        for key, value in (("rates", round_rate_basis(rec)), ("timings", "measured" if timed else "prior"),
                           ("acceptance", "estimated" if est_alpha else "prior")):
            counts[key][value] = counts[key].get(value, 0) + 1
    basis = {k: max(c, key=c.get) if c else None for k, c in counts.items()}
    if not first_a:
        basis["acceptance"] = None  # records without estimates
    basis["rounds"] = counts
    if counts["rates"] and set(counts["rates"]) == {"none"}:
        basis["no_prediction"] = NO_LINK_BASIS
    return basis


def fallback_kinds(rec: dict) -> list[str]:
    """Why a round was not planned as the profile says (`summarize_fallbacks`' kinds); [] when it was."""
    kinds = []
    fb = rec.get("fallback")
    if fb:
        kinds.append(fb.get("kind") or ("infeasible" if fb.get("error") == "InfeasiblePlanError" else "policy_error"))
    if rec.get("channel_fallback"):
        kinds.append(rec["channel_fallback"].get("kind") or "channel_source_error")
    return kinds


def summarize_fallbacks(records: list[dict]) -> dict:
    """`rounds`: how many rounds fell back; `by_kind`: rounds per kind (`fallback.kind`: infeasible,
    plugin_error, policy_error; `channel_fallback`: channel_source_error; a record of an earlier release
    without a kind counts as infeasible or policy_error by its error); `policy`: the fallback policies used."""
    by_kind: dict[str, int] = {}
    policies: list[str] = []
    rounds = 0
    for rec in records:
        kinds = fallback_kinds(rec)
        fb = rec.get("fallback")
        if fb and fb.get("policy") and fb["policy"] not in policies:
            policies.append(fb["policy"])
        rounds += bool(kinds)
        for k in dict.fromkeys(kinds):
            by_kind[k] = by_kind.get(k, 0) + 1
    return {"rounds": rounds, "by_kind": by_kind, "policies": policies}


def summarize_bench(records: list[dict]) -> dict:
    """The straggler bench (`straggler_misses`): `events`, devices moved to the bench; `rejoined`, back from
    it; `rounds`, rounds with a device on it; per device the same counts."""
    out = {"events": 0, "rejoined": 0, "rounds": 0, "devices": {}}
    for rec in records:
        out["rounds"] += bool(rec.get("benched"))
        for key, field in (("events", "benched"), ("rejoined", "rejoined")):
            for name in (rec.get("bench_events") or {}).get(field, []):
                out[key] += 1
                dev = out["devices"].setdefault(name, {"events": 0, "rejoined": 0, "rounds": 0})
                dev[key] += 1
        for name in rec.get("benched") or []:
            out["devices"].setdefault(name, {"events": 0, "rejoined": 0, "rounds": 0})["rounds"] += 1
    return out


def summarize(records: list[dict]) -> dict:
    """The run in numbers (pure; `summary.json` and `multispin report`). Two goodputs, named by what they
    average: `goodput_run_tps` = all tokens / all round time (the run's rate), `goodput_mean_round_tps` =
    the mean of the per-round goodputs (every round weighs the same; a short round weighs as a long one).
    The keys of earlier releases stay beside them for one release. Asynchronous rounds: `_with_asynchronous`."""
    if not records:
        return {"rounds": 0}
    tokens = sum(r["measured"]["tokens"] for r in records)
    time_s = sum(r["measured"]["round_s"] for r in records)
    pred_tokens = sum(r["predicted"]["tokens"] for r in records)
    pred_time = sum(r["predicted"]["round_s"] for r in records)
    devices: dict[str, dict] = {}
    for rec in records:
        for name, d in rec["devices"].items():
            s = devices.setdefault(name, {"rounds": 0, "ul_rounds": 0, "dl_rounds": 0, "missed": 0, "tokens": 0,
                                          "accepted": 0, "rejections": 0, "drafted": 0, "draft_lens": []})
            s["rounds"] += 1
            s["ul_rounds" if d["mode"] == UL else "dl_rounds"] += 1
            if d.get("missed"):
                s["missed"] += 1
                continue
            s["tokens"] += d["measured"]["tokens"] or 0
            s["accepted"] += d.get("n_accepted") or 0
            s["rejections"] += 1 if (d.get("n_accepted") or 0) < d["draft_len"] else 0
            s["drafted"] += d["draft_len"]
            s["draft_lens"].append(d["draft_len"])
    for s in devices.values():
        # Acceptance rate alpha: per-token acceptance (trials up to and including the first rejection, spec
        # section 2); accepted/drafted is lower because drafts after a rejection are never tried.
        s["acceptance_rate"] = s["accepted"] / (s["accepted"] + s["rejections"]) if s["drafted"] else None
        s["acceptance"] = s["acceptance_rate"]  # the earlier name
        s["accepted_per_drafted"] = s["accepted"] / s["drafted"] if s["drafted"] else None
        s["mean_draft_len"] = float(np.mean(s.pop("draft_lens"))) if s["drafted"] else None
    basis = prediction_basis(records)
    # Phases with air time in their prediction are compared only over rounds whose rates had a basis.
    based = phase_pairs([r for r in records if round_rate_basis(r) != "none"])
    errors = {k: error_stats(based[k] if k in RATE_PHASES else v) for k, v in phase_pairs(records).items()}
    run_meas = tokens / time_s if time_s else None
    run_pred = pred_tokens / pred_time if pred_time else None
    mean_meas = float(np.mean([r["measured"]["goodput_tps"] or 0 for r in records]))
    mean_pred = float(np.mean([r["predicted"]["goodput_tps"] or 0 for r in records]))
    bases = sorted({r.get("time_base", "wall") for r in records})
    wall = [r["measured"].get("wall_round_s") for r in records]
    summary = {
        "rounds": len(records), "policy": records[0].get("policy"), "channel_mode": records[0].get("channel_mode"),
        # "virtual": measured compute + annotated air time (the model's time base); "wall": the edge's clock.
        "time_base": bases[0] if len(bases) == 1 else "mixed",
        "tokens": tokens, "time_s": time_s,
        "wall_time_s": float(sum(wall)) if all(w is not None for w in wall) else None,
        "goodput_run_tps": {"measured": run_meas, "predicted": run_pred},
        "goodput_mean_round_tps": {"measured": mean_meas, "predicted": mean_pred},
        # The earlier names of the same numbers (for one release).
        "goodput_measured_tps": run_meas, "goodput_predicted_tps": run_pred,
        "mean_round_goodput_measured_tps": mean_meas, "mean_round_goodput_predicted_tps": mean_pred,
        "rounds_with_ul_and_dl": sum(1 for r in records if 0 < r["num_ul"] < len(r["devices"])),
        "dl_provisioning": sorted({r["dl_provisioning"] for r in records if r.get("dl_provisioning")}),
        "dl_mode_verdicts": _dl_mode_verdicts(records),
        "ul_unmodeled": {m: _ul_unmodeled(records, m) for m in MODES},
        "devices": devices, "phase_errors": errors,
        # Per upload format (dense, or top-k k): the measured acceptance and the UL-mode distribution bytes.
        "payload": _by_payload(records),
        # Per device and for the run: joules by term, tokens per joule, rounds over budget (testbed.runtime.energy).
        "energy": summarize_energy(records),
        # Rounds not planned as the profile says (a fallback policy, or the static gains): per kind.
        "fallbacks": summarize_fallbacks(records),
    }
    if any("benched" in r for r in records):  # `straggler_misses` on (edge_node/bench.py)
        summary["bench"] = summarize_bench(records)
    summary["prediction_basis"] = basis
    return _without_basis(_with_asynchronous(summary, records))


def _without_basis(summary: dict) -> dict:
    """No round's rates had a basis (a passthrough link the edge did not measure): no predicted goodput and
    no measured / predicted ratio; `prediction_basis.no_prediction` says why."""
    if not summary["prediction_basis"].get("no_prediction"):
        return summary
    for key in ("goodput_run_tps", "goodput_mean_round_tps"):
        summary[key] = {**summary[key], "predicted": None}
    summary.update(goodput_predicted_tps=None, mean_round_goodput_predicted_tps=None)
    asy = summary.get("asynchronous")
    if asy:
        asy["goodput_sum_tps"]["predicted"] = None
        for s in asy["devices"].values():
            s["goodput_tps"]["predicted"] = None
    return summary


def _with_asynchronous(summary: dict, records: list[dict]) -> dict:
    """Asynchronous rounds (one record per device cycle, `edge_node.async_rounds`): per device its cycles,
    tokens, time (the sum of its cycle times, which follow one another) and goodput, measured next to
    predicted (its E_k over its T_k); the run's goodput is their sum (the model's G = sum_k E_k / T_k), and
    `time_s` the run's span."""
    cycles = [r for r in records if r.get("rounds") == "asynchronous" and r.get("device") in r["devices"]]
    if not cycles:
        return summary
    devices: dict[str, dict] = {}
    for r in cycles:
        s = devices.setdefault(r["device"], {"cycles": 0, "missed": 0, "tokens": 0, "time_s": 0.0,
                                             "predicted_tokens": 0.0, "predicted_time_s": 0.0, "waits": [],
                                             "batches": []})
        s["cycles"] += 1
        s["missed"] += bool(r["devices"][r["device"]].get("missed"))
        s["tokens"] += r["measured"]["tokens"] or 0
        s["time_s"] += r["measured"]["round_s"] or 0.0
        s["predicted_tokens"] += r["predicted"]["tokens"] or 0.0
        s["predicted_time_s"] += r["predicted"]["round_s"] or 0.0
        if r.get("wait_s") is not None:
            s["waits"].append(r["wait_s"])
        if r.get("batch"):
            s["batches"].append(len(r["batch"]))
    devices = dict(sorted(devices.items()))
    for s in devices.values():
        s["goodput_tps"] = {"measured": s["tokens"] / s["time_s"] if s["time_s"] else None,
                            "predicted": s["predicted_tokens"] / s["predicted_time_s"] if s["predicted_time_s"]
                            else None}
        waits, batches = s.pop("waits"), s.pop("batches")
        s["mean_wait_s"] = float(np.mean(waits)) if waits else None  # draft arrived -> its batch verified
        s["mean_batch"] = float(np.mean(batches)) if batches else None
    total = {side: sum(s["goodput_tps"][side] or 0.0 for s in devices.values()) for side in ("measured", "predicted")}
    span = max(r["t_start_s"] + r["measured"]["round_s"] for r in cycles) - min(r["t_start_s"] for r in cycles)
    summary.update(rounds_mode="asynchronous", cycles=len(cycles), time_s=span,
                   asynchronous={"devices": devices, "goodput_sum_tps": total},
                   goodput_run_tps=dict(total), goodput_measured_tps=total["measured"],
                   goodput_predicted_tps=total["predicted"])
    return summary


def _by_payload(records: list[dict]) -> dict:
    """Per draft distribution ("dense", or k as text): device-rounds, the acceptance rate (accepted /
    (accepted + rejections), as per device), and over the UL-mode uploads the distribution bytes measured
    (q_bytes) against the model's (L D / 8); per device too, under "devices"."""
    out: dict[str, dict] = {}
    for rec in records:
        for name, d in rec["devices"].items():
            if d.get("missed"):
                continue
            key = "dense" if d.get("topk_k") is None else str(d["topk_k"])
            for s in (out.setdefault(key, {"devices": {}}), out[key]["devices"].setdefault(name, {})):
                for f in ("device_rounds", "accepted", "rejections", "ul_uploads", "q_bytes", "q_bytes_model"):
                    s.setdefault(f, 0)
                s["device_rounds"] += 1
                s["accepted"] += d.get("n_accepted") or 0
                s["rejections"] += 1 if (d.get("n_accepted") or 0) < d["draft_len"] else 0
                q = (d.get("measured") or {}).get("q_bytes")
                if d["mode"] == UL and q is not None:
                    s["ul_uploads"] += 1
                    s["q_bytes"] += q
                    s["q_bytes_model"] += d["predicted"].get("q_bytes") or 0
    for entry in out.values():
        for s in (entry, *entry["devices"].values()):
            tried = s["accepted"] + s["rejections"]
            s["acceptance_rate"] = s["accepted"] / tried if tried else None
    return out


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_summary(summary: dict) -> str:
    """The summary as text: the headline, the devices, measured against predicted per phase, a legend and
    notes on what the prediction does not see."""
    if not summary.get("rounds"):
        return "no rounds recorded"
    run, mean = summary["goodput_run_tps"], summary["goodput_mean_round_tps"]
    base = summary.get("time_base", "wall")
    clock = {"virtual": "virtual clock: measured compute + the emulator's annotated air time",
             "wall": "the edge's wall clock"}.get(base, base)
    ratio = run["measured"] / run["predicted"] if run["measured"] and run["predicted"] else None
    no_basis = (summary.get("prediction_basis") or {}).get("no_prediction")
    lines = [
        f"policy {summary['policy']}, channel {summary['channel_mode']}, {summary['rounds']} "
        f"{'device cycles' if summary.get('asynchronous') else 'rounds'}, "
        f"{summary['tokens']} tokens in {summary['time_s']:.2f} s ({clock})"
        + (f"; wall clock {summary['wall_time_s']:.2f} s" if base == "virtual" and summary.get("wall_time_s")
           else ""),
        (f"goodput: measured {_num(run['measured'], '.2f')} tok/s, no prediction: {no_basis}"
         if no_basis else
         f"goodput: measured {_num(run['measured'], '.2f')} tok/s, predicted {_num(run['predicted'], '.2f')} tok/s "
         f"(ratio {_num(ratio, '.3f')})")
        + "  [goodput_run_tps: "
        + ("the devices' goodputs added]" if summary.get("asynchronous") else "all tokens / all round time]"),
        f"         per-round mean: measured {_num(mean['measured'], '.2f')} tok/s"
        + ("" if no_basis else f", predicted {_num(mean['predicted'], '.2f')} tok/s")
        + "  [goodput_mean_round_tps: mean of the rounds' tokens / round time]",
        *_basis_lines(summary),
        f"rounds mixing UL and DL: {summary['rounds_with_ul_and_dl']}",
        *_fallback_lines(summary.get("fallbacks")),
        "",
        f"{'device':<10}{'UL rnds':>8}{'DL rnds':>8}{'missed':>7}{'tokens':>8}{'alpha':>8}{'acc/drft':>9}"
        f"{'mean L':>8}",
    ]
    if summary.get("asynchronous"):
        at = next(i for i, ln in enumerate(lines) if ln.startswith("rounds mixing"))
        lines[at:at] = _asynchronous_lines(summary["asynchronous"])
    for name, s in summary["devices"].items():
        alpha = s.get("acceptance_rate", s.get("acceptance"))
        lines.append(f"{name:<10}{s['ul_rounds']:>8}{s['dl_rounds']:>8}{s['missed']:>7}{s['tokens']:>8}"
                     f"{_num(alpha, '.3f'):>8}{_num(s['accepted_per_drafted'], '.3f'):>9}"
                     f"{_num(s['mean_draft_len'], '.2f'):>8}")
    pay = summary.get("payload") or {}
    if any(k != "dense" for k in pay):  # a top-k run: acceptance and upload bytes per draft distribution
        for key, s in sorted(pay.items(), key=lambda kv: (kv[0] != "dense", int(kv[0]) if kv[0].isdigit() else 0)):
            label = "dense" if key == "dense" else f"top-k k={key}"
            lines.append(f"draft {label}: {s['device_rounds']} device-rounds, "
                         f"alpha {_num(s['acceptance_rate'], '.3f')}; {s['ul_uploads']} UL uploads, distribution "
                         f"bytes {s['q_bytes']} measured, {s['q_bytes_model']:.0f} by the model (L D / 8)")
    lines += ["alpha: acceptance rate per drafted token tried = accepted / (accepted + rejections); acc/drft: "
              "accepted / drafted tokens (lower: drafts after a rejection are never tried); mean L: mean draft "
              "length [tokens]",
              "",
              f"{'phase (meas vs pred)':<22}{'unit':>6}{'n':>5}{'pred mean':>11}{'meas mean':>11}{'med err':>9}"
              f"{'med |err|':>10}{'p95 |err|':>10}{'med |diff|':>11}"]
    for phase, st in summary["phase_errors"].items():
        unit = PHASES.get(phase, (None, None, "s"))[2]
        scale, shown = (1e3, "ms") if unit == "s" else (1.0, unit)
        if st is None:
            lines.append(f"{phase:<22}{shown:>6}{0:>5}  (no samples)")
            continue
        lines.append(f"{phase:<22}{shown:>6}{st['n']:>5}{scale * st['predicted_mean']:>11.4g}"
                     f"{scale * st['measured_mean']:>11.4g}{st['median_error']:>+9.1%}{st['median_abs_error']:>10.1%}"
                     f"{st['p95_abs_error']:>10.1%}{scale * st['median_abs_diff']:>11.3g}")
    lines.append("err: (measured - predicted) / predicted per sample; |diff|: |measured - predicted| in the unit "
                 "shown; names as in rounds.jsonl (docs/system-model.md, section 10)")
    lines += _energy_lines(summary.get("energy"))
    from testbed.analysis.serving import format_lines as serving_lines  # runs that served requests

    lines += serving_lines(summary.get("serving"))
    lines += _notes(summary)
    return "\n".join(lines)


def _basis_lines(summary: dict) -> list[str]:
    """What the prediction rests on (`prediction_basis`), and the expected goodput over a fading channel."""
    lines = []
    basis = summary.get("prediction_basis")
    if basis:
        def part(key: str) -> str:
            counts = (basis.get("rounds") or {}).get(key) or {}
            if basis.get(key) is None:
                return f"{key} unknown"
            if len(counts) < 2:
                return f"{key} {basis[key]}"
            return f"{key} {basis[key]} (rounds: " + ", ".join(
                f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ")"
        lines.append(f"prediction basis: {part('rates')}; {part('timings')}; {part('acceptance')}  "
                     f"[prediction_basis: rates model|trace|measured link|none, timings prior|measured, acceptance "
                     f"prior|estimated]")
    exp = summary.get("expected_goodput") or {}
    if exp.get("error"):
        lines.append(f"expected goodput over the fading channel: not computed ({exp['error']})")
    elif summary.get("expected_goodput_tps") is not None:
        meas = (summary.get("goodput_run_tps") or {}).get("measured")
        err = exp.get("stderr_tps")
        lines.append(f"expected goodput over the fading channel: {summary['expected_goodput_tps']:.2f}"
                     + (f" +- {err:.2f}" if err is not None else "") + f" tok/s ({exp.get('draws')} draws, "
                     f"{exp.get('estimates')} estimates; measured / expected "
                     f"{_num(meas / summary['expected_goodput_tps'] if meas else None, '.3f')})  "
                     f"[expected_goodput_tps: mean planned goodput over the channel's seeded draws, +- its standard "
                     f"error]")
    return lines


def _fallback_lines(fb: dict | None) -> list[str]:
    """Rounds that fell back (`summarize_fallbacks`): the run is degraded; none: no line."""
    if not fb or not fb.get("rounds"):
        return []
    kinds = ", ".join(f"{k} {n}" for k, n in fb["by_kind"].items())
    to = f" to {', '.join(fb['policies'])}" if fb.get("policies") else ""
    return [f"DEGRADED: {fb['rounds']} rounds fell back{to} ({kinds}); the records' fallback / channel_fallback "
            "say why"]


def _asynchronous_lines(asy: dict) -> list[str]:
    """Asynchronous rounds: per device its cycles and goodput, measured against predicted."""
    lines = ["asynchronous rounds (one record per device cycle):"]
    for name, s in asy["devices"].items():
        g = s["goodput_tps"]
        lines.append(f"  {name:<10}{s['cycles']:>5} cycles ({s['missed']} missed), {s['tokens']:>6} tokens in "
                     f"{s['time_s']:.2f} s: {_num(g['measured'], '.2f')} tok/s measured, "
                     f"{_num(g['predicted'], '.2f')} predicted; mean batch {_num(s['mean_batch'], '.2f')}, mean wait "
                     f"for the verifier {_num(None if s['mean_wait_s'] is None else 1e3 * s['mean_wait_s'], '.3g')} ms")
    total = asy["goodput_sum_tps"]
    lines.append(f"  sum: {_num(total['measured'], '.2f')} tok/s measured, {_num(total['predicted'], '.2f')} predicted")
    return lines


def _energy_lines(energy: dict | None) -> list[str]:
    """Per device: measured energy by term against the prediction, tokens per joule, the budget."""
    if not energy or not energy.get("devices"):
        return []
    lines = ["", f"{'energy (meas)':<14}{'tx J':>9}{'rx J':>9}{'cmp J':>9}{'total J':>9}{'pred J':>9}{'tok/J':>8}"
                 f"{'pred tok/J':>11}{'budget J':>10}{'max tx J':>10}{'over':>6}"]
    for name, s in energy["devices"].items():
        lines.append(f"{name:<14}{_num(s['measured_tx_j'], '.3g'):>9}{_num(s['measured_rx_j'], '.3g'):>9}"
                     f"{_num(s['measured_compute_j'], '.3g'):>9}{_num(s['measured_energy_j'], '.3g'):>9}"
                     f"{_num(s['predicted_energy_j'], '.3g'):>9}{_num(s['tokens_per_j'], '.3g'):>8}"
                     f"{_num(s['predicted_tokens_per_j'], '.3g'):>11}{_num(s['budget_j'], '.3g'):>10}"
                     f"{_num(s['max_tx_j'], '.3g'):>10}{s['over_budget']:>6}")
    run = energy["run"]
    lines.append(f"run: {_num(run['measured_energy_j'], '.4g')} J measured, {_num(run['predicted_energy_j'], '.4g')} J "
                 f"predicted, {_num(run['tokens_per_j'], '.3g')} tokens/J")
    lines.append("tx: UL power x UL air time; rx: receive power x DL air time; cmp: J per drafted token x tokens "
                 "drafted (hardware profile); budget: energy_budget_j, per round, on tx; over: rounds whose measured "
                 "tx exceeded it; '-': unknown (no energy fields in the hardware profile, or no measured air time)")
    return lines


def _notes(summary: dict) -> list[str]:
    """What the comparison above does not show by itself."""
    notes = []
    basis = summary.get("prediction_basis") or {}
    unbased = ((basis.get("rounds") or {}).get("rates") or {}).get("none")
    if basis.get("no_prediction"):
        notes.append(f"note: no prediction of the air times, uplink_phase_s, round_s or goodput: "
                     f"{basis['no_prediction']} (the model's rates say nothing about a real link it does not "
                     f"measure); draft_s and verify_s are still compared")
    elif unbased:
        notes.append(f"note: {unbased} round(s) planned a passthrough link the edge had not yet measured; their air "
                     f"times, uplink_phase_s, round_s and goodput are left out of the phase comparison")
    dl = summary.get("dl_mode_verdicts") or {}
    if "worst_case" in (summary.get("dl_provisioning") or []) and dl.get("with_token"):
        notes.append(
            f"note: dl_provisioning worst_case: the prediction reserves a full distribution "
            f"(median {_num(dl.get('provisioned_bits_median'), '.4g')} bit) for every DL-mode device; in "
            f"{dl['with_token']} of {dl['with_token'] + dl['with_distribution']} DL-mode device-rounds every draft "
            f"was accepted and the verdict was a token (median {_num(dl.get('token_bytes_median'), '.0f')} bytes), "
            f"so there the predicted downlink phase and round time are upper bounds (dl_air_s is compared only "
            f"where a distribution went down)")
    extra = (summary.get("ul_unmodeled") or {}).get("DL")
    if extra:
        notes.append(
            f"note: DL-mode uploads on the wire minus the model's count with its fitted header H: median "
            f"{extra['median_bits']:+.0f} bit ({1e3 * extra['median_s']:+.3g} ms at the planned rate, "
            f"{extra['median_share']:+.1%} of the upload; ul_unmodeled_bits, its own term, not in the prediction: "
            f"int32 ids and float64 q_at on the wire against b_id and b_p bits in the model)")
        if extra.get("air_excess_p95_s"):
            notes.append(
                f"note: DL-mode uploads were held beyond their modeled air time by a median "
                f"{1e3 * extra['air_excess_median_s']:.3g} ms, p95 {1e3 * extra['air_excess_p95_s']:.3g} ms "
                f"(ul_air_excess_s, part of the measured ul_air_s: the payload reached the emulator later after "
                f"its tx_start marker than its air time, or the emulator released it late)")
    if summary.get("channel_mode") == "virtual" and summary.get("time_base") != "virtual":
        notes.append("note: records of a virtual channel without a virtual time base (an earlier release): their "
                     "phase and round times are the wall clock, without the air time, and do not compare with "
                     "the prediction")
    if summary.get("time_base") == "virtual":
        notes.append("note: time base virtual: phase and round times are measured compute plus the air time the "
                     "emulator annotated; measured.wall_round_s in rounds.jsonl holds the wall-clock round")
    return notes


def write_plots(records: list[dict], out_dir: str | Path, title: str | None = None) -> list[Path]:
    """goodput.png, phases.png, timeline.png (testbed/analysis/run_plots.py draws them); `title`, e.g. the run
    directory's name, heads each plot with the policy."""
    from testbed.analysis.run_plots import write_run_plots

    return write_run_plots(records, out_dir, title=title)
