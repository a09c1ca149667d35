"""`multispin report RUN_DIR`: measured vs predicted goodput and per-phase errors, plus plots; `--overlay`:
several runs in one figure; `--style` and `--format` (here and in compare, campaign, simulate): the look
and the files of every figure (`testbed.analysis.style`)."""

from __future__ import annotations

import functools
from pathlib import Path


def add_figure_arguments(p) -> None:
    """--style paper|screen and --format pdf,svg,png, for every command that draws figures."""
    from testbed.analysis.style import DEFAULT_FORMATS, DEFAULT_STYLE, FORMATS, STYLES

    p.add_argument("--style", choices=sorted(STYLES), default=DEFAULT_STYLE,
                   help="figure style: paper (one column, 3.5 in, 8 pt, Okabe-Ito colours, no titles: the caption "
                        f"beside each figure has them) or screen (wider, titled; default {DEFAULT_STYLE})")
    p.add_argument("--format", default=",".join(DEFAULT_FORMATS), metavar="FMT[,FMT...]",
                   help=f"figure files, comma-separated from {', '.join(FORMATS)} (default "
                        f"{','.join(DEFAULT_FORMATS)}); each figure also gets <figure>.caption.txt")


def with_figures(handler):
    """`handler` with the --style and --format of its arguments in force for every figure it draws."""

    @functools.wraps(handler)
    def run(args) -> int:
        from testbed.analysis import style
        from testbed.cli import CliError

        try:
            formats = style.parse_formats(getattr(args, "format", None))
        except ValueError as exc:
            raise CliError(str(exc)) from None
        with style.using(getattr(args, "style", None), formats):
            return handler(args)

    return run


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="summarise a run directory (measured vs predicted) and plot it")
    p.add_argument("run_dir", help="a directory written by `multispin run` (or `compare`: its runs side by side)")
    from testbed.cli.runs import add_report_arguments

    add_report_arguments(p)  # RUN_DIR ... side by side, --csv, --parquet (testbed/cli/runs.py)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plots", action="store_true")
    add_figure_arguments(p)
    p.add_argument("--overlay", action="store_true",
                   help="with several runs: goodput over rounds and the prediction-error CDFs of all of them in one "
                        "figure each, every run labelled by the settings that differ")
    p.add_argument("--overlay-out", default=None, metavar="DIR",
                   help="folder of the overlay figures (default: the first run's plots/overlay)")
    p.set_defaults(handler=with_figures(handle))


def print_figures(paths: list[Path]) -> None:
    """The figure files, and each figure's caption (its <figure>.caption.txt)."""
    from testbed.analysis.style import captions

    print("plots: " + ", ".join(str(p) for p in paths))
    for name, text in captions(paths).items():
        print(f"  {name}: {text}")


def handle(args) -> int:
    from testbed.analysis import report
    from testbed.cli import CliError
    from testbed.cli.runs import report_many, wants_many
    from testbed.runtime.records import json_text, load_run

    if args.overlay:
        return overlay(args)
    if is_campaign(args):
        return campaign_report(args)
    if wants_many(args):
        return report_many(args)
    run_dir = Path(args.run_dir)
    try:
        meta, records = load_run(run_dir)
    except FileNotFoundError as exc:
        raise CliError(str(exc)) from None
    if not records:
        raise CliError(f"{run_dir}: rounds.jsonl holds no complete round")
    summary = report.summarize(records)
    from testbed.run.planning import expected_from_meta  # under a fading channel: the expected goodput

    summary = expected_from_meta(summary, meta, records)
    from testbed.analysis import serving
    from testbed.runtime.records import load_requests

    if (requests := load_requests(run_dir)):  # a run that served requests: TTFT, ITL, ... percentiles
        summary["serving"] = serving.summarize(requests)
    if args.json:
        print(json_text(summary, indent=2))
    else:
        status = meta.get("status", "unknown")
        print(f"{run_dir} (status {status}, git {meta.get('git_revision')})")
        print(report.format_summary(summary))
    if not args.no_plots:
        from testbed.analysis.run_plots import write_run_plots
        from testbed.analysis.runs_index import plot_title

        paths = write_run_plots(records, run_dir / "plots", title=plot_title(run_dir), cdf=True)
        if not args.json:
            print_figures(paths)
    return 0


