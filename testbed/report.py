"""Summaries and plots of a run directory: measured next to predicted, per phase.

`summarize(records)` is pure (used at the end of a run and by `multispin report`); `write_plots` draws
goodput over rounds, predicted vs measured per phase, and the mode / draft-length timeline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# phase -> (where, key). Device phases are compared per device and round; DL air time only where a
# distribution actually went down (a DL-mode device that rejected).
PHASES = {
    "draft": ("device", "draft_s"),
    "uplink_air_ul_mode": ("device", "uplink_s"),
    "uplink_air_dl_mode": ("device", "uplink_s"),
    "uplink_phase": ("device", "up_phase_s"),
    "downlink_air_dl_mode": ("device", "downlink_s"),
    "verify": ("round", "verify_s"),
    "round": ("round", "round_s"),
    "goodput": ("round", "goodput_tps"),
}


def phase_pairs(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(predicted, measured) pairs per phase."""
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in PHASES}
    for rec in records:
        for phase, (where, key) in PHASES.items():
            if where == "round":
                p, m = rec["predicted"].get(key), rec["measured"].get(key)
                if p is not None and m is not None:
                    out[phase].append((p, m))
                continue
            for dev in rec["devices"].values():
                if dev.get("missed") or not dev.get("measured"):
                    continue
                if phase.endswith("_ul_mode") and dev["mode"] != "UL":
                    continue
                if phase.endswith("_dl_mode") and dev["mode"] != "DL":
                    continue
                if phase.startswith("downlink") and dev.get("dl_payload") != "p":
                    continue
                p, m = dev["predicted"].get(key), dev["measured"].get(key)
                if p is not None and m is not None:
                    out[phase].append((p, m))
    return out


def error_stats(pairs: list[tuple[float, float]]) -> dict | None:
    """Relative error (measured - predicted) / predicted: median (signed), median and p95 of |error|."""
    rel = np.array([(m - p) / p for p, m in pairs if p and p > 0])
    if rel.size == 0:
        return None
    diff = np.array([m - p for p, m in pairs])
    return {"n": int(rel.size), "median_abs_diff": float(np.median(np.abs(diff))),
            "median_error": float(np.median(rel)), "median_abs_error": float(np.median(np.abs(rel))),
            "p95_abs_error": float(np.percentile(np.abs(rel), 95)),
            "predicted_mean": float(np.mean([p for p, _ in pairs])),
            "measured_mean": float(np.mean([m for _, m in pairs]))}


def summarize(records: list[dict]) -> dict:
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
            s["ul_rounds" if d["mode"] == "UL" else "dl_rounds"] += 1
            if d.get("missed"):
                s["missed"] += 1
                continue
            s["tokens"] += d["measured"]["tokens"] or 0
            s["accepted"] += d.get("n_accepted") or 0
            s["rejections"] += 1 if (d.get("n_accepted") or 0) < d["draft_len"] else 0
            s["drafted"] += d["draft_len"]
            s["draft_lens"].append(d["draft_len"])
    for s in devices.values():
        # alpha: per-token acceptance (trials up to and including the first rejection, spec section 2);
        # accepted/drafted is lower because drafts after a rejection are never tried.
        s["acceptance"] = s["accepted"] / (s["accepted"] + s["rejections"]) if s["drafted"] else None
        s["accepted_per_drafted"] = s["accepted"] / s["drafted"] if s["drafted"] else None
        s["mean_draft_len"] = float(np.mean(s.pop("draft_lens"))) if s["drafted"] else None
    errors = {k: error_stats(v) for k, v in phase_pairs(records).items()}
    return {
        "rounds": len(records), "policy": records[0].get("policy"), "channel_mode": records[0].get("channel_mode"),
        "tokens": tokens, "time_s": time_s,
        "goodput_measured_tps": tokens / time_s if time_s else None,
        "goodput_predicted_tps": pred_tokens / pred_time if pred_time else None,
        "mean_round_goodput_measured_tps": float(np.mean([r["measured"]["goodput_tps"] or 0 for r in records])),
        "mean_round_goodput_predicted_tps": float(np.mean([r["predicted"]["goodput_tps"] or 0 for r in records])),
        "rounds_with_ul_and_dl": sum(1 for r in records if 0 < r["num_ul"] < len(r["devices"])),
        "devices": devices, "phase_errors": errors,
    }


