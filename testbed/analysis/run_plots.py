"""The plots of one run (matplotlib, Agg): goodput per round, predicted vs measured per phase, the mode /
draft-length timeline, energy, and the distribution (CDF) of the prediction error per phase; and overlays of
several runs (goodput over rounds, the error CDFs) labelled by the settings that tell them apart.

Every figure takes the style and formats in force (`testbed.analysis.style`: paper or screen; pdf, svg,
png) and writes a caption beside itself (`<figure>.caption.txt`): in the paper style the caption, not a
title, names the run and its policy. `testbed.analysis.report.write_plots` draws through
`write_run_plots`; the phases and their samples come from `testbed.analysis.phases`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.analysis import style
from testbed.core.vocabulary import MODES, within

MODE_COLORS = style.MODE_COLORS
# Phase base names in words, for the screen titles (the labels come from style.FIELDS).
PHASE_WORDS = {
    "draft_s": "drafting", "ul_air_s": "uplink air time", "uplink_phase_s": "uplink phase (drafting + air)",
    "dl_air_s": "downlink air time", "downlink_phase_s": "downlink phase", "verify_s": "verification",
    "round_s": "round time", "goodput_tps": "goodput",
    # names of earlier releases, in records that carry only them
    "uplink_s": "uplink air time", "up_phase_s": "uplink phase", "downlink_s": "downlink air time",
}
_QUALIFIERS = {"UL mode": "UL-mode devices", "DL mode": "DL-mode devices", "p": "distribution sent"}
_GROUP_WORDS = {"UL": "UL mode", "DL": "DL mode", "mixed": "UL and DL"}


def phase_title(phase: str) -> str:
    """'ul_air_s[DL mode]' -> 'uplink air time, DL-mode devices'."""
    base, _, rest = phase.partition("[")
    words = PHASE_WORDS.get(base, base)
    quals = [_QUALIFIERS.get(q.strip(), q.strip()) for q in rest.rstrip("]").split(",") if q.strip()]
    return ", ".join([words, *quals])


def _round_mix(rec: dict) -> str:
    modes = {d.get("mode") for d in rec.get("devices", {}).values()}
    return modes.pop() if len(modes) == 1 and modes <= set(MODES) else "mixed"


def _pairs_by_mode(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """phase -> group -> (predicted, measured): device phases grouped by the device's mode, round phases by
    the round's mix (all UL, all DL, mixed); through phases.phase_pairs on records narrowed to a group."""
    from testbed.analysis.phases import PHASES, phase_pairs

    out: dict[str, dict[str, list]] = {k: {} for k in PHASES}
    for mode in MODES:
        narrowed = [{**r, "devices": {n: d for n, d in r.get("devices", {}).items() if d.get("mode") == mode}}
                    for r in records]
        for phase, pairs in phase_pairs(narrowed).items():
            if PHASES[phase][0] == "device" and pairs:
                out[phase][mode] = pairs
    for mix in (*MODES, "mixed"):
        group = [r for r in records if _round_mix(r) == mix]
        if not group:
            continue
        for phase, pairs in phase_pairs(group).items():
            if PHASES[phase][0] != "device" and pairs:
                out[phase][mix] = pairs
    return out


def _who(records: list[dict], title: str | None) -> str:
    """'<run> — policy <p>' (what a title or a caption names)."""
    policy = records[0].get("policy") if records else None
    return " — ".join(x for x in (title, f"policy {policy}" if policy else None) if x)


def _heading(records: list[dict], title: str | None, what: str, lines: int = 1) -> str:
    """'<run> — policy <p>: <what>' (on two lines with lines=2: a narrow figure would cut it)."""
    who = _who(records, title)
    if not who:
        return what
    return f"{who}\n{what}" if lines == 2 else f"{who}: {what}"


def _of(records: list[dict], title: str | None) -> str:
    """' of run X (policy p)' for a caption."""
    policy = records[0].get("policy") if records else None
    run = f" of run {title}" if title else ""
    return f"{run} (policy {policy})" if policy else run


def _integer_rounds(ax) -> None:
    style.integer_ticks(ax, "x")
    ax.set_xlabel(style.label("round"))


