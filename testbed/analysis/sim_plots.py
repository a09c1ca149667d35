"""Plots of a simulator sweep (matplotlib, Agg backend): goodput per policy, UL devices, Monte Carlo.

Drawn for a paper (`testbed.analysis.style`: the style and formats in force, a caption beside each figure):
the swept quantity with its symbol and unit on the x-axis (bandwidths in MHz), integer ticks for integer
keys, one colour per policy in every figure, the number of drops in the legend's title, each policy's spread
over the drops as error bars (min to max, the policies set side by side at each swept value), and Monte Carlo
points with 95% error bars.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.analysis import style
from testbed.core.simulate import INT_KEYS

_LOG_KEYS = {"dl_bandwidth", "ul_bandwidth", "uplink_total_bandwidth_hz", "dl_power", "vocab_size"}
# sweep key -> (axis label with unit, factor from the CSV's unit to the axis's)
AXES = {
    "devices": ("number of devices $N$", 1.0),
    "dl_bandwidth": ("downlink bandwidth $B^D$ (MHz)", 1e-6),
    "ul_bandwidth": ("uplink bandwidth per device $B^U$ (MHz)", 1e-6),
    "uplink_total_bandwidth_hz": ("shared uplink bandwidth, total $B^U$ (MHz)", 1e-6),
    "ul_access": ("uplink access", 1.0),
    "dl_power": ("downlink transmit power $P_s$ (W)", 1.0),
    "bits_per_prob": ("bits per probability $b_p$ (bit)", 1.0),
    "acceptance": (r"acceptance rate $\alpha$ (per token)", 1.0),
    "vocab_size": ("vocabulary size $V$ (entries)", 1.0),
    "max_draft_len": ("maximum draft length $L_{max}$ (tokens)", 1.0),
}


def axis_label(key: str) -> str:
    """The x-axis label of a sweep key, with its unit."""
    return AXES.get(key, (key, 1.0))[0]


def categorical(rows: list[dict]) -> tuple[list[dict], list[str] | None]:
    """A sweep over names (ul_access=dedicated,fdma_shared): the rows with each value replaced by its position
    (in the order swept) and the names, for the ticks; a sweep over numbers: the rows as they are, None."""
    values = list(dict.fromkeys(r["value"] for r in rows))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return rows, None
    index = {v: i for i, v in enumerate(values)}
    return [{**r, "value": index[r["value"]]} for r in rows], [str(v) for v in values]


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


def _axes(key, ylabel, title, ax=None, names=None):
    from matplotlib.ticker import MaxNLocator

    if ax is None:
        fig, ax = style.figure(aspect=0.64)
    else:
        fig = ax.figure
    ax.set_xlabel(axis_label(key))
    ax.set_ylabel(ylabel)
    style.title(ax, title)
    if names is not None:
        pass
    elif key in _LOG_KEYS:
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


def _sweep_ticks(ax, key: str, rows: list[dict], names: list[str] | None = None) -> None:
    """Ticks at the swept values written plainly (2, 5, 10 MHz, not 10^0 and 10^1) on a log axis, and on a
    linear one with a dozen values or fewer (the policies' points sit side by side around them); the names of a
    sweep over names (`categorical`)."""
    from matplotlib.ticker import MaxNLocator, NullLocator

    if names is not None:
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.5, len(names) - 0.5)
        return
    xs = _x(key, sorted({r["value"] for r in rows}))
    if key not in _LOG_KEYS and len(xs) > 12:
        if key in INT_KEYS:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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


def _spread(ax, x, m, lo, hi, policy: str, drops: int, **line):
    """One policy: the mean over drops (line and markers) with a bar from the lowest to the highest drop;
    `line`: more matplotlib styles (color, ls)."""
    w = style.current().line_w
    kw = dict(lw=1.7 * w, zorder=5) if policy == "proposed" else dict(lw=w, zorder=3)  # on top of ties
    kw["color"] = style.policy_color(policy)  # the same in every figure
    kw.update(line)
    yerr = np.vstack([m - lo, hi - m]) if drops > 1 else None
    return ax.errorbar(x, m, yerr=yerr, marker="o", ms=style.current().marker, capsize=2, capthick=0.9,
                       elinewidth=0.9, label=policy, **kw)


# Policies that fix every device's mode: their number of UL-mode devices is 0 or N by construction.
FIXED_MODE_POLICIES = ("all-dl", "all-ul")


@style.styled
def plot_sweep(rows: list[dict], out_dir: Path) -> list[Path]:
    """Writes goodput, ul_devices (and monte_carlo when MC columns exist) and goodput_ul_share, in the formats
    in force, each with its caption; returns the figure paths."""
    import matplotlib

    matplotlib.use("Agg")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = rows[0]["sweep_key"]
    rows, names = categorical(rows)
    drops = len({r["drop"] for r in rows})
    what = axis_label(key).split(' (')[0]
    note = style.spread_note(drops, "drops")
    paths = []

    groups = _grouped(rows, "goodput_tps")
    fig, ax = _axes(key, style.label("goodput_tps"),
                    f"Goodput vs {what}: mean over {drops} drops{_spread_note(drops)}", names=names)
    shift = _dodge(key, rows, len(groups))
    for i, (policy, (xs, m, lo, hi)) in enumerate(groups.items()):
        _spread(ax, shift(i, _x(key, xs)), m, lo, hi, policy, drops)
    style.legend(ax, note)
    _sweep_ticks(ax, key, rows, names)
    paths += style.save(fig, out_dir / "goodput", f"Goodput per policy against {what} (analytic model), "
                        f"{note}; the policies' points are set side by side around each swept value.")

    fig, ax = _axes(key, "UL-mode devices $K$",
                    f"Number of UL-mode devices vs {what} (mean over {drops} drops"
                    f"{', bars: min to max' if drops > 1 else ''})", names=names)
    groups = _grouped(rows, "num_ul_devices")
    # Every policy that chooses modes, plug-ins included; all-dl and all-ul would only draw 0 and N.
    shown = [p for p in groups if p not in FIXED_MODE_POLICIES]
    shift = _dodge(key, rows, len(shown))
    for i, policy in enumerate(shown):
        xs, m, lo, hi = groups[policy]
        _spread(ax, shift(i, _x(key, xs)), m, lo, hi, policy, drops)
    if key == "devices":
        xs = np.array(sorted({r["value"] for r in rows}))
        ax.plot(xs, xs, "k:", lw=1, label="$N$ (all UL)")
    style.integer_ticks(ax, "y")
    style.legend(ax, note)
    _sweep_ticks(ax, key, rows, names)
    paths += style.save(fig, out_dir / "ul_devices", f"Number of devices in UL mode per policy against {what}, "
                        f"{note}; policies that fix the mode (all-dl, all-ul) are left out.")

    mc = _grouped(rows, "mc_goodput_tps")
    if mc:
        an = _grouped(rows, "goodput_tps")
        fig, ax = _axes(key, style.label("goodput_tps"),
                        f"Analytic (lines) vs Monte Carlo (points, 95% CI) vs {what}, {drops} drops", names=names)
        for policy, (xs, m, _lo, _hi) in mc.items():
            color = style.policy_color(policy)
            ax.plot(_x(key, an[policy][0]), an[policy][1], color=color, label=f"{policy} analytic")
            err = _mc_ci95(rows, policy, xs)
            ax.errorbar(_x(key, xs), m, yerr=err, fmt="x", ms=1.5 * style.current().marker, capsize=3, color=color,
                        label=f"{policy} Monte Carlo")
        style.legend(ax, f"means over {drops} drops; bars: 95% CI of the Monte Carlo mean", ncol=2)
        _sweep_ticks(ax, key, rows, names)
        paths += style.save(fig, out_dir / "monte_carlo",
                            f"Analytic goodput (lines) against a token-level Monte Carlo simulation (crosses, with "
                            f"the 95% confidence interval of its mean) per policy against {what}, means over "
                            f"{drops} drops.")
    paths += plot_modes(rows, out_dir / "goodput_ul_share", names=names)
    return paths


# The policies of a figure of where each mode wins, drawn in this order with these colours (the mode-choosing
# policies solid, the ones with the modes fixed dashed).
_MODE_STYLE = {"all-dl": "--", "all-ul": "--", "multispin-homogeneous": ":", "multispin-heterogeneous": ":"}


def plot_modes(rows: list[dict], stem: Path, *, formats=None, title: str | None = None,
               names: list[str] | None = None) -> list[Path]:
    """Goodput per policy (left) and the share of devices in UL mode (right, K / N) against the swept value, one
    figure, written as `stem`.<format> for each of `formats` (png, svg, pdf; None: those in force) with its
    caption; returns the paths. Means over the drops with a bar from the lowest to the highest drop."""
    import matplotlib

    matplotlib.use("Agg")
    with style.using(fmt=formats), style.rc():
        return _plot_modes(rows, Path(stem), title, names)


def _plot_modes(rows, stem, title, names):
    key = rows[0]["sweep_key"]
    if names is None:
        rows, names = categorical(rows)
    rows = [{**r, "ul_share": r["num_ul_devices"] / r["num_devices"]} for r in rows]
    drops = len({r["drop"] for r in rows})
    fig, (ax_g, ax_k) = style.figure((1, 2), aspect=0.8)
    what = axis_label(key).split(" (")[0]
    _axes(key, style.label("goodput_tps"), "", ax=ax_g, names=names)
    _axes(key, style.label("ul_share"), "", ax=ax_k, names=names)
    ax_g.set_title(f"(a) goodput, mean over {drops} drops")  # the panels' names stay in both styles
    ax_k.set_title("(b) devices in UL mode")
    for ax, metric in ((ax_g, "goodput_tps"), (ax_k, "ul_share")):
        groups = _grouped(rows, metric)
        shift = _dodge(key, rows, len(groups))
        for i, (policy, (xs, m, lo, hi)) in enumerate(groups.items()):
            _spread(ax, shift(i, _x(key, xs)), m, lo, hi, policy, drops, ls=_MODE_STYLE.get(policy, "-"))
        _sweep_ticks(ax, key, rows, names)
    ax_k.set_ylim(-0.05, 1.05)
    handles, labels = ax_g.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6 if style.current().titles else 4),
               frameon=False, title=style.spread_note(drops, "drops"))
    style.title(fig, title or f"Where each mode wins: goodput and UL-mode share vs {what}")
    fig.tight_layout(rect=(0, 0.1 if style.current().titles else 0.2, 1, 1))
    caption = (f"{title + '. ' if title else ''}Where each mode wins against {what}: (a) goodput per policy, (b) the "
               f"share of devices in UL mode K/N; {style.spread_note(drops, 'drops')}; dashed: policies that fix "
               f"the mode.")
    return style.save(fig, stem, caption)
