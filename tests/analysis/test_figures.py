"""Paper-ready figures (testbed.analysis.style): the formats and captions written, one colour per device and
per policy across figures, integer ticks, bars centred on their ticks, the prediction-error CDF (one line per
phase), the overlay of two runs labelled by their differing settings, and plug-in policies in simulate's
ul_devices figure. Synthetic records (support.synth_records) and run directories; no processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support import synth_records

from testbed.analysis import style


@pytest.fixture
def figs(monkeypatch):
    """Every figure saved, by file name (the last one saved under a name wins)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    got: dict[str, Figure] = {}
    save = Figure.savefig

    def keep(self, path, *a, **kw):
        got[Path(path).name] = self
        return save(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    return got


@pytest.fixture(scope="module")
def records():
    return synth_records(12, slow=1.2)


def _run_dir(path: Path, records: list[dict], policy: str, **profile) -> Path:
    from testbed.runtime.records import RunRecorder

    rec = RunRecorder(path)
    rec.write_meta({"name": "synthetic", "policy": policy, "seed": 1, **profile}, status="complete")
    for r in records:
        rec.append_round({**r, "policy": policy})
    rec.close()
    return path


def test_colours_are_stable_and_colour_blind_safe():
    assert style.policy_color("proposed") == style.VERMILLION
    assert style.policy_color("all-ul") == style.MODE_COLORS["UL"]
    # A plug-in's colour is a stable hash into the palette (crc32, not Python's salted hash).
    assert style.policy_color("my-plugin") == style.policy_color("my-plugin") in style.PALETTE
    import zlib

    assert style.policy_color("my-plugin") == style.PALETTE[zlib.crc32(b"my-plugin") % len(style.PALETTE)]
    assert len({style.device_color(f"dev{i}") for i in range(7)}) == 7  # numbered devices never share one
    assert not {style.device_color(f"dev{i}") for i in range(7)} & {style.MODE_COLORS["UL"], style.MODE_COLORS["DL"]}
    assert style.label("uplink_phase_s") == "uplink phase [s]" and style.label("goodput_tps") == "goodput [tokens/s]"
    assert style.words("ul_air_s[DL mode]") == "uplink air time, DL-mode devices"
    assert style.parse_formats("PDF, svg,png") == ("pdf", "svg", "png")
    with pytest.raises(ValueError, match="pdf, svg, png"):
        style.parse_formats("jpg")


@pytest.mark.parametrize("name", ["paper", "screen"])
def test_run_figures_in_every_format_with_captions(tmp_path, records, name, figs):
    from testbed.analysis.run_plots import write_run_plots

    with style.using(name, "pdf,svg,png"):
        paths = write_run_plots(records, tmp_path, title="20250101-000000-proposed", cdf=True)
    stems = ["goodput", "phases", "timeline", "phase_errors_cdf"]
    assert [p.name for p in paths] == [f"{s}.{f}" for s in stems for f in ("pdf", "svg", "png")]
    for p in paths:
        assert p.stat().st_size > 1000, p
    assert (tmp_path / "goodput.pdf").read_bytes().startswith(b"%PDF")
    assert b"<svg" in (tmp_path / "goodput.svg").read_bytes()[:2000]
    caps = style.captions(paths)
    assert list(caps) == stems
    assert "20250101-000000-proposed" in caps["goodput"] and "policy proposed" in caps["goodput"]
    fig = figs["goodput.png"]
    ax = fig.axes[0]
    assert ax.get_ylabel() == "goodput [tokens/s]" and ax.get_xlabel() == "round"
    if name == "paper":
        assert ax.get_title() == ""  # the caption has it
        assert fig.get_size_inches()[0] == pytest.approx(3.5)
        fonts = [t.get_fontsize() for t in (ax.xaxis.label, *ax.get_xticklabels(), *ax.get_legend().get_texts())]
        assert min(fonts) >= 8
    else:
        assert "20250101-000000-proposed" in ax.get_title()


def test_integer_round_ticks(tmp_path, records, figs):
    from testbed.analysis.run_plots import write_run_plots

    with style.using("paper", "png"):
        write_run_plots(records[:5], tmp_path)  # five rounds: a default locator would put ticks at 0.5
    for name in ("goodput.png", "timeline.png"):
        ax = figs[name].axes[-1]
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (name, ticks)


def test_the_same_device_has_the_same_colour_in_two_figures(tmp_path, figs):
    """The energy figure's transmit-energy lines and the timeline's link-rate panel (a rate trace): a device's
    colour is its own in both, whatever other devices are drawn beside it."""
    from testbed.analysis.run_plots import plot_energy, plot_timeline

    recs = synth_records(6)
    for r in recs:
        for d in r["devices"].values():
            d["trace_rate_bps"] = {"ul": 2e6, "dl": 5e6}
            d["measured"].update(tx_j=0.1, rx_j=0.05, compute_j=0.02, energy_j=0.17)
    plot_timeline(recs, tmp_path / "timeline")
    only_b = [{**r, "devices": {"b": r["devices"]["b"]}} for r in recs]
    with style.using("screen"):
        plot_energy(only_b, tmp_path / "energy")
    rate_ax = figs["timeline.png"].axes[0]
    rates = {ln.get_label().split()[0]: ln.get_color() for ln in rate_ax.get_lines()}
    energy = {ln.get_label(): ln.get_color() for ln in figs["energy.png"].axes[1].get_lines()}
    assert rates["b"] == energy["b"] == style.device_color("b")
    assert rates["a"] != rates["b"]


def test_policy_colours_match_across_simulate_and_compare(tmp_path, figs):
    from matplotlib.container import ErrorbarContainer

    from testbed.analysis.runs_index import plot_compare
    from testbed.analysis.sim_plots import plot_sweep

    rows = [{"sweep_key": "devices", "value": v, "drop": d, "policy": p, "goodput_tps": 10.0 + v + d + k,
             "num_ul_devices": min(v, k + d), "num_devices": v}
            for v in (2, 4, 6) for d in range(2) for k, p in enumerate(["proposed", "all-dl", "my-plugin"])]
    plot_sweep(rows, tmp_path)
    ax = figs["goodput.png"].axes[0]
    bars = {c.get_label(): c for c in ax.containers if isinstance(c, ErrorbarContainer)}
    sim = {p: c.lines[0].get_color() for p, c in bars.items()}
    assert sim == {p: style.policy_color(p) for p in ("proposed", "all-dl", "my-plugin")}
    # Two drops: the legend says the interval rests on two.
    assert "2 drops" in ax.get_legend().get_title().get_text()
    cmp_rows = [{"policy": p, "label": p, "runs": 2, "measured_mean_tps": 5.0 + k, "measured_std_tps": 0.5,
                 "predicted_mean_tps": 6.0, "predicted_std_tps": 0.2, "measured_tps": [4.5, 5.5 + k],
                 "predicted_tps": [6.0, 6.0]} for k, p in enumerate(["proposed", "my-plugin"])]
    paths = plot_compare(cmp_rows, tmp_path / "cmp")
    assert [p.name for p in paths] == ["compare_goodput.png"]
    assert (tmp_path / "cmp" / "compare_goodput.caption.txt").is_file()
    ax = figs["compare_goodput.png"].axes[0]
    import matplotlib.colors as mc

    filled = [b for b in ax.patches if b.get_hatch() is None]
    assert [mc.to_hex(b.get_facecolor()) for b in filled] == [style.policy_color("proposed").lower(),
                                                              style.policy_color("my-plugin").lower()]
    # Bars centred on their ticks: the mean of a group's bar centres is the tick.
    ticks = list(ax.get_xticks())
    for i, tick in enumerate(ticks):
        centres = [b.get_x() + b.get_width() / 2 for b in ax.patches if abs(b.get_x() + b.get_width() / 2 - tick) < 0.5]
        assert len(centres) == 2 and np.mean(centres) == pytest.approx(tick), (i, centres)
    assert "n=2" in ax.get_legend().get_title().get_text() or "2 runs" in ax.get_legend().get_title().get_text()


def test_bar_offsets_are_centred():
    for n in (1, 2, 3, 4):
        offsets, w = style.bar_offsets(n)
        assert sum(offsets) == pytest.approx(0.0) and w * n == pytest.approx(0.8)


def test_plugin_policies_appear_in_ul_devices(tmp_path, figs):
    from matplotlib.container import ErrorbarContainer

    from testbed.analysis.sim_plots import plot_sweep

    rows = [{"sweep_key": "devices", "value": v, "drop": d, "policy": p, "goodput_tps": 1.0 + d,
             "num_ul_devices": d, "num_devices": v}
            for v in (2, 4) for d in range(3) for p in ["proposed", "all-ul", "all-dl", "ge-threshold"]]
    plot_sweep(rows, tmp_path)
    ax = figs["ul_devices.png"].axes[0]
    shown = [c.get_label() for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert shown == ["proposed", "ge-threshold"]
    assert all(float(t).is_integer() for t in ax.get_yticks())


def test_error_cdf_has_one_line_per_phase(tmp_path, records, figs):
    from testbed.analysis.run_plots import phase_errors, plot_error_cdf

    errs = phase_errors(records)
    plot_error_cdf([("run", records)], tmp_path / "cdf")
    ax = figs["cdf.png"].axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label() in {style.words(p) for p in errs}]
    assert len(lines) == len(errs) >= 4
    assert len({ln.get_color() for ln in lines}) == len(lines)
    for ln in lines:  # a CDF: non-decreasing to 1
        y = np.asarray(ln.get_ydata(), float)
        assert np.all(np.diff(y) >= 0) and y[-1] == pytest.approx(1.0)
    assert "%" in ax.get_xlabel()


def test_report_overlay_of_two_runs(tmp_path, capsys, figs):
    from testbed.cli import main

    a = _run_dir(tmp_path / "a", synth_records(8, slow=1.2), "proposed")
    b = _run_dir(tmp_path / "b", synth_records(6, slow=1.0), "all-ul")
    out = tmp_path / "ov"
    assert main(["report", str(a), str(b), "--overlay", "--overlay-out", str(out), "--style", "paper",
                 "--format", "pdf,png"]) == 0
    text = capsys.readouterr().out
    for stem in ("overlay_goodput", "overlay_phase_errors_cdf"):
        assert (out / f"{stem}.pdf").is_file() and (out / f"{stem}.png").is_file()
        assert not (out / f"{stem}.svg").exists()
        assert (out / f"{stem}.caption.txt").is_file() and f"{stem}: " in text
    ax = figs["overlay_goodput.png"].axes[0]
    labels = {ln.get_label(): ln.get_color() for ln in ax.get_lines()}
    # Labelled by the setting that differs (the policy), in the policies' colours.
    assert labels["proposed, measured"] == style.policy_color("proposed")
    assert labels["all-ul, measured"] == style.policy_color("all-ul")
    assert len(ax.get_lines()) == 4
    assert main(["report", str(a), "--format", "jpg"]) == 2  # a CliError: named, no traceback


def test_report_one_run_writes_cdf_and_captions(tmp_path, capsys):
    from testbed.cli import main

    a = _run_dir(tmp_path / "a", synth_records(5), "proposed")
    assert main(["report", str(a), "--format", "svg"]) == 0
    text = capsys.readouterr().out
    assert (a / "plots" / "phase_errors_cdf.svg").is_file() and (a / "plots" / "goodput.caption.txt").is_file()
    assert not (a / "plots" / "goodput.png").exists()
    assert "  goodput: Goodput per round of run a" in text


@pytest.mark.parametrize("entries, below", [(8, True), (3, False)])
def test_a_long_legend_goes_below_a_paper_columns_axes(entries, below):
    # Inside, 8 entries in 2 columns covered half of a 3.5 in panel's data (the Qwen campaign's figure).
    import matplotlib.pyplot as plt

    with style.using("paper", "png"):
        fig, ax = style.figure()
        with style.rc():
            for i in range(entries):
                ax.plot([1, 2, 4], [i, i + 1, i + 2], label=f"policy {i}")
            leg = style.legend(ax, style.spread_note(3, "repeats"), ncol=2)
            fig.canvas.draw()
            legend_box, axes_box = leg.get_window_extent(), ax.get_window_extent()
        plt.close(fig)
        assert (legend_box.y1 < axes_box.y0) == below