@style.styled
def plot_goodput(records: list[dict], path: Path, title: str | None = None) -> list[Path]:
    rounds = [r["round"] for r in records]
    fig, ax = style.figure()
    ax.plot(rounds, [r["predicted"].get("goodput_tps") for r in records], label="predicted", color=style.GREY,
            ls="--")
    ax.plot(rounds, [r["measured"].get("goodput_tps") for r in records], label="measured", color=style.BLACK,
            lw=0.8 * style.current().line_w, alpha=0.7)
    # The measured points carry the round's modes: all UL, all DL, or a mix.
    for mix, label in (("UL", "measured, all UL"), ("DL", "measured, all DL"), ("mixed", "measured, UL and DL")):
        pts = [(r["round"], r["measured"].get("goodput_tps")) for r in records if _round_mix(r) == mix]
        if pts:
            ax.scatter(*zip(*pts), s=4 * style.current().marker, color=MODE_COLORS[mix], label=label, zorder=3)
    _integer_rounds(ax)
    ax.set_ylabel(style.label("goodput_tps"))
    bases = {r.get("time_base", "wall") for r in records}
    clock = " (virtual time base)" if bases == {"virtual"} else ""
    style.title(ax, _heading(records, title, f"goodput per round{clock}"))
    ax.legend(ncol=2 if style.current().name == "paper" else 5, loc="upper center", bbox_to_anchor=(0.5, -0.2),
              frameon=False)  # off the data
    caption = (f"Goodput per round{_of(records, title)}{clock}: the model's prediction (dashed) and the "
               f"measurement (solid; points coloured by the round's modes: all UL, all DL, or both), "
               f"{len(records)} rounds.")
    return style.save(fig, path, caption)


def _scale(top: float) -> tuple[float, str]:
    return (1e6, "µs") if top < 1e-3 else (1e3, "ms") if top < 10 else (1.0, "s")


@style.styled
def plot_phases(records: list[dict], path: Path, title: str | None = None) -> list[Path]:
    from testbed.analysis.phases import PHASES

    groups = _pairs_by_mode(records)
    shown = [k for k, g in groups.items() if g and PHASES[k][2] == "s"]
    cols = 3 if style.current().name == "screen" else 2
    nrows = max(1, (len(shown) + cols - 1) // cols)
    fig, axes = style.figure((nrows, cols), aspect=0.85, squeeze=False)
    for i, (ax, phase) in enumerate(zip(axes.flat, shown)):
        lo, hi = np.inf, 0.0
        top = max(max(a, b) for pairs in groups[phase].values() for a, b in pairs)
        scale, unit = _scale(top)
        for group, pairs in groups[phase].items():
            p = scale * np.array([a for a, _ in pairs], float)
            m = scale * np.array([b for _, b in pairs], float)
            lo, hi = min(lo, p.min(), m.min()), max(hi, p.max(), m.max())
            ax.scatter(p, m, s=2.5 * style.current().marker, alpha=0.6, color=MODE_COLORS[group],
                       label=f"{_GROUP_WORDS[group]} (n={len(p)})")
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="measured = predicted")
        if lo > 0 and hi / lo > 100:  # e.g. DL-mode uploads of bytes next to UL-mode ones of megabytes
            ax.set_xscale("log")
            ax.set_yscale("log")
        # The panel's name stays in both styles: without it the panels cannot be told apart.
        ax.set_title(f"({chr(97 + i)}) {style.words(phase)}" if not style.current().titles
                     else f"{phase_title(phase)}\n({phase})")
        ax.set_xlabel(f"predicted [{unit}]")
        ax.set_ylabel(f"measured [{unit}]")
        ax.legend()
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    style.title(fig, _heading(records, title, "measured vs predicted per phase"))
    fig.tight_layout()
    panels = "; ".join(f"({chr(97 + i)}) {style.words(p)} ({p})" for i, p in enumerate(shown))
    caption = (f"Measured against predicted time per phase{_of(records, title)}, one point per device and round "
               f"(device phases, coloured by the device's mode) or per round (round phases, by the round's "
               f"modes); the line is measured = predicted. Panels: {panels}.")
    return style.save(fig, path, caption)


