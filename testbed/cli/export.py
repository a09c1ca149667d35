"""`multispin export PATH... --to mlflow|tensorboard --out TARGET`: runs, compare directories and campaigns
into an MLflow store (a local folder, no server) or TensorBoard event files (`testbed.analysis.tracking`)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="export runs and campaigns to MLflow (local store) or TensorBoard event files",
        description="Each run (of a run folder, a compare directory, a campaign folder, or a folder of runs) "
                    "becomes an MLflow run or a TensorBoard event folder: its settings, tags, note and status, its "
                    "run-level goodput and energy, and per round the measured and predicted goodput and phase "
                    "times. Needs the mlflow or tensorboard extra.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="run, compare or campaign folders, or a folder of runs")
    p.add_argument("--to", required=True, choices=["mlflow", "tensorboard"], help="the tracker")
    p.add_argument("--out", required=True, metavar="TARGET",
                   help="mlflow: a folder (a local file store) or a tracking URI (e.g. sqlite:///mlflow.db); "
                        "tensorboard: the log folder (tensorboard --logdir TARGET)")
    p.add_argument("--experiment", default="multispin", help="mlflow: the experiment's name (default multispin)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from testbed.analysis import tracking

    groups = tracking.collect(args.paths)
    n = sum(len(g.runs) for g in groups)
    if args.to == "mlflow":
        counts = tracking.to_mlflow(groups, args.out, experiment=args.experiment)
        print(f"mlflow {tracking.mlflow_uri(args.out)}, experiment {args.experiment}: {counts['exported']} run(s) "
              f"exported, {counts['skipped']} there already (of {n})")
        if tracking.mlflow_uri(args.out).startswith("file:"):
            print(f"  view: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {args.out}")
    else:
        folders = tracking.to_tensorboard(groups, args.out)
        print(f"tensorboard {args.out}: {len(folders)} run(s) written; view: tensorboard --logdir {args.out}")
    return 0
