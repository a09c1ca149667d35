"""The plots of one run (matplotlib, Agg): goodput per round, predicted vs measured per phase, and the
mode / draft-length timeline, drawn to be read in a paper: integer round ticks, the run and its policy in
every title, phase names in words (with the record's name beside them), points colored by mode, legends.

`testbed.analysis.report.write_plots` draws through `write_run_plots`; the phases and their samples come from
`testbed.analysis.phases` (PHASES, phase_pairs), so the vocabulary lives in one place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.core.vocabulary import DL, MODES, UL, within

MODE_COLORS = {UL: "tab:blue", DL: "tab:orange", "mixed": "tab:green", "missed": "lightgray"}
# Phase base names in words; a bracket in the phase name ("[UL mode]") narrows the samples.
PHASE_WORDS = {
    "draft_s": "drafting", "ul_air_s": "uplink air time", "uplink_phase_s": "uplink phase (drafting + air)",
    "dl_air_s": "downlink air time", "downlink_phase_s": "downlink phase", "verify_s": "verification",
    "round_s": "round time", "goodput_tps": "goodput",
    # names of earlier releases, in records that carry only them
    "uplink_s": "uplink air time", "up_phase_s": "uplink phase", "downlink_s": "downlink air time",
}
_QUALIFIERS = {"UL mode": "UL-mode devices", "DL mode": "DL-mode devices", "p": "distribution sent"}


def phase_title(phase: str) -> str:
    """'ul_air_s[DL mode]' -> 'uplink air time, DL-mode devices' (the record's name goes on a second line)."""
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


def _heading(records: list[dict], title: str | None, what: str, lines: int = 1) -> str:
    """'<run> — policy <p>: <what>' (on two lines with lines=2: a narrow figure would cut it)."""
    policy = records[0].get("policy") if records else None
    who = " — ".join(x for x in (title, f"policy {policy}" if policy else None) if x)
    if not who:
        return what
    return f"{who}\n{what}" if lines == 2 else f"{who}: {what}"


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def plot_goodput(records: list[dict], path: Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    # Dashed: two grey lines of similar weight could not be told apart in print.
    ax.plot(rounds, [r["predicted"].get("goodput_tps") for r in records], label="predicted", color="tab:gray",
            lw=1.4, ls="--")
    ax.plot(rounds, [r["measured"].get("goodput_tps") for r in records], label="measured", color="k", lw=0.8,
            alpha=0.6)
    # The measured points carry the round's modes: all UL, all DL, or a mix.
    for mix, label in (("UL", "measured, all UL"), ("DL", "measured, all DL"), ("mixed", "measured, UL and DL")):
        pts = [(r["round"], r["measured"].get("goodput_tps")) for r in records if _round_mix(r) == mix]
        if pts:
            ax.scatter(*zip(*pts), s=14, color=MODE_COLORS[mix], label=label, zorder=3)
    _integer_rounds(ax)
    ax.set_ylabel("goodput (tokens/s)")
    bases = {r.get("time_base", "wall") for r in records}
    clock = " (virtual time base)" if bases == {"virtual"} else ""
    ax.set_title(_heading(records, title, f"goodput per round{clock}"), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)  # off the data
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_phases(records: list[dict], path: Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt

    from testbed.analysis.phases import PHASES

    groups = _pairs_by_mode(records)
    shown = [k for k, g in groups.items() if g and PHASES[k][2] == "s"]
    cols = 3
    nrows = max(1, (len(shown) + cols - 1) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.8 * nrows + 0.5), squeeze=False)
    labels = {"UL": "UL mode", "DL": "DL mode", "mixed": "UL and DL"}
    for ax, phase in zip(axes.flat, shown):
        lo, hi = np.inf, 0.0
        top = max(max(a, b) for pairs in groups[phase].values() for a, b in pairs)
        scale, unit = (1e6, "µs") if top < 1e-3 else (1e3, "ms") if top < 10 else (1.0, "s")
        for group, pairs in groups[phase].items():
            p = scale * np.array([a for a, _ in pairs], float)
            m = scale * np.array([b for _, b in pairs], float)
            lo, hi = min(lo, p.min(), m.min()), max(hi, p.max(), m.max())
            ax.scatter(p, m, s=9, alpha=0.6, color=MODE_COLORS[group], label=f"{labels[group]} (n={len(p)})")
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="measured = predicted")
        if lo > 0 and hi / lo > 100:  # e.g. DL-mode uploads of bytes next to UL-mode ones of megabytes
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(f"{phase_title(phase)}\n({phase})", fontsize=9)
        ax.set_xlabel(f"predicted ({unit})")
        ax.set_ylabel(f"measured ({unit})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle(_heading(records, title, "measured vs predicted per phase"), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_timeline(records: list[dict], path: Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = sorted({n for r in records for n in r["devices"]})
    rounds = [r["round"] for r in records]
    span = (max(rounds) - min(rounds) + 1) if rounds else 1
    # Wide enough that a one- or two-digit draft length fits in its cell at 80+ rounds (capped for a page).
    width = float(np.clip(0.17 * span + 2.5, 8.0, 24.0))
    cell_pt = (width - 2.0) * 72.0 / span
    font = float(np.clip(cell_pt * 0.62, 3.5, 8.0))
    from testbed.analysis.rate_plots import timeline_axes

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
            ax.text(r["round"], i, str(d["draft_len"]), ha="center", va="center", fontsize=font)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # first device on top
    _integer_rounds(ax)
    ax.set_xlim(min(rounds, default=0) - 0.6, max(rounds, default=0) + 0.6)
    ax.set_title(_heading(records, title, "mode per device and round; numbers: draft length L (tokens)", lines=2),
                 fontsize=10)
    handles = [Patch(color=MODE_COLORS["UL"], label="UL mode"), Patch(color=MODE_COLORS["DL"], label="DL mode"),
               Patch(color=MODE_COLORS["missed"], label="missed the deadline")]
    if late:
        handles.append(Patch(facecolor="white", edgecolor="k", hatch="///", label="report late"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


ENERGY_TERMS = (("tx_j", "transmit", "tab:blue"), ("rx_j", "receive", "tab:orange"),
                ("compute_j", "compute (drafting)", "tab:gray"))


def has_energy(records: list[dict]) -> bool:
    """Whether any device-round has a measured total energy (its hardware profile gave the energy fields)."""
    return any((d.get("measured") or {}).get("energy_j") is not None
               for r in records for d in r.get("devices", {}).values())


def plot_energy(records: list[dict], path: Path, title: str | None = None) -> Path:
    """Left: mean measured energy per round and device by term (stacked), the predicted total beside it, and
    tokens per joule above; right: measured transmit energy per round against each device's budget."""
    import matplotlib.pyplot as plt

    from testbed.runtime.energy import summarize_energy

    summary = summarize_energy(records) or {"devices": {}}
    names = [n for n, s in summary["devices"].items() if s["rounds"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6))
    x = np.arange(len(names))
    bottom = np.zeros(len(names))
    for key, label, color in ENERGY_TERMS:
        per = np.array([(summary["devices"][n][f"measured_{key}"] or 0.0) / summary["devices"][n]["rounds"]
                        for n in names])
        ax.bar(x, per, 0.6, bottom=bottom, color=color, label=f"{label}, measured")
        bottom += per
    pred = [(summary["devices"][n]["predicted_energy_j"] or np.nan) / summary["devices"][n]["rounds"] for n in names]
    ax.scatter(x, pred, marker="_", s=600, color="k", zorder=3, label="total, predicted")
    for i, n in enumerate(names):
        tpj = summary["devices"][n]["tokens_per_j"]
        if tpj is not None:
            ax.annotate(f"{tpj:.3g} tok/J", (x[i], max(bottom[i], np.nan_to_num(pred[i]))), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(x, names)
    ax.set_ylabel("energy per round (J)")
    ax.set_title("mean energy per round, by term", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, n in enumerate(names):
        pts = [(r["round"], r["devices"][n]["measured"]["tx_j"]) for r in records
               if n in r["devices"] and (r["devices"][n].get("measured") or {}).get("tx_j") is not None]
        if not pts:
            continue
        color = colors[i % len(colors)]
        bx.plot(*zip(*pts), marker="o", ms=3, lw=1, color=color, label=n)
        budget = summary["devices"][n]["budget_j"]
        if budget is not None:
            bx.axhline(budget, color=color, ls="--", lw=1, label=f"{n} budget")
            over = [(rr, v) for rr, v in pts if not within(v, budget)]
            if over:
                bx.scatter(*zip(*over), marker="x", s=40, color="red", zorder=4)
    _integer_rounds(bx)
    bx.set_ylabel("transmit energy (J)")
    bx.set_title("measured transmit energy per round (dashed: energy_budget_j; x: over it)", fontsize=10)
    bx.grid(True, alpha=0.3)
    bx.legend(fontsize=7, ncol=2)
    fig.suptitle(_heading(records, title, "energy per device (tx: UL power x air time; rx: receive power x DL air "
                                          "time; compute: J per drafted token)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_run_plots(records: list[dict], out_dir: str | Path, title: str | None = None) -> list[Path]:
    """goodput.png, phases.png and timeline.png in `out_dir` (and energy.png where the records carry a
    measured energy); `title` (e.g. the run directory's name) heads every plot together with the policy."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_goodput(records, out / "goodput.png", title), plot_phases(records, out / "phases.png", title),
             plot_timeline(records, out / "timeline.png", title)]
    if has_energy(records):
        paths.append(plot_energy(records, out / "energy.png", title))
    return paths
