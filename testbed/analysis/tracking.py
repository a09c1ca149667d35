"""Runs and campaigns exported to the trackers researchers use: MLflow (a local store, no server) and
TensorBoard event files. Both are optional extras (`mlflow`, `tensorboard`); the core never imports them.

What goes out, per run: its settings as parameters (policy, seed, channel mode, rounds, devices, the profile's
name, a campaign run's point), its tags and note, its status, its run-level metrics (measured and predicted
goodput, tokens, time, tokens per joule), and per round (step = round) the measured and predicted goodput,
round time, uplink phase and verification time. A campaign is a parent run (MLflow) or a folder (TensorBoard)
holding its runs; its results.csv and summary.txt go with it as artifacts (MLflow).

Exporting again is safe: an MLflow run whose `multispin.run_dir` tag names the same folder is left as it is
(a campaign's new runs join its parent run); a run's TensorBoard event file replaces the one of an earlier export.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from testbed.runtime.errors import TestbedError

MLFLOW_INSTALL = "pip install multispin-testbed[mlflow]"
TENSORBOARD_INSTALL = "pip install multispin-testbed[tensorboard]"
# Per round: (metric name, record section, field).
ROUND_METRICS = tuple((f"{side}_{name}", side, name) for name in ("goodput_tps", "round_s", "uplink_phase_s",
                                                                  "verify_s") for side in ("measured", "predicted"))


class TrackingError(TestbedError):
    """An export that cannot be made: a missing extra, a folder without runs."""


@dataclass
class Exported:
    """One testbed run as a tracker sees it."""

    run_dir: Path
    name: str                   # e.g. "devices=2/proposed" inside a campaign, the folder name alone
    params: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)   # run-level
    rounds: list = field(default_factory=list)    # one {metric: value} per round, step = its index


@dataclass
class Group:
    """What one path named on the command line stands for: a campaign, a compare directory, or runs."""

    path: Path
    kind: str                    # campaign, compare, runs, run
    runs: list[Exported]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shown(v) -> str:
    return format(v, "g") if isinstance(v, float) else json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def exported_run(run_dir: Path, name: str) -> Exported:
    """A run folder read for export (meta.json, summary.json, rounds.jsonl; a run cut short keeps what it has)."""
    from testbed.analysis.runs_index import run_info
    from testbed.runtime.records import iter_rounds

    info = run_info(run_dir)
    meta = _json(run_dir / "meta.json")
    prof = meta.get("profile") if isinstance(meta.get("profile"), dict) else {}
    devices = ((prof.get("scenario") or {}).get("devices")) or []
    params = {"policy": info.policy, "seed": info.seed, "channel_mode": info.channel, "profile": info.profile,
              "rounds": prof.get("rounds"), "devices": len(devices) or None}
    sweep = meta.get("sweep") if isinstance(meta.get("sweep"), dict) else {}
    point = sweep.get("point") or ({sweep["key"]: sweep.get("value")} if "key" in sweep else {})
    params.update({f"sweep.{k}": v for k, v in point.items()})
    if info.overrides:
        params["overrides"] = " ".join(str(o) for o in info.overrides)
    tags = {"multispin.run_dir": str(run_dir.resolve()), "multispin.status": info.status,
            "multispin.tags": ";".join(info.tags), **{f"multispin.tag.{t}": "1" for t in info.tags}}
    if info.note:
        tags["mlflow.note.content"] = info.note  # MLflow shows it as the run's description
    if meta.get("command"):
        tags["multispin.command"] = str(meta["command"])
    s = info.summary
    run_e = ((s.get("energy") or {}).get("run")) or {}
    metrics = {"measured_goodput_tps": info.measured_tps, "predicted_goodput_tps": info.predicted_tps,
               "tokens": s.get("tokens"), "time_s": s.get("time_s"), "rounds": info.rounds,
               "measured_tokens_per_j": run_e.get("tokens_per_j"),
               "predicted_tokens_per_j": run_e.get("predicted_tokens_per_j")}
    rounds = []
    if (run_dir / "rounds.jsonl").is_file():
        for rec in iter_rounds(run_dir):
            rounds.append({m: (rec.get(side) or {}).get(f) for m, side, f in ROUND_METRICS})
    return Exported(run_dir, name, {k: _shown(v) for k, v in params.items() if v is not None}, tags,
                    {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, rounds)


def collect(paths: list[str | Path]) -> list[Group]:
    """The runs behind each path: a campaign folder (campaign.json: its runs, point by point), a compare
    directory, a run, or a folder of runs (`multispin runs DIR`)."""
    from testbed.analysis.runs_index import child_runs, find_runs, is_group_dir, is_run_dir

    groups = []
    for raw in paths:
        p = Path(raw)
        if (p / "campaign.json").is_file():
            dirs = sorted(d for point in p.iterdir() if point.is_dir() for d in child_runs(point))
            groups.append(Group(p, "campaign", [exported_run(d, f"{d.parent.name}/{d.name}") for d in dirs]))
        elif is_run_dir(p):
            groups.append(Group(p, "run", [exported_run(p, p.name)]))
        elif is_group_dir(p):
            groups.append(Group(p, "compare", [exported_run(d, d.name) for d in child_runs(p)]))
        elif p.is_dir() and find_runs(p):
            groups.append(Group(p, "runs", [exported_run(i.path, i.label) for i in find_runs(p)]))
        else:
            raise TrackingError(f"{p}: not a run, compare or campaign folder, and no runs inside it")
    return groups


# -- MLflow -------------------------------------------------------------------------------------------------

def mlflow_uri(target: str | Path) -> str:
    """A tracking URI from a folder (a local file store) or a URI given as it is (sqlite:///x.db, file:...)."""
    text = str(target)
    if "://" in text or text.startswith("file:"):
        return text
    return Path(text).resolve().as_uri()


def mlflow_client(uri: str):
    """An MlflowClient on `uri`. MLflow 3 keeps its file store in maintenance mode behind an opt-in: a folder
    given here is such a store, so the opt-in is set for this process (readers set it too, docs/campaigns.md)."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise TrackingError(f"--to mlflow needs MLflow, which is not installed: {MLFLOW_INSTALL}") from None
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def to_mlflow(groups: list[Group], target: str | Path, experiment: str = "multispin") -> dict:
    """Every run of `groups` as an MLflow run in `experiment` (made when missing); a campaign's or compare
    directory's runs nested under a parent run named after its folder. Returns counts: exported, skipped."""
    client = mlflow_client(mlflow_uri(target))
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    done = {r.data.tags.get("multispin.run_dir") for r in client.search_runs([exp_id], max_results=50000)}
    counts = {"exported": 0, "skipped": 0}
    for g in groups:
        parent = None
        if g.kind in ("campaign", "compare"):
            key = str(g.path.resolve())
            parent = _find_parent(client, exp_id, key) or _parent_run(client, exp_id, g, key)
        for r in g.runs:
            if str(r.run_dir.resolve()) in done:
                counts["skipped"] += 1
                continue
            _mlflow_run(client, exp_id, r, parent)
            counts["exported"] += 1
    return counts


def _find_parent(client, exp_id: str, key: str) -> str | None:
    found = client.search_runs([exp_id], filter_string=f"tags.`multispin.group_dir` = '{key}'", max_results=1)
    return found[0].info.run_id if found else None


def _parent_run(client, exp_id: str, g: Group, key: str) -> str:
    spec = _json(g.path / "campaign.json")
    tags = {"multispin.group_dir": key, "multispin.kind": g.kind}
    run = client.create_run(exp_id, run_name=g.path.name, tags=tags)
    rid = run.info.run_id
    sweep = spec.get("sweep")
    for item in (sweep if isinstance(sweep, list) else [sweep] if sweep else []):
        client.log_param(rid, f"sweep.{item['key']}", ",".join(_shown(v) for v in item["values"])[:500])
    for k in ("policies", "repeats"):
        if k in spec:
            client.log_param(rid, k, _shown(spec[k]))
    for name in ("campaign.json", "results.csv", "summary.txt", "compare.json", "compare.txt"):
        if (g.path / name).is_file():
            client.log_artifact(rid, str(g.path / name))
    client.set_terminated(rid)
    return rid


def _mlflow_run(client, exp_id: str, r: Exported, parent: str | None) -> None:
    from mlflow.entities import Metric, Param, RunTag

    tags = {**r.tags, **({"mlflow.parentRunId": parent} if parent else {})}
    run = client.create_run(exp_id, run_name=r.name, tags=tags)
    rid = run.info.run_id
    stamp = int(run.info.start_time)
    metrics = [Metric(k, v, stamp, 0) for k, v in r.metrics.items()]
    for step, values in enumerate(r.rounds):
        metrics += [Metric(f"round/{k}", float(v), stamp, step) for k, v in values.items()
                    if isinstance(v, (int, float))]
    params = [Param(k, str(v)[:6000]) for k, v in r.params.items()]
    for i in range(0, max(len(metrics), 1), 1000):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(rid, metrics=metrics[i:i + 1000], params=params if i == 0 else [],
                         tags=[RunTag("multispin.name", r.name)] if i == 0 else [])
    for name in ("meta.json", "summary.json"):
        if (r.run_dir / name).is_file():
            client.log_artifact(rid, str(r.run_dir / name))
    status = "FINISHED" if r.tags.get("multispin.status") in ("complete", "degraded") else "FAILED"
    client.set_terminated(rid, status=status)


# -- TensorBoard --------------------------------------------------------------------------------------------

def to_tensorboard(groups: list[Group], out: str | Path) -> list[Path]:
    """One event folder per run under `out` (`<group>/<run name>`), its per-round metrics as scalars
    (`round/<metric>`, step = round), its run-level metrics at step 0 (`run/<metric>`), and its settings,
    tags and note as text. Returns the event folders."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise TrackingError(f"--to tensorboard needs tensorboardX, which is not installed: "
                            f"{TENSORBOARD_INSTALL}") from None
    out = Path(out)
    folders = []
    for g in groups:
        for r in g.runs:
            folder = out / g.path.resolve().name / r.name if g.kind != "run" else out / r.name
            for old in folder.glob("events.out.tfevents.*"):  # an earlier export of this run: replaced, not doubled
                old.unlink()
            writer = SummaryWriter(logdir=str(folder))
            try:
                for step, values in enumerate(r.rounds):
                    for k, v in values.items():
                        if isinstance(v, (int, float)):
                            writer.add_scalar(f"round/{k}", float(v), step)
                for k, v in r.metrics.items():
                    writer.add_scalar(f"run/{k}", v, 0)
                lines = [f"{k}: {v}" for k, v in {**r.params, **r.tags}.items()]
                writer.add_text("settings", "  \n".join(lines), 0)
            finally:
                writer.close()
            folders.append(folder)
    return folders


def read_scalars(folder: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the event files in `folder`, read from their TFRecord framing (for
    checking an export without TensorBoard itself)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4  # length, its CRC, the record, its CRC
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