def overlay_labels(infos) -> tuple[list[str], list[str] | None]:
    """(a label per run from the settings that differ, e.g. 'proposed, channel.mode=virtual'; the policies'
    colours when the policy alone differs, else None). Runs whose settings are equal keep their folder names."""
    from testbed.analysis import style
    from testbed.analysis.runs_index import _shown, differing_settings

    keys = differing_settings(infos)
    labels = [", ".join(_shown(i.settings.get(k)) if k == "policy" else f"{k}={_shown(i.settings.get(k))}"
                        for k in keys if k != "name") for i in infos]
    if not all(labels) or len(set(labels)) < len(labels):
        labels = [i.label for i in infos]
    colors = [style.policy_color(i.policy or "") for i in infos] if keys == ["policy"] else None
    return labels, colors


def overlay(args) -> int:
    """`report A B ... --overlay`: the runs side by side as text (as without it), and in one figure each."""
    from testbed.analysis.run_plots import write_overlay_plots
    from testbed.analysis.runs_index import expand_run_dirs, run_info
    from testbed.cli import CliError
    from testbed.cli.runs import report_many
    from testbed.runtime.records import load_run

    dirs = expand_run_dirs([args.run_dir, *args.more_runs])
    if len(dirs) < 2:
        raise CliError("--overlay: name two or more runs (or a compare directory)")
    report_many(args)
    if args.no_plots:
        return 0
    infos = [run_info(d) for d in dirs]
    labels, colors = overlay_labels(infos)
    runs = []
    for label, d in zip(labels, dirs):
        records = load_run(d)[1]
        if records:
            runs.append((label, records))
    if not runs:
        raise CliError("--overlay: no run holds a complete round")
    out = Path(args.overlay_out) if args.overlay_out else dirs[0] / "plots" / "overlay"
    paths = write_overlay_plots(runs, out, colors=colors if colors and len(runs) == len(dirs) else None)
    if not args.json:
        print_figures(paths)
    return 0


def is_campaign(args) -> bool:
    from testbed.run.campaign import SPEC_FILE

    return not args.more_runs and (Path(args.run_dir) / SPEC_FILE).is_file()


def campaign_report(args) -> int:
    """`report CAMPAIGN_DIR`: from the folder alone, results.csv and summary.txt rewritten from its runs, the
    table per point, and the campaign's figures; --csv/--parquet: its runs' rounds, flat."""
    from testbed.run.campaign import FINISHED, campaign_plots, format_orderings, run_status, write_results
    from testbed.run.campaign_grow import load_campaign
    from testbed.runtime.records import json_text

    camp = load_campaign(args.run_dir)
    finished = [r for r in camp.runs if run_status(r.run_dir) in FINISHED]
    if args.csv is not None or args.parquet is not None:
        from testbed.cli.runs import _export

        return _export(args, [args.run_dir], [r.run_dir for r in finished])
    rows = write_results(camp)
    text = format_orderings(rows, camp.policies)
    (camp.out / "summary.txt").write_text(text + "\n")
    head = (f"{camp.out} (campaign: {camp.sweep.key}; {len(camp.sweep.values)} points x {len(camp.policies)} "
            f"policies x {camp.repeats} repeat(s); {len(finished)} of {len(camp.runs)} runs finished)")
    if args.json:
        print(json_text({"campaign": str(camp.out), "sweep": camp.spec()["sweep"], "policies": camp.policies,
                         "repeats": camp.repeats, "runs": len(camp.runs), "finished": len(finished),
                         "results": rows}, indent=2))
    else:
        print(head)
        print(text)
    if not args.no_plots and rows:
        paths = campaign_plots(camp, rows)
        if not args.json:
            print_figures(paths)
    return 0
