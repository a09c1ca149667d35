"""Finding and comparing run directories: `multispin runs` (a table of past runs), `multispin report A B`
(side by side), `compare` directories (one run per policy and repeat: the spread per policy, a bar chart).

Everything here reads what a run leaves behind and tolerates partial runs: a run killed before its first
round has a meta.json and nothing else; a crashed one a meta.json saying "running" whose process is gone;
an old one a summary.json with the keys of an earlier release.
"""

from __future__ import annotations

import json
import math
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.runtime.errors import TestbedError
from testbed.runtime.processes import pid_alive

RUN_FILES = ("meta.json", "rounds.jsonl", "summary.json")
_STAMP = re.compile(r"^(\d{4})(\d{2})(\d{2})-(\d{2})(\d{2})(\d{2})")


def is_run_dir(path: Path) -> bool:
    """A directory a run wrote (any of its files is enough: a run can stop before the others exist)."""
    return path.is_dir() and any((path / f).is_file() for f in RUN_FILES)


def child_runs(path: Path) -> list[Path]:
    """The run directories directly inside `path` (a `compare` directory): in the order its compare.json
    lists the policies (the first is the reference), then by name."""
    if not path.is_dir():
        return []
    runs = sorted(p for p in path.iterdir() if is_run_dir(p))
    order = _read_json(path / "compare.json").get("policies")
    if isinstance(order, list):
        rank = {str(pol): k for k, pol in enumerate(order)}
        runs.sort(key=lambda p: min((k for pol, k in rank.items() if p.name == pol or p.name.startswith(f"{pol}-rep")),
                                    default=len(rank)))
    return runs


def is_group_dir(path: Path) -> bool:
    """A `compare` directory: runs of one comparison (its compare.json, or the -compare name of a compare
    that stopped early). A folder of unrelated runs (runs/) is not one: `multispin runs` lists that."""
    if is_run_dir(path) or not child_runs(path):
        return False
    return (path / "compare.json").is_file() or path.name.endswith("-compare") or "-compare-" in path.name


def plot_title(run_dir: str | Path) -> str:
    """A run's name in plot titles: its folder, after its compare directory's when it is in one."""
    run_dir = Path(run_dir).resolve()
    return f"{run_dir.parent.name}/{run_dir.name}" if is_group_dir(run_dir.parent) else run_dir.name


