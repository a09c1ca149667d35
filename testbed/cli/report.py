"""`multispin report RUN_DIR`: measured vs predicted goodput and per-phase errors, plus plots."""

from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="summarise a run directory (measured vs predicted) and plot it")
    p.add_argument("run_dir", help="a directory written by `multispin run` (or `compare`: its runs side by side)")
    from testbed.cli.runs import add_report_arguments

    add_report_arguments(p)  # RUN_DIR ... side by side, --csv, --parquet (testbed/cli/runs.py)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from testbed.analysis import report
    from testbed.cli import CliError
    from testbed.cli.runs import report_many, wants_many
    from testbed.runtime.records import json_text, load_run

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
    if args.json:
        print(json_text(summary, indent=2))
    else:
        status = meta.get("status", "unknown")
        print(f"{run_dir} (status {status}, git {meta.get('git_revision')})")
        print(report.format_summary(summary))
    if not args.no_plots:
        from testbed.analysis.runs_index import plot_title

        paths = report.write_plots(records, run_dir / "plots", title=plot_title(run_dir))
        if not args.json:
            print("plots: " + ", ".join(str(p) for p in paths))
    return 0
