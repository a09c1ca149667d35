"""`multispin runs [DIR]`: the past runs in a folder (default runs/), one line each; and the parts of
`multispin report` that take several runs or export one (`report A B`, a compare directory, --csv, --parquet).
"""

from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("runs", help="list past runs (status, rounds, measured and predicted goodput)",
                              description="One line per run directory under DIR (and per run inside each "
                                          "compare directory), oldest first, from meta.json and summary.json; "
                                          "runs that stopped early are listed with their reason.")
    p.add_argument("dir", nargs="?", default="runs", help="folder of run directories (default: runs)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.add_argument("--last", type=int, default=None, metavar="N", help="only the N most recent runs")
    p.add_argument("--tag", action="append", default=[], metavar="T",
                   help="only runs tagged T (repeatable: runs with every tag given)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from testbed.analysis.runs_index import find_runs, format_runs_table
    from testbed.cli import CliError
    from testbed.runtime.records import json_text

    if args.last is not None and args.last < 1:
        raise CliError(f"--last {args.last}: must be >= 1")
    infos = find_runs(args.dir)
    if args.tag:
        infos = [i for i in infos if set(args.tag) <= set(i.tags)]
    if args.last:
        infos = infos[-args.last:]
    if args.json:
        print(json_text([i.as_dict() for i in infos], indent=2))
    else:
        print(format_runs_table(infos) if infos else f"no runs in {args.dir}")
    return 0


def add_report_arguments(p) -> None:
    """The options `multispin report` takes for several runs and for the flat export."""
    p.add_argument("more_runs", nargs="*", metavar="RUN_DIR",
                   help="more run directories: side by side (a compare directory stands for its runs)")
    p.add_argument("--csv", nargs="?", const="", default=None, metavar="PATH",
                   help="write one row per device per round as CSV (default PATH: RUN_DIR/rounds.csv; '-': stdout)")
    p.add_argument("--parquet", nargs="?", const="", default=None, metavar="PATH",
                   help="the same table as Parquet (needs pyarrow; default PATH: RUN_DIR/rounds.parquet)")


def wants_many(args) -> bool:
    """Whether `report` should take the path of several runs (or of an export) instead of one run's."""
    from testbed.analysis.runs_index import child_runs, is_run_dir

    one = Path(args.run_dir)
    return bool(getattr(args, "more_runs", None)) or getattr(args, "csv", None) is not None \
        or getattr(args, "parquet", None) is not None or (not is_run_dir(one) and bool(child_runs(one)))


def report_many(args) -> int:
    """`report A B ...` (and a compare directory): side by side, the spread per policy, its bar chart; or,
    with --csv / --parquet, the flat export of the runs."""
    from testbed.analysis.runs_index import (
        aggregate,
        differing_settings,
        expand_run_dirs,
        format_aggregate,
        is_group_dir,
        plot_compare,
        run_info,
    )
    from testbed.runtime.records import json_text

    named = [args.run_dir, *args.more_runs]
    dirs = expand_run_dirs(named)
    if args.csv is not None or args.parquet is not None:
        return _export(args, named, dirs)
    infos = [run_info(d, fresh=True) for d in dirs]
    rows = aggregate(infos)
    if args.json:
        differ = differing_settings(infos)
        print(json_text({"runs": [{**i.as_dict(), "summary": i.summary,
                                   "settings": {k: i.settings.get(k) for k in differ}} for i in infos],
                         "settings_differ": differ, "per_policy": rows}, indent=2))
    else:
        from testbed.analysis.runs_index import format_settings_diff, side_by_side

        print(side_by_side(infos))
        print()
        print(format_settings_diff(infos))
        print()
        print(format_aggregate(rows, reference=infos[0].policy if infos else None))
    group = Path(named[0]) if len(named) == 1 and is_group_dir(Path(named[0])) else None
    if not args.no_plots and group is not None:  # a compare directory: its bar chart beside its runs
        paths = plot_compare(rows, group / "plots", title=group.name)
        if not args.json:
            print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def _export(args, named: list[str], dirs: list[Path]) -> int:
    import sys

    from testbed.analysis.export import device_rows, run_context, write_csv, write_parquet
    from testbed.cli import CliError
    from testbed.runtime.records import load_run

    rows = []
    many = len(dirs) > 1
    for d in dirs:
        meta, records = load_run(d)
        rows += device_rows(records, run=str(d) if many else None, context=run_context(meta, records))
    if not rows:
        raise CliError(f"{', '.join(named)}: no complete round recorded; nothing to export")
    # One folder named (a run, or a compare directory): the file goes into it; several: PATH is needed.
    home = Path(named[0]) if len(named) == 1 else None
    for flag, value, ext, write in (("--csv", args.csv, "csv", write_csv),
                                    ("--parquet", args.parquet, "parquet", write_parquet)):
        if value is None:
            continue
        if value == "" and home is None:
            raise CliError(f"{flag}: give a PATH (or '-') when exporting several runs")
        path = value or str(home / f"rounds.{ext}")
        if value == "-" and ext == "parquet":
            raise CliError("--parquet -: Parquet is binary; give a file PATH")
        n = write(rows, path)
        if path != "-":
            print(f"wrote {path}: {n} rows (one per device per round{', runs in column run' if many else ''})",
                  file=sys.stderr if args.csv == "-" else sys.stdout)
    return 0