def expand_run_dirs(paths: list[str | Path]) -> list[Path]:
    """Run directories named on the command line; a `compare` directory stands for the runs inside it."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if is_run_dir(p):
            out.append(p)
        elif is_group_dir(p):
            out += child_runs(p)
        elif child_runs(p):
            raise TestbedError(f"{p}: a folder of {len(child_runs(p))} runs, not one comparison: list them with "
                               f"`multispin runs {p}`, or name the runs to set side by side")
        elif not p.exists():
            raise TestbedError(f"{p}: no such directory")
        else:
            raise TestbedError(f"{p}: not a run directory (no {', '.join(RUN_FILES)}) and no runs inside it")
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def goodput_of(summary: dict) -> tuple[float | None, float | None]:
    """(measured, predicted) run goodput in tokens/s, from this release's summary or an earlier one's."""
    g = summary.get("goodput_run_tps")
    if isinstance(g, dict):
        return g.get("measured"), g.get("predicted")
    return summary.get("goodput_measured_tps"), summary.get("goodput_predicted_tps")


def _alive(meta: dict) -> bool | None:
    """Whether the process that wrote a "running" meta.json still exists (None: cannot tell from here)."""
    pid, host = meta.get("pid"), meta.get("host")
    if not isinstance(pid, int) or (host and host != socket.gethostname()):
        return None
    return pid_alive(pid)


    return True


@dataclass
class RunInfo:
    """What `runs` and `report A B` show of one run directory."""

    path: Path
    label: str                       # the folder name; for a run in a compare directory: "<compare>/<run>"
    stamp: str | None = None         # UTC start, "YYYY-MM-DD HH:MM:SS"
    profile: str | None = None
    policy: str | None = None
    channel: str | None = None       # the channel mode: real, virtual or passthrough (times differ in meaning)
    seed: int | None = None
    status: str = "unknown"
    reason: str | None = None
    rounds: int = 0                  # recorded rounds
    rounds_planned: int | None = None
    measured_tps: float | None = None
    predicted_tps: float | None = None
    overrides: list = field(default_factory=list)  # the flags that changed the profile (meta.json `overrides`)
    tags: list = field(default_factory=list)        # --tag
    note: str | None = None                         # --note
    rerun_of: str | None = None                     # `multispin rerun`: the run it repeats
    fallback_rounds: int = 0                        # rounds planned by a fallback (status degraded)
    fallbacks: dict = field(default_factory=dict)   # ... per kind (summary.json `fallbacks.by_kind`)
    summary: dict = field(default_factory=dict, repr=False)
    settings: dict = field(default_factory=dict, repr=False)  # the resolved profile, flattened (`flat_settings`)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        d.pop("summary")
        d.pop("settings")
        return d


def run_info(path: str | Path, label: str | None = None, fresh: bool = False) -> RunInfo:
    """One run's facts from meta.json and summary.json; without a summary (a run still going, or killed),
    or with `fresh`, the summary is computed from rounds.jsonl. The start stamp is the run's own (meta.json's
    created_utc; without it the run folder's name, then, for a run inside a compare directory, that
    directory's)."""
    path = Path(path)
    meta, summary = _read_json(path / "meta.json"), _read_json(path / "summary.json")
    prof = meta.get("profile") if isinstance(meta.get("profile"), dict) else {}
    if fresh or not summary.get("rounds"):
        records = []
        if (path / "rounds.jsonl").is_file():
            from testbed.runtime.records import iter_rounds

            records = list(iter_rounds(path))
        if records:
            from testbed.analysis import report

            try:
                summary = {**summary, **report.summarize(records)}
            except (KeyError, TypeError, ValueError, ZeroDivisionError):  # records of another release
                summary = {**summary, "rounds": len(records)}
    stamp = _utc_stamp(meta.get("created_utc"))
    if stamp is None:
        m = _STAMP.match(path.name) or _STAMP.match(path.parent.name)
        stamp = f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}:{m[6]}" if m else None
    status = meta.get("status") or summary.get("status") or ("empty" if not summary.get("rounds") else "unknown")
    if status == "running" and _alive(meta) is False:
        status = "died"  # meta.json still says running, but its process is gone (killed -9, power cut)
    measured, predicted = goodput_of(summary)
    policy = summary.get("policy") or prof.get("policy")
    channel = (prof["channel"].get("mode") if isinstance(prof.get("channel"), dict) else None) \
        or summary.get("channel_mode")
    settings = flat_settings(prof)
    settings.setdefault("policy", policy)  # a run of an earlier release, or a meta.json without its profile
    settings.setdefault("channel.mode", channel)
    tags = meta.get("tags")
    fb = summary.get("fallbacks") if isinstance(summary.get("fallbacks"), dict) else {}
    return RunInfo(fallback_rounds=int(fb.get("rounds") or 0), fallbacks=dict(fb.get("by_kind") or {}),
                   path=path, label=label or path.name, stamp=stamp, profile=prof.get("name"),
                   policy=policy, channel=channel, seed=prof.get("seed", meta.get("seed")), status=status,
                   reason=meta.get("reason") or summary.get("reason"), rounds=int(summary.get("rounds") or 0),
                   rounds_planned=prof.get("rounds"), measured_tps=measured, predicted_tps=predicted,
                   overrides=[str(o) for o in meta.get("overrides") or []],
                   tags=[str(t) for t in tags] if isinstance(tags, list) else [],
                   note=meta.get("note"), rerun_of=meta.get("rerun_of"), summary=summary, settings=settings)