@style.styled
def plot_timeline(records: list[dict], path: Path, title: str | None = None) -> list[Path]:
    from matplotlib.patches import Patch

    from testbed.analysis.rate_plots import timeline_axes

    names = sorted({n for r in records for n in r["devices"]})
    rounds = [r["round"] for r in records]
    span = (max(rounds) - min(rounds) + 1) if rounds else 1
    st = style.current()
    if st.name == "paper":
        width = st.wide_in if span > 30 else st.width_in
        cell_pt = (width - 0.8) * 72.0 / span
        font = cell_pt * 0.62
        numbers = font >= 6.0  # a draft length under 6 pt is not readable in print: the caption says so
        font = min(font, st.font_pt)
    else:
        # Wide enough that a one- or two-digit draft length fits in its cell at 80+ rounds (capped for a page).
        width = float(np.clip(0.17 * span + 2.5, 8.0, 24.0))
        cell_pt = (width - 2.0) * 72.0 / span
        font = float(np.clip(cell_pt * 0.62, 3.5, 8.0))
        numbers = True
    fig, ax = timeline_axes(records, names, width, title)  # with fixed link rates: their panel above
    late = False
    for i, name in enumerate(names):
        for r in records:
            d = r["devices"].get(name)
            if d is None:
                continue
            color = MODE_COLORS["missed"] if d.get("missed") else MODE_COLORS.get(d["mode"], "white")
            hatch = "///" if d.get("report_late") else None
            late = late or bool(hatch)
            ax.barh(i, 1, left=r["round"] - 0.5, color=color, edgecolor="white", linewidth=0.4, hatch=hatch)
            if numbers:
                ax.text(r["round"], i, str(d["draft_len"]), ha="center", va="center", fontsize=font)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # first device on top
    ax.grid(False)
    _integer_rounds(ax)
    ax.set_xlim(min(rounds, default=0) - 0.6, max(rounds, default=0) + 0.6)
    style.title(ax, _heading(records, title, "mode per device and round; numbers: draft length L (tokens)", lines=2))
    handles = [Patch(color=MODE_COLORS["UL"], label="UL mode"), Patch(color=MODE_COLORS["DL"], label="DL mode"),
               Patch(color=MODE_COLORS["missed"], label="missed the deadline")]
    if late:
        handles.append(Patch(facecolor="white", edgecolor="k", hatch="///", label="report late"))
    if st.name == "paper":
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), frameon=False)
    else:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    lengths = ("the number in each cell is the device's draft length L (tokens)" if numbers else
               "draft lengths are too many to print at this width (see the screen style, or rounds.jsonl)")
    caption = (f"Mode per device and round{_of(records, title)}: blue UL mode, orange DL mode, grey a missed "
               f"deadline{', hatched a late report' if late else ''}; {lengths}.")
    return style.save(fig, path, caption)


ENERGY_TERMS = (("tx_j", "transmit", style.VERMILLION), ("rx_j", "receive", style.SKY_BLUE),
                ("compute_j", "compute (drafting)", style.GREY))


def has_energy(records: list[dict]) -> bool:
    """Whether any device-round has a measured total energy (its hardware profile gave the energy fields)."""
    return any((d.get("measured") or {}).get("energy_j") is not None
               for r in records for d in r.get("devices", {}).values())