def format_summary(summary: dict) -> str:
    if not summary.get("rounds"):
        return "no rounds recorded"
    lines = [
        f"policy {summary['policy']}, channel {summary['channel_mode']}, {summary['rounds']} rounds, "
        f"{summary['tokens']} tokens in {summary['time_s']:.2f} s",
        f"goodput: measured {summary['goodput_measured_tps']:.2f} tok/s, predicted "
        f"{summary['goodput_predicted_tps']:.2f} tok/s "
        f"(ratio {summary['goodput_measured_tps'] / summary['goodput_predicted_tps']:.3f}); "
        f"rounds mixing UL and DL: {summary['rounds_with_ul_and_dl']}",
        "",
        f"{'device':<10}{'UL rnds':>8}{'DL rnds':>8}{'missed':>7}{'tokens':>8}{'alpha':>8}{'acc/L':>8}{'mean L':>8}",
    ]
    for name, s in summary["devices"].items():
        acc = "-" if s["acceptance"] is None else f"{s['acceptance']:.3f}"
        apd = "-" if s["accepted_per_drafted"] is None else f"{s['accepted_per_drafted']:.3f}"
        ml = "-" if s["mean_draft_len"] is None else f"{s['mean_draft_len']:.2f}"
        lines.append(f"{name:<10}{s['ul_rounds']:>8}{s['dl_rounds']:>8}{s['missed']:>7}{s['tokens']:>8}{acc:>8}{apd:>8}"
                     f"{ml:>8}")
    lines += ["", f"{'phase (meas vs pred)':<24}{'n':>5}{'pred mean':>11}{'meas mean':>11}{'median err':>11}"
                  f"{'med |err|':>10}{'p95 |err|':>10}{'med |diff|':>11}"]
    for phase, st in summary["phase_errors"].items():
        if st is None:
            lines.append(f"{phase:<24}{0:>5}  (no samples)")
            continue
        lines.append(f"{phase:<24}{st['n']:>5}{st['predicted_mean']:>11.4g}{st['measured_mean']:>11.4g}"
                     f"{st['median_error']:>+10.1%} {st['median_abs_error']:>9.1%}{st['p95_abs_error']:>10.1%}"
                     f"{st['median_abs_diff']:>11.3g}")
    return "\n".join(lines)


def write_plots(records: list[dict], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    rounds = [r["round"] for r in records]

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(rounds, [r["measured"]["goodput_tps"] for r in records], label="measured", marker=".")
    ax.plot(rounds, [r["predicted"]["goodput_tps"] for r in records], label="predicted", marker=".")
    ax.set_xlabel("round")
    ax.set_ylabel("goodput (tokens/s)")
    ax.set_title("goodput per round")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "goodput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    pairs = phase_pairs(records)
    shown = [k for k, v in pairs.items() if v and k != "goodput"]
    cols = 3
    nrows = max(1, (len(shown) + cols - 1) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.6 * nrows), squeeze=False)
    for ax, phase in zip(axes.flat, shown):
        p = np.array([a for a, _ in pairs[phase]])
        m = np.array([b for _, b in pairs[phase]])
        ax.scatter(p, m, s=8, alpha=0.6)
        lo, hi = float(min(p.min(), m.min())), float(max(p.max(), m.max()))
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8)
        ax.set_title(phase)
        ax.set_xlabel("predicted (s)")
        ax.set_ylabel("measured (s)")
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    paths.append(out / "phases.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    names = sorted({n for r in records for n in r["devices"]})
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.8))
    for i, name in enumerate(names):
        for r in records:
            d = r["devices"].get(name)
            if d is None:
                continue
            color = "tab:blue" if d["mode"] == "UL" else "tab:orange"
            if d.get("missed"):
                color = "lightgray"
            ax.barh(i, 1, left=r["round"] - 0.5, color=color, edgecolor="white", linewidth=0.3)
            ax.text(r["round"], i, str(d["draft_len"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("round")
    ax.set_title("mode (blue UL, orange DL, gray missed) and draft length per round")
    fig.tight_layout()
    paths.append(out / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
