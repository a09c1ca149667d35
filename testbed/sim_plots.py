"""Plots of a simulator sweep (matplotlib, Agg backend): goodput per policy, UL devices, Monte Carlo."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_LOG_KEYS = {"dl_bandwidth", "ul_bandwidth", "dl_power", "vocab_size"}


def _grouped(rows, metric):
    """{policy: (values, mean, low, high)} over drops (low/high: min and max across drops)."""
    out = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        per = {}
        for r in rows:
            if r["policy"] == policy and metric in r:
                per.setdefault(r["value"], []).append(r[metric])
        if not per:
            continue
        xs = np.array(sorted(per))
        ys = [np.asarray(per[x], float) for x in xs]
        out[policy] = (xs, np.array([y.mean() for y in ys]), np.array([y.min() for y in ys]),
                       np.array([y.max() for y in ys]))
    return out


def _axes(key, ylabel, title):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.set_xlabel(key)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if key in _LOG_KEYS:
        ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_sweep(rows: list[dict], out_dir: Path) -> list[Path]:
    """Writes goodput.png, ul_devices.png (and monte_carlo.png when MC columns exist); returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = rows[0]["sweep_key"]
    drops = len({r["drop"] for r in rows})
    paths = []

    fig, ax = _axes(key, "goodput (tokens/s)", f"Goodput vs {key} (mean, band = min..max over {drops} drops)")
    for policy, (xs, m, lo, hi) in _grouped(rows, "goodput_tps").items():
        style = dict(lw=2.5, zorder=5) if policy == "proposed" else dict(lw=1.3)  # on top of ties
        line, = ax.plot(xs, m, marker="o", ms=3, label=policy, **style)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "goodput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = _axes(key, "UL-mode devices K", f"Number of UL-mode devices vs {key}")
    groups = _grouped(rows, "num_ul_devices")
    for policy in ("proposed", "proposed-basic", "common-length", "fixed-length", "exhaustive"):
        if policy in groups:
            xs, m, lo, hi = groups[policy]
            line, = ax.plot(xs, m, marker="o", ms=3, label=policy, lw=2.5 if policy == "proposed" else 1.3)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
    if key == "devices":
        xs = np.array(sorted({r["value"] for r in rows}))
        ax.plot(xs, xs, "k:", lw=1, label="N (all UL)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "ul_devices.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    mc = _grouped(rows, "mc_goodput_tps")
    if mc:
        an = _grouped(rows, "goodput_tps")
        fig, ax = _axes(key, "goodput (tokens/s)", f"Analytic (lines) vs Monte Carlo (markers) vs {key}")
        for policy, (xs, m, _lo, _hi) in mc.items():
            line, = ax.plot(an[policy][0], an[policy][1], lw=1.3, label=f"{policy} analytic")
            ax.plot(xs, m, "x", ms=7, color=line.get_color(), label=f"{policy} MC")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        paths.append(out_dir / "monte_carlo.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
