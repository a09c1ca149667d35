"""The link-rate panel of a run's timeline (plots/timeline.png): where links had fixed rates (a rate trace,
`channel.state.source: trace`, or a real link the edge measured, `channel.measure_links`), their rates per
device over rounds above the mode / draft-length timeline, so that each decision reads against the link it
was made for. `testbed.analysis.run_plots.plot_timeline` takes its axes from `timeline_axes`.
"""

from __future__ import annotations

import numpy as np

from testbed.analysis import style

# Per-device record fields that hold a link's fixed rates {ul, dl} (bit/s), and how the panel names them.
FIXED_RATE_FIELDS = {"trace_rate_bps": "trace", "link_rate_bps": "measured link"}


def fixed_rates(records: list[dict]) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
    """(device, direction, what) -> [(round, bit/s)] of every fixed rate in the records (empty: none)."""
    out: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in records:
        for name, d in r.get("devices", {}).items():
            for key, what in FIXED_RATE_FIELDS.items():
                for direction, bps in (d.get(key) or {}).items():
                    if bps:
                        out.setdefault((name, direction, what), []).append((r["round"], float(bps)))
    return out


def plot_fixed_rates(ax, records: list[dict], names: list[str]) -> None:
    """Fixed rates per device over rounds (solid: UL, dashed: DL) and, on top, the rate the emulator
    charged each upload (x): with a trace the crosses sit on the line."""
    rates = fixed_rates(records)
    # One colour per device in every figure, never the blue or orange of the modes below.
    colors = {n: style.device_color(n) for n in names}
    values = [b for pts in rates.values() for _, b in pts]
    for (name, direction, what), pts in sorted(rates.items()):
        x, y = zip(*pts)
        ax.plot(x, np.array(y) / 1e6, ls="-" if direction == "ul" else "--", marker="o", ms=3, lw=1.2,
                color=colors.get(name, "k"), label=f"{name} {direction.upper()} ({what})")
    for name in names:
        if not any(n == name and di == "ul" for n, di, _ in rates):
            continue
        charged = [(r["round"], m["ul_rate_bps"]) for r in records
                   if (m := (r["devices"].get(name) or {}).get("measured") or {}).get("ul_rate_bps")]
        if charged:
            x, y = zip(*charged)
            ax.scatter(x, np.array(y) / 1e6, marker="x", s=28, color=colors[name], zorder=3,
                       label=f"{name} UL, charged by the emulator")
    if values and min(values) > 0 and max(values) / min(values) > 20:  # fades of a decade and more
        ax.set_yscale("log")
    ax.set_ylabel(style.label("rate_mbps"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def timeline_axes(records: list[dict], names: list[str], width: float, title: str | None = None):
    """(figure, timeline axes): with fixed rates in the records, a rate panel above the timeline (sharing
    its round axis); else the timeline alone."""
    paper = style.current().name == "paper"
    height = (0.22 * len(names) + 1.0) if paper else (0.55 * len(names) + 2.0)
    if not fixed_rates(records):
        return _sized(width, height)
    rate_h = 1.4 if paper else 2.8
    fig, (top, ax) = _sized(width, height + rate_h, nrows=2, sharex=True,
                            gridspec_kw={"height_ratios": [rate_h, height]})
    plot_fixed_rates(top, records, names)
    policy = records[0].get("policy") if records else None
    who = " — ".join(x for x in (title, f"policy {policy}" if policy else None) if x)
    style.title(top, f"{who}\nlink rates per device (fixed by a trace, or measured)" if who else
                "link rates per device (fixed by a trace, or measured)")
    top.tick_params(labelbottom=True)
    return fig, ax


def _sized(width: float, height: float, **kw):
    import matplotlib.pyplot as plt

    with style.rc():
        return plt.subplots(figsize=(width, height), **kw)
