"""What a researcher reads off a run: the run plots a paper could use (integer round ticks, run and
policy in every title, a legend on the timeline, predicted and measured goodput told apart), the progress bar's
units, `channel validate` when nothing is in the target's scope, and simulate's table without a comparison.

Records are real round records (edge_node.controller.round_record); the validate test starts one emulator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, synth_records


def _records(n: int) -> list[dict]:
    return synth_records(n, slow=1.2)  # real round records (controller.round_record) of two devices


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """The figures of write_run_plots by file name, captured as they are saved."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figs: dict[str, Figure] = {}
    save = Figure.savefig

    def keep(self, path, *a, **kw):
        figs[Path(path).name] = self
        return save(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    from testbed.analysis.run_plots import write_run_plots

    write_run_plots(_records(80), tmp_path, title="20250101-000000-proposed")
    return figs


def test_run_plots_have_integer_rounds_titles_and_legends(drawn):
    assert {"goodput.png", "phases.png", "timeline.png"} <= set(drawn)
    for name in ("goodput.png", "timeline.png"):
        ax = drawn[name].axes[-1]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (name, ticks)
        assert ax.get_xlabel() == "round"
        assert "20250101-000000-proposed" in ax.get_title() and "policy proposed" in ax.get_title()
    legend = drawn["timeline.png"].axes[-1].get_legend()
    assert legend is not None and {"UL mode", "DL mode"} <= {t.get_text() for t in legend.get_texts()}
    # Phases: the phase in words with the record's name, the run and policy on top, units on the axes.
    fig = drawn["phases.png"]
    assert "policy proposed" in fig._suptitle.get_text()
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert any(t.startswith("uplink air time, ") and "(ul_air_s[" in t for t in titles), titles
    assert "uplink phase (drafting + air)\n(uplink_phase_s)" in titles
    assert all(ax.get_xlabel().startswith("predicted [") for ax in fig.axes if ax.get_title())


def test_goodput_plot_tells_predicted_from_measured(drawn):
    ax = drawn["goodput.png"].axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert {"predicted", "measured"} <= set(lines)
    pred, meas = lines["predicted"], lines["measured"]
    assert (pred.get_linestyle(), pred.get_color()) != (meas.get_linestyle(), meas.get_color())
    assert pred.get_linestyle() != meas.get_linestyle()  # in grey print too
    assert ax.get_ylabel() == "goodput [tokens/s]"


def test_progress_bar_names_the_round_goodput_with_units():
    from testbed.run.session import progress_postfix

    rec = _records(1)[0]
    text = progress_postfix(rec, 42)
    m, p = rec["measured"]["goodput_tps"], rec["predicted"]["goodput_tps"]
    assert text == f"round goodput {m:.1f} meas / {p:.1f} pred tok/s, 42 tok, {rec['num_ul']} UL"
    assert progress_postfix({**rec, "rounds": "asynchronous"}, 1).startswith("cycle goodput ")


@pytest.mark.live
def test_validate_says_why_when_nothing_is_in_the_targets_scope():
    # 100 bytes at 1 Mbit/s: 1.1 ms of air, below the 2 ms scope of a real hold: status 1, and why.
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "channel", "validate", "--sizes", "100", "--rates",
                          "1e6", "--repeats", "2", "--lead", "0,0"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    assert "0/0 cells meet it" in out.stdout
    assert "nothing validated" in out.stderr and "below 2 ms" in out.stderr and "Traceback" not in out.stderr


def test_simulate_table_shows_a_dash_where_nothing_is_compared():
    from testbed.core.simulate import summary_table

    rows = [{"sweep_key": "devices", "value": 2, "policy": "proposed", "goodput_tps": 10.0,
             "num_ul_devices": 1}]
    table = summary_table(rows)
    assert "nan" not in table and table.splitlines()[-1].split()[-2:] == ["-", "-"]
    rows = [{**rows[0], "policy": "all-dl"}, {**rows[0], "policy": "all-ul", "goodput_tps": 5.0}]
    last = summary_table(rows).splitlines()[-1].split()
    assert "nan" not in last and last[-3:] == ["-", "all-dl", "-"]
    both = summary_table([{**rows[0], "policy": "proposed"}, rows[1]]).splitlines()[-1].split()
    assert both[-3:] == ["1.0", "all-ul", "2.0000"]  # proposed 10 tok/s against all-ul's 5