def flat_settings(profile: dict, prefix: str = "") -> dict[str, Any]:
    """A resolved profile as {dotted key: value}: mappings by key, a list of named entries (scenario.devices)
    by name (scenario.devices.dev0.distance_m), other lists as one value."""
    out: dict[str, Any] = {}
    for k, v in (profile or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_settings(v, key + "."))
        elif (isinstance(v, list) and v and all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in v)
              and len({x["name"] for x in v}) == len(v)):
            for x in v:
                out.update(flat_settings({kk: vv for kk, vv in x.items() if kk != "name"}, f"{key}.{x['name']}."))
            out[f"{key}.names"] = [x["name"] for x in v]
        else:
            out[key] = v
    return out


# Settings that do not separate runs: repeats differ in seed, and the profile's name is only a label.
POOLED_ACROSS = ("seed", "name")
_ABSENT = object()


def differing_settings(infos: list[RunInfo]) -> list[str]:
    """The settings (dotted keys) whose value is not the same in every run, the policy first, then in profile
    order; a key one run lacks differs."""
    keys = list(dict.fromkeys(["policy", *(k for i in infos for k in i.settings)]))
    return [k for k in keys if len({_key_text(i.settings.get(k, _ABSENT)) for i in infos}) > 1]


def _key_text(value) -> str:
    return "\0absent" if value is _ABSENT else json.dumps(value, sort_keys=True, default=str)


def settings_key(info: RunInfo, keys: list[str]) -> str:
    """What pools runs: their values of `keys` but those in POOLED_ACROSS."""
    return "|".join(_key_text(info.settings.get(k, _ABSENT)) for k in keys if k not in POOLED_ACROSS)


def _shown(value) -> str:
    if value is _ABSENT:
        return "(absent)"
    if value is None:
        return "null"
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


