"""Plots of a simulator sweep (matplotlib, Agg backend): goodput per policy, UL devices, Monte Carlo.

Drawn for a paper: the swept quantity with its symbol and unit on the x-axis (bandwidths in MHz), integer
ticks for integer keys, the number of drops in the titles, each policy's spread over the drops as error bars
(min to max, the policies set side by side at each swept value), and Monte Carlo points with 95% error bars.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.core.simulate import INT_KEYS

_LOG_KEYS = {"dl_bandwidth", "ul_bandwidth", "dl_power", "vocab_size"}
# sweep key -> (axis label with unit, factor from the CSV's unit to the axis's)
AXES = {
    "devices": ("number of devices $N$", 1.0),
    "dl_bandwidth": ("downlink bandwidth $B^D$ (MHz)", 1e-6),
    "ul_bandwidth": ("uplink bandwidth per device $B^U$ (MHz)", 1e-6),
    "dl_power": ("downlink transmit power $P_s$ (W)", 1.0),
    "bits_per_prob": ("bits per probability $b_p$ (bit)", 1.0),
    "acceptance": (r"acceptance rate $\alpha$ (per token)", 1.0),
    "vocab_size": ("vocabulary size $V$ (entries)", 1.0),
    "max_draft_len": ("maximum draft length $L_{max}$ (tokens)", 1.0),
}


def axis_label(key: str) -> str:
    """The x-axis label of a sweep key, with its unit."""
    return AXES.get(key, (key, 1.0))[0]


def _grouped(rows, metric):
    """{policy: (values, mean, low, high)} over drops (low/high: min and max across drops)."""
    out = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        per = {}
        for r in rows:
            if r["policy"] == policy and r.get(metric) is not None:
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
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.set_xlabel(axis_label(key))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if key in _LOG_KEYS:
        ax.set_xscale("log")
    elif key in INT_KEYS:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    return fig, ax


def _mc_ci95(rows: list[dict], policy: str, xs) -> np.ndarray | None:
    """Half-width of the 95% interval of the Monte Carlo mean over the drops at each x. The MC mean is set
    against the analytic mean over the same drops, so its uncertainty is the simulation's own:
    sqrt(sum of the plans' squared standard errors) / n."""
    out = []
    for x in xs:
        sems = [r.get("mc_goodput_sem") for r in rows if r["policy"] == policy and r["value"] == x]
        if not sems or any(v is None for v in sems):
            return None
        out.append(1.96 * np.sqrt(np.sum(np.square(sems))) / len(sems))
    return np.array(out)


def _sweep_ticks(ax, key: str, rows: list[dict]) -> None:
    """Ticks at the swept values written plainly (2, 5, 10 MHz, not 10^0 and 10^1) on a log axis, and on a
    linear one with a dozen values or fewer (the policies' points sit side by side around them)."""
    from matplotlib.ticker import NullLocator

    xs = _x(key, sorted({r["value"] for r in rows}))
    if key not in _LOG_KEYS and len(xs) > 12:
        return
    ax.set_xticks(xs, [f"{v:g}" for v in xs])
    ax.xaxis.set_minor_locator(NullLocator())


def _x(key, xs):
    return np.asarray(xs, float) * AXES.get(key, (key, 1.0))[1]


def _spread_note(drops: int) -> str:
    return " (bars: min to max)\npolicies drawn side by side around each swept value" if drops > 1 else ""


def _dodge(key: str, rows: list[dict], n: int):
    """shift(i, xs): the sweep values moved a little sideways for the i-th of n policies, so that their error
    bars stand side by side instead of on one another (all within 22% of the smallest gap between swept
    values; a constant factor on a log axis)."""
    xs = np.unique(_x(key, [r["value"] for r in rows]))
    log = key in _LOG_KEYS
    if log:
        xs = np.log10(xs[xs > 0]) if np.any(xs > 0) else xs
    gaps = np.diff(xs)
    gap = gaps.min() if gaps.size and gaps.min() > 0 else (0.3 if log else max(abs(xs[0]) * 0.3, 1.0))
    step = 0.22 * gap / max(n - 1, 1)

    def shift(i: int, x):
        d = (i - (n - 1) / 2) * step
        return np.asarray(x, float) * 10 ** d if log else np.asarray(x, float) + d

    return shift


def _spread(ax, x, m, lo, hi, policy: str, drops: int):
    """One policy: the mean over drops (line and markers) with a bar from the lowest to the highest drop."""
    style = dict(lw=2.4, zorder=5) if policy == "proposed" else dict(lw=1.2, zorder=3)  # on top of ties
    yerr = np.vstack([m - lo, hi - m]) if drops > 1 else None
    return ax.errorbar(x, m, yerr=yerr, marker="o", ms=3.5, capsize=2, capthick=0.9, elinewidth=0.9,
                       label=policy, **style)


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

    groups = _grouped(rows, "goodput_tps")
    fig, ax = _axes(key, "goodput (tokens/s)",
                    f"Goodput vs {axis_label(key).split(' (')[0]}: mean over {drops} drops{_spread_note(drops)}")
    shift = _dodge(key, rows, len(groups))
    for i, (policy, (xs, m, lo, hi)) in enumerate(groups.items()):
        _spread(ax, shift(i, _x(key, xs)), m, lo, hi, policy, drops)
    ax.legend(fontsize=8)
    _sweep_ticks(ax, key, rows)
    fig.tight_layout()
    paths.append(out_dir / "goodput.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    fig, ax = _axes(key, "UL-mode devices $K$",
                    f"Number of UL-mode devices vs {axis_label(key).split(' (')[0]} (mean over {drops} drops"
                    f"{', bars: min to max' if drops > 1 else ''})")
    groups = _grouped(rows, "num_ul_devices")
    shown = [p for p in ("proposed", "proposed-basic", "common-length", "fixed-length", "exhaustive") if p in groups]
    shift = _dodge(key, rows, len(shown))
    for i, policy in enumerate(shown):
        xs, m, lo, hi = groups[policy]
        _spread(ax, shift(i, _x(key, xs)), m, lo, hi, policy, drops)
    if key == "devices":
        xs = np.array(sorted({r["value"] for r in rows}))
        ax.plot(xs, xs, "k:", lw=1, label="$N$ (all UL)")
    ax.legend(fontsize=8)
    _sweep_ticks(ax, key, rows)
    fig.tight_layout()
    paths.append(out_dir / "ul_devices.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    mc = _grouped(rows, "mc_goodput_tps")
    if mc:
        an = _grouped(rows, "goodput_tps")
        fig, ax = _axes(key, "goodput (tokens/s)",
                        f"Analytic (lines) vs Monte Carlo (points, 95% CI) vs {axis_label(key).split(' (')[0]}, "
                        f"{drops} drops")
        for policy, (xs, m, _lo, _hi) in mc.items():
            line, = ax.plot(_x(key, an[policy][0]), an[policy][1], lw=1.3, label=f"{policy} analytic")
            err = _mc_ci95(rows, policy, xs)
            ax.errorbar(_x(key, xs), m, yerr=err, fmt="x", ms=6, capsize=3, color=line.get_color(),
                        label=f"{policy} Monte Carlo")
        ax.legend(fontsize=7, ncol=2)
        _sweep_ticks(ax, key, rows)
        fig.tight_layout()
        paths.append(out_dir / "monte_carlo.png")
        fig.savefig(paths[-1], dpi=130)
        plt.close(fig)
    return paths