@style.styled
def plot_energy(records: list[dict], path: Path, title: str | None = None) -> list[Path]:
    """Left: mean measured energy per round and device by term (stacked), the predicted total beside it, and
    tokens per joule above; right: measured transmit energy per round against each device's budget."""
    from testbed.runtime.energy import summarize_energy

    summary = summarize_energy(records) or {"devices": {}}
    names = [n for n, s in summary["devices"].items() if s["rounds"]]
    fig, (ax, bx) = style.figure((1, 2), aspect=0.75)
    x = np.arange(len(names))
    (offset,), width = style.bar_offsets(1, 0.6)
    bottom = np.zeros(len(names))
    for key, label, color in ENERGY_TERMS:
        per = np.array([(summary["devices"][n][f"measured_{key}"] or 0.0) / summary["devices"][n]["rounds"]
                        for n in names])
        ax.bar(x + offset, per, width, bottom=bottom, color=color, label=f"{label}, measured")
        bottom += per
    pred = [(summary["devices"][n]["predicted_energy_j"] or np.nan) / summary["devices"][n]["rounds"] for n in names]
    ax.scatter(x, pred, marker="_", s=300, color="k", zorder=3, label="total, predicted")
    for i, n in enumerate(names):
        tpj = summary["devices"][n]["tokens_per_j"]
        if tpj is not None:
            ax.annotate(f"{tpj:.3g} tok/J", (x[i], max(bottom[i], np.nan_to_num(pred[i]))), ha="center",
                        va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(x, names)
    ax.set_ylabel(style.label("energy_j"))
    ax.set_title("(a) mean energy per round, by term")
    ax.grid(True, axis="y")
    ax.grid(False, axis="x")
    ax.legend()
    for n in names:
        pts = [(r["round"], r["devices"][n]["measured"]["tx_j"]) for r in records
               if n in r["devices"] and (r["devices"][n].get("measured") or {}).get("tx_j") is not None]
        if not pts:
            continue
        color = style.device_color(n)
        bx.plot(*zip(*pts), marker="o", ms=2, color=color, label=n)
        budget = summary["devices"][n]["budget_j"]
        if budget is not None:
            bx.axhline(budget, color=color, ls="--", lw=1, label=f"{n} budget")
            over = [(rr, v) for rr, v in pts if not within(v, budget)]
            if over:
                bx.scatter(*zip(*over), marker="x", s=25, color=style.VERMILLION, zorder=4)
    _integer_rounds(bx)
    bx.set_ylabel(style.label("tx_j"))
    bx.set_title("(b) transmit energy per round")
    bx.legend(ncol=2)
    style.title(fig, _heading(records, title, "energy per device"))
    fig.tight_layout()
    caption = (f"Energy per device{_of(records, title)}. (a) Mean measured energy per round by term (transmit: UL "
               f"power x air time; receive: receive power x DL air time; compute: J per drafted token), the "
               f"predicted total (black dash) and tokens per joule. (b) Measured transmit energy per round, each "
               f"device's energy_budget_j dashed, rounds over it marked x.")
    return style.save(fig, path, caption)


# -- the prediction error per phase ----------------------------------------------------------------------

def phase_errors(records: list[dict]) -> dict[str, np.ndarray]:
    """phase -> relative errors (measured - predicted) / predicted of its samples (as in report.error_stats;
    phases whose prediction holds air time only over rounds whose rates had a basis)."""
    from testbed.analysis.phases import RATE_PHASES, phase_pairs, round_rate_basis

    based = phase_pairs([r for r in records if round_rate_basis(r) != "none"])
    out = {}
    for phase, pairs in phase_pairs(records).items():
        use = based[phase] if phase in RATE_PHASES else pairs
        rel = np.array([(m - p) / p for p, m in use if p and p > 0], float)
        if rel.size:
            out[phase] = rel
    return out


def _cdf(ax, values: np.ndarray, **kw):
    x = np.sort(100.0 * values)
    y = np.arange(1, x.size + 1) / x.size
    return ax.step(x, y, where="post", **kw)[0]


@style.styled
def plot_error_cdf(runs: list[tuple[str, list[dict]]], path: Path, title: str | None = None) -> list[Path]:
    """The CDF of the relative prediction error per phase: one line per phase (its colour), and with several
    runs one line style per run."""
    from matplotlib.lines import Line2D

    fig, ax = style.figure(aspect=0.75)
    phases_seen: dict[str, None] = {}
    counts = []
    for k, (label, records) in enumerate(runs):
        ls = style.RUN_LINESTYLES[k % len(style.RUN_LINESTYLES)]
        errs = phase_errors(records)
        counts.append(f"{label or 'the run'}: " + ", ".join(f"{p} {v.size}" for p, v in errs.items()))
        for phase, rel in errs.items():
            phases_seen[phase] = None
            _cdf(ax, rel, color=style.phase_color(phase), ls=ls,
                 label=style.words(phase) if len(runs) == 1 else f"{style.words(phase)}, {label}")
    ax.axvline(0.0, color="k", lw=0.6)
    ax.set_xlabel(style.label("relative_error"))
    ax.set_ylabel(style.label("cdf"))
    ax.set_ylim(0, 1.02)
    if len(runs) == 1:
        leg = ax.legend(loc="lower right")
    else:  # colour: the phase; line style: the run
        phase_h = [Line2D([], [], color=style.phase_color(p), label=style.words(p)) for p in phases_seen]
        run_h = [Line2D([], [], color="k", ls=style.RUN_LINESTYLES[k % len(style.RUN_LINESTYLES)], label=lab)
                 for k, (lab, _) in enumerate(runs)]
        leg = ax.legend(handles=phase_h, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="phase", frameon=False)
        ax.add_artist(leg)
        ax.legend(handles=run_h, loc="lower left", bbox_to_anchor=(1.0, 0.0), title="run", frameon=False)
    style.title(ax, (f"{title}: " if title else "") + "prediction error per phase (CDF)")
    one = runs[0][1] if len(runs) == 1 else []
    who = _of(one, title) if one else f" of {len(runs)} runs"
    caption = (f"Distribution (CDF) of the relative prediction error (measured - predicted) / predicted per "
               f"phase{who}; left of 0 the model over-predicted, right of it under-predicted. Samples per phase: "
               + "; ".join(counts) + ".")
    return style.save(fig, path, caption)


# -- several runs in one figure ---------------------------------------------------------------------------

@style.styled
def plot_overlay_goodput(runs: list[tuple[str, list[dict]]], path: Path, title: str | None = None,
                         colors: list[str] | None = None) -> list[Path]:
    """Goodput over rounds of several runs: measured solid, predicted dashed, one colour per run."""
    fig, ax = style.figure(aspect=0.7)
    for k, (label, records) in enumerate(runs):
        color = (colors or [])[k] if colors and k < len(colors) else style.series_color(k)
        rounds = [r["round"] for r in records]
        ax.plot(rounds, [r["measured"].get("goodput_tps") for r in records], color=color, ls="-",
                label=f"{label}, measured")
        ax.plot(rounds, [r["predicted"].get("goodput_tps") for r in records], color=color, ls="--",
                lw=0.8 * style.current().line_w, label=f"{label}, predicted")
    _integer_rounds(ax)
    ax.set_ylabel(style.label("goodput_tps"))
    style.title(ax, (f"{title}: " if title else "") + "goodput per round")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    caption = ("Goodput per round of " + ", ".join(f"{lab} ({len(recs)} rounds)" for lab, recs in runs)
               + ": measured solid, the model's prediction dashed, one colour per run; runs labelled by the "
                 "settings in which they differ.")
    return style.save(fig, path, caption)


def write_overlay_plots(runs: list[tuple[str, list[dict]]], out_dir: str | Path, title: str | None = None,
                        colors: list[str] | None = None) -> list[Path]:
    """overlay_goodput and overlay_phase_errors_cdf in `out_dir`, in the formats in force."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [*plot_overlay_goodput(runs, out / "overlay_goodput", title, colors),
            *plot_error_cdf(runs, out / "overlay_phase_errors_cdf", title)]


def write_run_plots(records: list[dict], out_dir: str | Path, title: str | None = None,
                    cdf: bool = False) -> list[Path]:
    """goodput, phases and timeline in `out_dir` (energy where the records carry a measured energy; with
    `cdf`, `multispin report`'s, phase_errors_cdf), each in the formats in force with its caption; `title`
    (e.g. the run directory's name) heads every screen plot together with the policy, and names the run in
    the captions."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [*plot_goodput(records, out / "goodput", title), *plot_phases(records, out / "phases", title),
             *plot_timeline(records, out / "timeline", title)]
    if has_energy(records):
        paths += plot_energy(records, out / "energy", title)
    if cdf and phase_errors(records):
        paths += plot_error_cdf([(title or "", records)], out / "phase_errors_cdf", title)
    return paths