def _utc_stamp(created: Any) -> str | None:
    """meta.json's created_utc (ISO 8601) as "YYYY-MM-DD HH:MM:SS" in UTC; None when absent or unreadable."""
    from datetime import datetime, timezone

    if not isinstance(created, str) or not created:
        return None
    try:
        t = datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is not None:
        t = t.astimezone(timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def find_runs(root: str | Path) -> list[RunInfo]:
    """Every run under `root`: its run directories, and the runs inside each compare directory, each with its
    own start stamp, oldest first (runs whose start is unknown first; equal stamps keep the folder order and,
    in a compare directory, the order of its policies)."""
    root = Path(root)
    if not root.is_dir():
        raise TestbedError(f"{root}: no such directory (runs are written to runs/ by default; "
                           f"multispin runs DIR lists another folder)")
    if is_run_dir(root):
        return [run_info(root)]
    out = []
    for p in sorted(root.iterdir()):
        if is_run_dir(p):
            out.append(run_info(p))
        else:
            out += [run_info(c, label=f"{p.name}/{c.name}") for c in child_runs(p)]
    out.sort(key=lambda i: (i.stamp is not None, i.stamp or ""))  # stable: ties keep the order above
    return out


def _num(value, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_runs_table(infos: list[RunInfo]) -> str:
    """The `multispin runs` table: one line per run, units in the header, reasons of unfinished runs below."""
    if not infos:
        return "no runs"
    head = (f"{'started (UTC)':<20}{'profile':<14}{'policy':<20}{'channel':<12}{'status':<15}{'rounds':>9}"
            f"{'measured':>10}{'predicted':>11}{'meas/pred':>10}{'seed':>7}  {'tags':<16}run")
    units = (f"{'':<20}{'':<14}{'':<20}{'':<12}{'(fallbacks)':<15}{'done/plan':>9}{'[tok/s]':>10}"
             f"{'[tok/s]':>11}{'':>10}{'':>7}  {'':<16}")
    lines = [head, units.rstrip()]
    notes = []
    for i in infos:
        ratio = i.measured_tps / i.predicted_tps if i.measured_tps and i.predicted_tps else None
        rounds = f"{i.rounds}/{i.rounds_planned if i.rounds_planned is not None else '?'}"
        tags = ",".join(i.tags) or "-"
        tags = tags if len(tags) <= 15 else tags[:12] + "..."
        lines.append(f"{i.stamp or '-':<20}{(i.profile or '-')[:13]:<14}{(i.policy or '-')[:19]:<20}"
                     f"{(i.channel or '-')[:11]:<12}{_status(i)[:14]:<15}{rounds:>9}{_num(i.measured_tps, '.2f'):>10}"
                     f"{_num(i.predicted_tps, '.2f'):>11}{_num(ratio, '.3f'):>10}{_num(i.seed, 'd'):>7}  {tags:<16}"
                     f"{i.path}")
        more = ([f"overrides: {' '.join(i.overrides)}"] if i.overrides else []) \
            + ([f"tags: {', '.join(i.tags)}"] if len(tags) < len(",".join(i.tags)) else []) \
            + ([f"rerun of {i.rerun_of}"] if i.rerun_of else []) + ([f"note: {i.note}"] if i.note else [])
        if more:
            lines.append("    " + "; ".join(more))
        if i.status not in ("complete", "running") and (i.reason or i.status == "died"):
            notes.append(f"  {i.label}: {i.status}: {i.reason or 'its process is gone (meta.json says running)'}")
        elif i.fallback_rounds and i.status != "degraded":  # a run still going, or of an earlier release
            notes.append(f"  {i.label}: {i.fallback_rounds} rounds fell back ({_kinds(i.fallbacks)})")
    lines.append("goodput: all tokens / all round time (goodput_run_tps); status: complete, degraded (complete, "
                 "rounds fell back), running, incomplete, interrupted, failed, died (process gone), empty (no "
                 "rounds); indented: the run's overrides (--set and flags), rerun_of and note")
    if notes:
        lines += ["not complete, or degraded:"] + notes
    return "\n".join(lines)


def _status(i: RunInfo) -> str:
    """The status column: the status, and the rounds that fell back when there are any (`degraded (5)`)."""
    return f"{i.status} ({i.fallback_rounds})" if i.fallback_rounds else i.status


def _kinds(by_kind: dict) -> str:
    return ", ".join(f"{k} {n}" for k, n in by_kind.items()) or "-"


# -- side by side ---------------------------------------------------------------------------------------

def _device_totals(summary: dict) -> dict:
    devs = summary.get("devices") or {}
    rounds = sum(d.get("rounds", 0) for d in devs.values())
    ul = sum(d.get("ul_rounds", 0) for d in devs.values())
    missed = sum(d.get("missed", 0) for d in devs.values())
    lens = [(d.get("mean_draft_len"), d.get("rounds", 0) - d.get("missed", 0)) for d in devs.values()]
    weight = sum(n for m, n in lens if m is not None)
    return {"device_rounds": rounds, "ul_share": ul / rounds if rounds else None, "missed": missed,
            "mean_draft_len": sum(m * n for m, n in lens if m is not None) / weight if weight else None}


def _labels(infos: list[RunInfo]) -> list[str]:
    names = [i.path.name for i in infos]
    if len(set(names)) == len(names):
        return names
    return [f"{chr(65 + k % 26)}:{n}" for k, n in enumerate(names)]  # same folder names in different places


def side_by_side(infos: list[RunInfo]) -> str:
    """Runs as columns, measured and predicted numbers as rows (units in the row names)."""
    labels = _labels(infos)
    width = max(12, *(len(x) + 2 for x in labels))
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, values) -> None:
        rows.append((name, [str(v) for v in values]))

    sums = [i.summary for i in infos]
    tot = [_device_totals(s) for s in sums]
    gp = [goodput_of(s) for s in sums]
    row("profile", [i.profile or "-" for i in infos])
    row("policy", [i.policy or "-" for i in infos])
    row("status", [i.status for i in infos])
    row("fallback rounds", [f"{i.fallback_rounds} ({_kinds(i.fallbacks)})" if i.fallback_rounds else "0"
                            for i in infos])
    row("seed", [_num(i.seed, "d") for i in infos])
    row("channel / time base", [f"{s.get('channel_mode') or '-'} / {s.get('time_base') or '-'}" for s in sums])
    row("rounds (done/planned)", [f"{i.rounds}/{i.rounds_planned if i.rounds_planned is not None else '?'}"
                                  for i in infos])
    row("tokens", [_num(s.get("tokens"), "d") for s in sums])
    row("time [s]", [_num(s.get("time_s"), ".2f") for s in sums])
    row("goodput measured [tok/s]", [_num(m, ".2f") for m, _ in gp])
    row("goodput predicted [tok/s]", [_num(p, ".2f") for _, p in gp])
    row("measured / predicted", [_num(m / p if m and p else None, ".3f") for m, p in gp])
    # What the prediction rests on (summary.json `prediction_basis`; "-": a summary of an earlier release).
    row("prediction basis: rates", [(s.get("prediction_basis") or {}).get("rates") or "-" for s in sums])
    if any(s.get("expected_goodput_tps") is not None for s in sums):  # a fading channel's expected goodput
        row("expected goodput [tok/s]", [
            "-" if s.get("expected_goodput_tps") is None else f"{s['expected_goodput_tps']:.2f}"
            + (f" +- {e:.2f}" if (e := (s.get("expected_goodput") or {}).get("stderr_tps")) is not None else "")
            for s in sums])
    mean = [s.get("goodput_mean_round_tps") or {} for s in sums]
    row("per-round mean meas. [tok/s]", [_num(m.get("measured"), ".2f") for m in mean])
    row("UL-mode device-rounds [%]", [_num(t["ul_share"] * 100 if t["ul_share"] is not None else None, ".1f")
                                      for t in tot])
    row("mean draft length [tok]", [_num(t["mean_draft_len"], ".2f") for t in tot])
    row("missed device-rounds", [_num(t["missed"], "d") for t in tot])
    phases = list(dict.fromkeys(k for s in sums for k in (s.get("phase_errors") or {})))
    for phase in phases:
        stats = [(s.get("phase_errors") or {}).get(phase) or {} for s in sums]
        row(f"{phase} med |err| [%]", [_num(st.get("median_abs_error") * 100 if st.get("median_abs_error")
                                            is not None else None, ".1f") for st in stats])
    name_w = max(len(n) for n, _ in rows) + 2
    lines = [f"{'':<{name_w}}" + "".join(f"{x:>{width}}" for x in labels)]
    lines += [f"{n:<{name_w}}" + "".join(f"{v:>{width}}" for v in vals) for n, vals in rows]
    parents = {i.path.parent for i in infos}
    if len(parents) == 1 and labels == [i.path.name for i in infos]:
        lines.append(f"runs in {parents.pop()}")
    else:
        lines.append("runs: " + "; ".join(f"{lab} = {i.path}" for lab, i in zip(labels, infos)))
    lines.append("med |err|: median over samples of |measured - predicted| / predicted per phase (multispin report "
                 "RUN for the whole table)")
    return "\n".join(lines)


def format_settings_diff(infos: list[RunInfo]) -> str:
    """The settings that differ between the runs (from their resolved profiles), runs as columns as in
    `side_by_side`, and the group each run is pooled in (`aggregate`: equal settings but for the seed and
    the profile's name)."""
    keys = differing_settings(infos)
    if not keys:
        return "settings: the same in every run (their resolved profiles are equal)"
    labels = _labels(infos)
    groups: dict[str, int] = {}
    member = [groups.setdefault(settings_key(i, keys), len(groups) + 1) for i in infos]
    cells = [[_shown(i.settings.get(k, _ABSENT)) for i in infos] for k in keys]
    width = max(12, *(len(x) + 2 for x in labels), *(min(len(c), 28) + 2 for row in cells for c in row))
    name_w = max(len("group"), *(len(k) for k in keys)) + 2

    def fit(text: str) -> str:
        return text if len(text) <= width - 2 else text[:width - 5] + "..."

    lines = [f"settings that differ ({len(keys)}; from each run's resolved profile):",
             f"{'':<{name_w}}" + "".join(f"{x:>{width}}" for x in labels)]
    lines += [f"{k:<{name_w}}" + "".join(f"{fit(c):>{width}}" for c in row) for k, row in zip(keys, cells)]
    lines.append(f"{'group':<{name_w}}" + "".join(f"{g:>{width}}" for g in member))
    lines.append(f"runs in one group are pooled below (equal settings but for {' and '.join(POOLED_ACROSS)}); "
                 f"{len(groups)} group(s)")
    return "\n".join(lines)


# -- per policy: the spread over repeats --------------------------------------------------------------------

def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return mean, std


def aggregate(infos: list[RunInfo]) -> list[dict]:
    """Per group of runs with the same settings (their resolved profiles equal but for the seed and the
    profile's name: the repeats of one policy), in first-seen order: runs, measured and predicted goodput as
    mean and sample std (None for one run), and the runs' own values (for the plot's points). Runs whose
    settings differ in anything else (the channel mode: times in different meanings; any --set) are rows of
    their own, never one mean; `label` is the policy, with what else sets the row apart in brackets (the
    channel mode alone as its value, other keys as key=value); `settings`: those values."""
    keys = differing_settings(infos)
    by: dict[str, list[RunInfo]] = {}
    for i in infos:
        by.setdefault(settings_key(i, keys), []).append(i)
    apart = [k for k in keys if k not in POOLED_ACROSS and k != "policy"]
    out = []
    for runs in by.values():
        policy, mode = runs[0].policy or "?", runs[0].channel
        values = {k: runs[0].settings.get(k, _ABSENT) for k in apart}
        extra = ", ".join(_shown(v) if k == "channel.mode" else f"{k}={_shown(v)}" for k, v in values.items())
        m_mean, m_std = _mean_std([r.measured_tps for r in runs])
        p_mean, p_std = _mean_std([r.predicted_tps for r in runs])
        out.append({"policy": policy, "channel": mode, "label": f"{policy} [{extra}]" if extra else policy,
                    "settings": {k: (None if v is _ABSENT else v) for k, v in values.items()},
                    "runs": len(runs), "complete": sum(r.status == "complete" for r in runs),
                    "degraded": sum(r.status == "degraded" for r in runs),
                    "fallback_rounds": sum(r.fallback_rounds for r in runs),
                    "rounds": sum(r.rounds for r in runs),
                    "measured_mean_tps": m_mean, "measured_std_tps": m_std,
                    "predicted_mean_tps": p_mean, "predicted_std_tps": p_std,
                    "measured_tps": [r.measured_tps for r in runs], "predicted_tps": [r.predicted_tps for r in runs],
                    "dirs": [str(r.path) for r in runs]})
    return out


def _pm(mean, std) -> str:
    return "-" if mean is None else f"{mean:.2f} ± {std:.2f}" if std is not None else f"{mean:.2f}"


def _label(row: dict) -> str:
    return row.get("label") or row["policy"]  # rows of an earlier compare.json have no label


def format_aggregate(rows: list[dict], reference: str | None = None) -> str:
    """Per policy (and channel mode, when the runs mix modes): measured and predicted goodput, mean ± sample
    std over the runs, and the ratio to the reference policy's measured mean (its first row)."""
    ref = next((r for r in rows if r["policy"] == reference), rows[0] if rows else None)
    ref_m = ref["measured_mean_tps"] if ref else None
    width = max([20] + [len(_label(r)) + 2 for r in rows])
    vs = "vs " + (_label(ref) if ref else "-")
    vs_w = max(16, len(vs) + 2)
    lines = [f"{'policy':<{width}}{'runs':>5}{'rounds':>8}{'measured [tok/s]':>20}{'predicted [tok/s]':>20}"
             f"{'meas/pred':>10}{vs:>{vs_w}}"]
    for r in rows:
        m, p = r["measured_mean_tps"], r["predicted_mean_tps"]
        lines.append(f"{_label(r):<{width}}{r['runs']:>5}{r['rounds']:>8}{_pm(m, r['measured_std_tps']):>20}"
                     f"{_pm(p, r['predicted_std_tps']):>20}{_num(m / p if m and p else None, '.3f'):>10}"
                     f"{_num(m / ref_m if m and ref_m else None, '.3f'):>{vs_w}}")
    n = max((r["runs"] for r in rows), default=1)
    lines.append("goodput_run_tps per run (all tokens / all round time); "
                 + ("mean ± sample standard deviation over the runs of a policy" if n > 1 else "one run per policy "
                    "(--repeats R for the spread)"))
    modes = list(dict.fromkeys(r.get("channel") for r in rows))
    if len(modes) > 1:
        per_mode = "; ".join(f"{mode or 'unknown'}: " + ", ".join(Path(d).name for r in rows if r.get("channel") == mode
                                                                 for d in r["dirs"]) for mode in modes)
        lines.append(f"warning: the runs mix channel modes ({per_mode}); each policy is shown per mode "
                     f"[in brackets], not averaged across modes")
    return "\n".join(lines)


def plot_compare(rows: list[dict], out_dir: str | Path, title: str | None = None) -> list[Path]:
    """compare_goodput: measured (filled) and predicted (hatched) goodput per policy as bars centred on the
    policy's tick, in the policy's colour of every figure (mean), error bars (± one sample std, with two or
    more runs, their count in the legend) and each run as a point; in the style and formats in force, with a
    caption."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib.patches import Patch

    from testbed.analysis import style

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with style.rc():
        st = style.current()
        width = max(st.width_in, (0.5 if st.name == "paper" else 1.5) * len(rows) + 1.5)
        fig, ax = style.figure(height=width * 0.62 if st.name == "paper" else 4.2)
        fig.set_size_inches(width, fig.get_size_inches()[1])
        x = np.arange(len(rows))
        offsets, w = style.bar_offsets(2, 0.76)
        colors = [style.policy_color(r["policy"]) for r in rows]
        for k, what in enumerate(("measured", "predicted")):
            means = [r[f"{what}_mean_tps"] or 0.0 for r in rows]
            stds = [r[f"{what}_std_tps"] or 0.0 for r in rows]
            pos = x + offsets[k]
            ax.bar(pos, means, w, yerr=stds if any(stds) else None, capsize=3, color=colors if k == 0 else "white",
                   edgecolor=colors, hatch=None if k == 0 else "////", lw=1.0, label=what,
                   error_kw={"elinewidth": 1.0})
            for p, r in zip(pos, rows):
                pts = [v for v in r[f"{what}_tps"] if v is not None]
                if len(pts) > 1:  # the runs themselves, spread a little so that equal values stay visible
                    ax.scatter(p + np.linspace(-w / 5, w / 5, len(pts)), pts, s=8, color="k", zorder=3, lw=0)
        ax.set_xticks(x, [f"{_label(r)}\n(n={r['runs']})" for r in rows])
        ax.set_ylabel(style.label("goodput_tps"))
        ax.grid(False, axis="x")
        n = max((r["runs"] for r in rows), default=1)
        spread = style.spread_note(n, "runs", "bars: ± 1 std; dots: the runs")
        style.title(ax, (f"{title}\n" if title else "") + "goodput per policy")
        style.legend(ax, spread, handles=[Patch(facecolor="grey", edgecolor="grey", label="measured"),
                                          Patch(facecolor="white", edgecolor="grey", hatch="////", label="predicted")])
        caption = (f"{title + ': ' if title else ''}goodput per policy (goodput_run_tps: all tokens / all round "
                   f"time), measured (filled) and predicted (hatched); {spread}. Runs per policy: "
                   + ", ".join(f"{_label(r)} {r['runs']}" for r in rows) + ".")
        return style.save(fig, out / "compare_goodput", caption)
