"""Plots of a live campaign (matplotlib, Agg), from its results.csv rows: per policy, the measured value
against the swept key (solid, filled markers; with several repeats the mean and a bar from the lowest to
the highest run) and the model's prediction for the same runs beside it (dashed, open markers).

goodput always; tokens_per_j when the runs carry a measured energy (hardware profiles with the energy
fields), in the style and formats in force (`testbed.analysis.style`) with a caption beside each. The axis of a
simulator key carries its symbol and unit, as in `multispin simulate`'s plots; a policy has its colour of
every other figure; the legend's title says how many repeats a mean and its bar are drawn from. A grid
campaign (several keys) gets one panel per combination of the other keys' values, the first numeric key across.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from testbed.analysis import style
from testbed.analysis.sim_plots import AXES, axis_label

# (file, measured column, predicted column, y label)
METRICS = (("goodput", "measured_goodput_tps", "predicted_goodput_tps", style.label("goodput_tps")),
           ("tokens_per_j", "measured_tokens_per_j", "predicted_tokens_per_j", style.label("measured_tokens_per_j")))


def _points(rows: list[dict]) -> tuple[list, bool]:
    """The sweep values in order, and whether they are numbers (then the x-axis is numeric)."""
    values = [json.loads(v) for v in dict.fromkeys(json.dumps(r["value"]) for r in rows)]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return (sorted(values) if numeric else values), numeric


def _series(rows: list[dict], policy: str, metric: str, values: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, lowest and highest of `metric` per sweep value (NaN where the policy has no run there)."""
    mean, low, high = [], [], []
    for v in values:
        got = [float(r[metric]) for r in rows
               if r["policy"] == policy and r["value"] == v and r.get(metric) is not None]
        mean.append(np.mean(got) if got else np.nan)
        low.append(min(got) if got else np.nan)
        high.append(max(got) if got else np.nan)
    return np.array(mean), np.array(low), np.array(high)


def _draw(ax, rows: list[dict], key: str, measured: str, predicted: str, repeats: int) -> list:
    """One panel: per policy the measured series (bars with repeats) and the predicted one; the handles."""
    from matplotlib.ticker import MaxNLocator

    values, numeric = _points(rows)
    factor = AXES.get(key, (key, 1.0))[1]
    x = np.array(values, float) * factor if numeric else np.arange(len(values))
    handles = []
    for policy in dict.fromkeys(r["policy"] for r in rows):
        color = style.policy_color(policy)
        m, lo, hi = _series(rows, policy, measured, values)
        p, _, _ = _series(rows, policy, predicted, values)
        yerr = np.vstack([m - lo, hi - m]) if repeats > 1 else None
        handles.append(ax.errorbar(x, m, yerr=yerr, color=color, capsize=3, label=f"{policy}, measured",
                                   **style.MEASURED_STYLE))
        handles += ax.plot(x, p, color=color, label=f"{policy}, predicted", **style.PREDICTED_STYLE)
    ax.set_xlabel(axis_label(key))
    if numeric and len(x) > 1 and x.min() > 0 and x.max() / x.min() >= 20:
        ax.set_xscale("log")
        ax.set_xticks(x, [format(v, "g") for v in x])  # the swept values, written plainly
        ax.minorticks_off()
    elif not numeric:
        ax.set_xticks(x, [str(v) for v in values])
    elif len(x) <= 12:
        ax.set_xticks(x, [format(v, "g") for v in x])
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=all(float(v).is_integer() for v in values)))
    return handles


@style.styled
def plot_metric(rows: list[dict], path: Path, key: str, measured: str, predicted: str, ylabel: str,
                title: str | None = None) -> list[Path]:
    fig, ax = style.figure(aspect=0.64)
    repeats = max((r["repeat"] for r in rows), default=0) + 1
    handles = _draw(ax, rows, key, measured, predicted, repeats)
    ax.set_ylabel(ylabel)
    spread = style.spread_note(repeats, "repeats", "bars: lowest to highest run")
    head = f"{title}: " if title else ""
    what = ylabel.split(' [')[0]
    style.title(ax, f"{head}{what} per policy, live testbed;\nsolid: measured, dashed: the model's prediction "
                    f"for the same runs")
    style.legend(ax, spread, handles=handles, ncol=2)
    caption = (f"{head}{what} per policy against {axis_label(key)} on the live testbed: measured (solid, filled "
               f"markers) and the model's prediction for the same runs (dashed, open markers); {spread}.")
    return style.save(fig, path, caption)


def _cell(value) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _grid_x(rows: list[dict], grid: list[tuple[str, str]]) -> int:
    """The key on the x axis of a grid's panels: the first whose values are all numbers, else the first."""
    for k, (_, column) in enumerate(grid):
        if all(_is_number(r[column]) for r in rows):
            return k
    return 0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@style.styled
def plot_grid_metric(rows: list[dict], path: Path, grid: list[tuple[str, str]], measured: str, predicted: str,
                     ylabel: str, title: str | None = None) -> list[Path]:
    """A grid campaign: one panel per combination of the other keys' values (titled by it), the x key's
    values across each, the y axis shared."""
    xi = _grid_x(rows, grid)
    xkey, xcol = grid[xi]
    others = [g for k, g in enumerate(grid) if k != xi]
    panels = list(dict.fromkeys(tuple(json.dumps(r[c]) for _, c in others) for r in rows))
    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = style.figure((nrows, cols), aspect=0.8, squeeze=False, sharey=True)
    repeats = max((r["repeat"] for r in rows), default=0) + 1
    handles: list = []
    for ax, panel in zip(axes.flat, panels):
        sub = [{**r, "value": r[xcol]} for r in rows if tuple(json.dumps(r[c]) for _, c in others) == panel]
        handles = _draw(ax, sub, xkey, measured, predicted, repeats) or handles
        ax.set_title(", ".join(f"{k}={_cell(json.loads(v))}" for (k, _), v in zip(others, panel)),
                     fontsize=style.current().font_pt)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    spread = style.spread_note(repeats, "repeats", "bars: lowest to highest run")
    head = f"{title}: " if title else ""
    what = ylabel.split(' [')[0]
    style.title(fig, f"{head}{what} per policy, live testbed; solid: measured, dashed: predicted")
    style.legend(axes.flat[0], spread, handles=handles, ncol=1)
    caption = (f"{head}{what} per policy against {axis_label(xkey)} on the live testbed, one panel per "
               f"{', '.join(k for k, _ in others)} (named above it): measured (solid, filled markers) and the "
               f"model's prediction for the same runs (dashed, open markers); {spread}.")
    return style.save(fig, path, caption)


def plot_campaign(rows: list[dict], out_dir: str | Path, key: str, title: str | None = None,
                  grid: list[tuple[str, str]] | None = None) -> list[Path]:
    """goodput (and tokens_per_j when the runs carry energy) in `out_dir`, in the formats in force; `grid`:
    (key, its results column) of each key of a grid campaign, drawn as panels."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, measured, predicted, ylabel in METRICS:
        if any(r.get(measured) is not None for r in rows):
            if grid and len(grid) > 1:
                paths += plot_grid_metric(rows, out / name, grid, measured, predicted, ylabel, title)
            else:
                paths += plot_metric(rows, out / name, key, measured, predicted, ylabel, title)
    return paths
