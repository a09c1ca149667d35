"""A live campaign: the testbed run once per sweep point x policy x repeat, into one folder that a second
start resumes (`multispin campaign`).

Layout of a campaign folder:
  campaign.json         what the campaign is: sweep key and values (a grid: one entry per key), policies, repeats,
                        the base profile (after --set and the flags, before the sweep), code version; a restart
                        must match it (`campaign extend` changes it: testbed.run.campaign_grow)
  <key>=<value>/        one compare directory per sweep point (`multispin report` reads it as one); a grid's
                        point: <key1>=<value1>,<key2>=<value2>/
      <policy>[-rep<r>]/  a run directory (testbed.runtime.records); compare.json / compare.txt / plots/
  results.csv           one row per run: the point, policy, repeat, seed, status, measured and predicted
                        goodput, energy, tags; rewritten after every run
  summary.txt           per point: the policies ordered by measured and by predicted goodput
  plots/goodput.png     measured goodput per policy against the swept key, the model's prediction beside it

Several sweeps make a grid (`Grid`: every combination of their values, the first key outermost). Runs go one
after another in this process, or side by side through a `runner` (`testbed.run.campaign_jobs`: worker
processes, Ray); `testbed.run.campaign_grow` reads a campaign back from its folder and grows it.

Every run of a point uses the same seeds per repeat (repeat r: seed + r) whatever the policy, so the prompts,
sampling and channel draws (seeded per device name and round) are the same across policies; `devices=N`
keeps the first devices of a point in the next one. A run whose meta.json says `complete` is never run again;
an interrupted one is resumed in its own directory (`testbed.run.session.load_resume`), and one that cannot be
resumed is started over.
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import logging
import math
import re
import shutil
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from testbed.run.config_override import Override, OverrideError, apply_override, split_key_value, split_values
from testbed.run.profile import Profile, ProfileError, load_profile
from testbed.runtime.errors import TestbedError

log = logging.getLogger("multispin.campaign")

DEVICES = "devices"
# The offline simulator's sweep keys (testbed.core.simulate.SWEEP_KEYS) -> the live profile's field.
ALIASES = {"dl_bandwidth": "scenario.downlink_bandwidth_hz", "dl_power": "scenario.downlink_power_w",
           "ul_bandwidth": "scenario.uplink_bandwidth_hz", "bits_per_prob": "scenario.bits_per_prob",
           "max_draft_len": "scenario.max_draft_len", "vocab_size": "on_air_vocab_size",
           "ul_access": "scenario.ul_access", "uplink_total_bandwidth_hz": "scenario.uplink_total_bandwidth_hz"}
_NAMED = {"ul_access"}  # aliases whose values are names, not numbers
# Keys a campaign sets itself, or that would need another model pair per point.
REFUSED = {"policy": "use --policies", "seed": "use --seed and --repeats", "model": "one model pair per campaign"}
SPEC_FILE, RESULTS_FILE, SUMMARY_FILE = "campaign.json", "results.csv", "summary.txt"
COMPLETE = "complete"
# Finished runs (results.csv rows, not run again): complete, or degraded (complete, rounds fell back).
FINISHED = (COMPLETE, "degraded")
RESULT_FIELDS = ("key", "value", "policy", "repeat", "seed", "status", "fallback_rounds", "fallbacks", "rounds",
                 "tokens", "time_s", "time_base",
                 "measured_goodput_tps", "predicted_goodput_tps", "measured_mean_round_tps",
                 "predicted_mean_round_tps", "ul_share", "measured_energy_j", "predicted_energy_j",
                 "measured_tokens_per_j", "predicted_tokens_per_j", "wall_s", "tags", "run")


class CampaignError(TestbedError):
    """A campaign that cannot start or resume; the message names the flag or file."""


@dataclass(frozen=True)
class Sweep:
    key: str            # as given: devices, an alias, or a dotted profile key
    values: tuple       # YAML-typed, in the order given

    @property
    def path(self) -> str | None:
        """The profile field the values go to (None for `devices`)."""
        return None if self.key == DEVICES else ALIASES.get(self.key, self.key)

    @property
    def sweeps(self) -> tuple[Sweep, ...]:
        return (self,)

    def spec(self) -> dict:
        return {"key": self.key, "values": list(self.values)}


@dataclass(frozen=True)
class Grid:
    """Several sweep keys: every combination of their values is a point (the first key outermost)."""

    sweeps: tuple[Sweep, ...]

    @property
    def key(self) -> str:
        return ",".join(s.key for s in self.sweeps)

    @property
    def values(self) -> tuple[tuple, ...]:
        """The points, each a tuple of one value per key."""
        return tuple(itertools.product(*(s.values for s in self.sweeps)))

    def spec(self) -> list[dict]:
        return [s.spec() for s in self.sweeps]


def parse_sweeps(texts: list[str]) -> Sweep | Grid:
    """One `--sweep` (a Sweep) or several (a Grid over their keys); a key given twice, or two keys that set the
    same profile field, are refused."""
    sweeps = [parse_sweep(t) for t in texts]
    if not sweeps:
        raise CampaignError("--sweep KEY=V1,V2,... is required (e.g. --sweep devices=2,4,8)")
    seen: dict[str, str] = {}
    for s in sweeps:
        field_ = s.path or DEVICES
        if field_ in seen:
            same = "is swept twice" if seen[field_] == s.key else f"sets the same field as --sweep {seen[field_]}"
            raise CampaignError(f"--sweep {s.key}: {same}; give its values in one --sweep")
        seen[field_] = s.key
    return sweeps[0] if len(sweeps) == 1 else Grid(tuple(sweeps))


def sweep_from_spec(spec) -> Sweep | Grid:
    """The sweep of a campaign.json (`{key, values}`, or a list of them for a grid)."""
    items = spec if isinstance(spec, list) else [spec]
    sweeps = tuple(Sweep(str(i["key"]), tuple(i["values"])) for i in items)
    return sweeps[0] if len(sweeps) == 1 else Grid(sweeps)


def sweep_column(key: str) -> str:
    """The results.csv column of a grid's key: the key, unless a result column has that name."""
    return f"sweep.{key}" if key in RESULT_FIELDS else key


def point_of(sweep: Sweep | Grid, value) -> dict:
    """{key: value} of one point (`value`: a Sweep's value, or a Grid's tuple)."""
    return dict(zip((s.key for s in sweep.sweeps), value if isinstance(sweep, Grid) else (value,)))


def parse_sweep(text: str) -> Sweep:
    """`KEY=V1,V2,...`: KEY is `devices`, a simulator key (dl_bandwidth, dl_power, ul_bandwidth, bits_per_prob,
    max_draft_len, vocab_size, ul_access, uplink_total_bandwidth_hz) or any dotted profile key; each value is
    read as YAML (1e6 as a number)."""
    key, rest = split_key_value(text, "--sweep", "KEY=V1,V2,..., e.g. --sweep devices=2,4,8", CampaignError)
    head = key.split(".")[0]
    if head in REFUSED:
        raise CampaignError(f"--sweep {text}: {head} cannot be swept in a campaign ({REFUSED[head]})")
    values = []
    for item in split_values(rest):
        try:
            value = yaml.safe_load(item)
        except yaml.YAMLError:
            raise CampaignError(f"--sweep {text}: value {item!r} is not valid YAML") from None
        values.append(_number(value))
    if not values:
        raise CampaignError(f"--sweep {text}: no values given")
    if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
        raise CampaignError(f"--sweep {text}: a value is listed twice")
    if key == DEVICES or key in ALIASES and key not in _NAMED:
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise CampaignError(f"--sweep {text}: {v!r} is not a number")
        if key == DEVICES and any(not float(v).is_integer() or v < 1 for v in values):
            raise CampaignError(f"--sweep {text}: the number of devices must be an integer >= 1")
        if key == DEVICES:
            values = [int(v) for v in values]
    return Sweep(key, tuple(values))


def _number(value):
    """YAML 1.1 reads 1e6 (no dot) as text; a sweep value that reads as a number is one."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def shown(value) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def point_label(sweep: Sweep | Grid, value) -> str:
    """The folder of a sweep point: `<key>=<value>` with a plain, path-safe value; a grid's point joins its
    keys' with ',' (`devices=2,channel.state.fading=none`)."""
    return ",".join(re.sub(r"[^A-Za-z0-9._+=-]", "_", f"{k}={shown(v)}") for k, v in point_of(sweep, value).items())


def _copy_names(names: list[str], n: int) -> list[str]:
    """Names of n devices from a list of templates: the templates, then copies numbered on (dev0..dev3 ->
    dev4, dev5, ...) when the templates are one prefix + 0..m-1, else `<template>-<copy>`."""
    m = len(names)
    found = [re.fullmatch(r"(.*?)(\d+)", x) for x in names]
    numbered = (all(found) and len({f[1] for f in found}) == 1
                and sorted(int(f[2]) for f in found) == list(range(m)))
    out, taken = list(names[:n]), set(names)
    for i in range(m, n):
        name = f"{found[0][1]}{i}" if numbered else f"{names[i % m]}-{i // m}"
        while name in taken:
            name += "_"
        taken.add(name)
        out.append(name)
    return out


def device_overrides(data: dict, n: int, flag: str) -> list[Override]:
    """The profile's first n devices; beyond its list, copies of its devices in turn (same distance, speed,
    acceptance, hardware and link probe; a name of their own, so their channel draws are their own)."""
    devs = (data.get("scenario") or {}).get("devices") or []
    if not devs:
        raise CampaignError(f"{flag}: the profile lists no scenario.devices to take or copy")
    names = _copy_names([d["name"] for d in devs], n)
    template = [devs[i % len(devs)] for i in range(n)]
    new = [{**copy.deepcopy(t), "name": name} for t, name in zip(template, names)]
    out = [Override("scenario.devices", new, flag)]
    for key in ("hardware", "link_probe"):
        per = data.get(key) or {}
        out.append(Override(key, {name: per[t["name"]] for t, name in zip(template, names) if t["name"] in per}, flag))
    return out


def point_profile(base: Profile, sweep: Sweep | Grid, value) -> Profile:
    """The base profile at one sweep point (a grid's: every key's value, in the order of the keys); a bad value
    is reported as `--sweep KEY=VALUE: ...`."""
    data = base.snapshot()
    overrides: list[Override] = []
    for s, v in zip(sweep.sweeps, value if isinstance(sweep, Grid) else (value,)):
        flag = f"--sweep {s.key}={v}"
        overrides += device_overrides(data, v, flag) if s.key == DEVICES else [Override(s.path, v, flag)]
    try:
        return load_profile(data, overrides)
    except ProfileError as exc:
        raise CampaignError(str(exc)) from None


def check_sweep_key(base: Profile, sweep: Sweep | Grid) -> None:
    """An unknown profile key fails before anything runs (with a did-you-mean)."""
    for s in sweep.sweeps:
        if s.path is None:
            continue
        try:
            apply_override(base.snapshot(), Override(s.path, s.values[0], f"--sweep {s.key}"), root=Profile)
        except OverrideError as exc:
            also = "" if "." in s.key else f" (or a sweep key: {DEVICES}, {', '.join(ALIASES)})"
            raise CampaignError(f"{exc}{also}") from None


@dataclass
class CampaignRun:
    """One run of the campaign: a point, a policy, a repeat."""

    value: Any
    label: str          # the point's folder name
    policy: str
    repeat: int
    run_dir: Path
    profile: Profile


@dataclass
class Campaign:
    """A campaign folder and what runs in it (`plan_campaign`)."""

    out: Path
    sweep: Sweep | Grid
    policies: list[str]
    repeats: int
    base: Profile
    runs: list[CampaignRun] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # more meta.json fields of each new run: command line, tags, note

    def moved(self, out: Path) -> Campaign:
        """The same campaign in another folder (planned before its folder is made)."""
        out = Path(out)
        runs = [replace(r, run_dir=out / r.run_dir.relative_to(self.out)) for r in self.runs]
        return replace(self, out=out, runs=runs)

    def spec(self) -> dict:
        """What identifies the campaign (campaign.json): a restart must ask for the same."""
        return {"sweep": _json_roundtrip(self.sweep.spec()), "policies": self.policies,
                "repeats": self.repeats, "profile": _json_roundtrip(self.base.snapshot())}

    def run_meta(self, run: CampaignRun) -> dict:
        """The meta.json fields a campaign adds to one of its runs: the command's, the campaign, the point."""
        point = {"key": self.sweep.key, "value": _row_value(self.sweep, run.value)}
        if isinstance(self.sweep, Grid):
            point["point"] = point_of(self.sweep, run.value)
        return {**self.meta, "campaign": str(self.out), "sweep": point,
                "compare": {"dir": str(run.run_dir.parent), "policy": run.policy, "repeat": run.repeat}}


def _row_value(sweep: Sweep | Grid, value):
    """A point's `value` cell: the value; a grid's point, its values joined with ','."""
    return ",".join(shown(v) for v in value) if isinstance(sweep, Grid) else value


def _json_roundtrip(obj):
    return json.loads(json.dumps(obj))


def plan_campaign(out: Path, base: Profile, sweep: Sweep | Grid, policies: list[str], repeats: int) -> Campaign:
    """Every run of the campaign, point by point; within a point repeat by repeat and the policies of a repeat
    back to back (as `multispin compare`: a slow drift of the host lands on every policy alike)."""
    from testbed.run.compare import policy_profile, run_name

    if repeats < 1:
        raise CampaignError(f"--repeats {repeats}: must be >= 1")
    check_sweep_key(base, sweep)
    camp = Campaign(Path(out), sweep, list(policies), repeats, base)
    for value in sweep.values:
        point = point_profile(base, sweep, value)
        label = point_label(sweep, value)
        for r in range(repeats):
            for policy in policies:
                camp.runs.append(CampaignRun(value, label, policy, r, camp.out / label / run_name(policy, r, repeats),
                                             policy_profile(point, policy, r)))
    return camp


def open_campaign(camp: Campaign) -> int:
    """Write campaign.json in a new folder, or check that an existing one asks for the same campaign; returns
    how many of its runs are complete already."""
    from testbed import __version__
    from testbed.runtime.records import git_revision

    spec_path = camp.out / SPEC_FILE
    spec = camp.spec()
    if spec_path.is_file():
        try:
            old = json.loads(spec_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CampaignError(f"{spec_path}: unreadable ({exc}); choose another --out") from None
        differ = [k for k in spec if old.get(k) != spec[k]]
        if differ:
            detail = "; ".join(f"{k}: {json.dumps(old.get(k))[:80]} there, {json.dumps(spec[k])[:80]} now"
                               for k in differ if k != "profile")
            if "profile" in differ:
                keys = sorted(k for k in set(old.get("profile") or {}) | set(spec["profile"])
                              if (old.get("profile") or {}).get(k) != spec["profile"].get(k))
                detail += ("; " if detail else "") + f"profile fields {', '.join(keys)} differ"
            raise CampaignError(f"--out {camp.out}: holds another campaign ({detail}); rerun it with its own "
                                f"settings to resume it, or choose another --out")
    elif camp.out.exists() and any(camp.out.iterdir()):
        raise CampaignError(f"--out {camp.out}: not empty and not a campaign folder (no {SPEC_FILE})")
    else:
        camp.out.mkdir(parents=True, exist_ok=True)
        created = datetime.now().astimezone().isoformat(timespec="seconds")
        keep = {k: camp.meta[k] for k in ("tags", "note", "overrides") if k in camp.meta}  # for `campaign extend`
        spec_path.write_text(json.dumps({**spec, "created_utc": created, "version": __version__,
                                         "git_revision": git_revision(), "run_meta": keep}, indent=2) + "\n")
    return sum(run_status(r.run_dir) in FINISHED for r in camp.runs)


def run_status(run_dir: Path) -> str | None:
    """The status meta.json records (None: the run never started)."""
    try:
        return json.loads((run_dir / "meta.json").read_text()).get("status")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _resume_or_reset(run: CampaignRun):
    """An unfinished run directory: its resume point (`load_resume`), or None after removing it when it cannot
    be resumed (never started a round, every round recorded but not finished, a snapshot that no longer loads)."""
    from testbed.run.session import load_resume

    if not run.run_dir.exists():
        return None
    try:
        _, resume = load_resume(run.run_dir)
    except TestbedError as exc:
        log.warning("%s: starting it over (%s)", run.run_dir, exc)
        shutil.rmtree(run.run_dir)
        return None
    return resume


def run_campaign(camp: Campaign, pair: dict, *, plots: bool = True, progress: bool = True, on_round=None,
                 echo=print, runner=None, warm: bool = True) -> list[dict]:
    """Run what is not complete yet, resuming an interrupted run; after each run results.csv and the point's
    compare files are written, at the end summary.txt and the plots. Returns the result rows (one per complete
    run, in campaign order). A run that fails is reported and the campaign goes on; `on_round(record, run)` is
    called after every round (runs in this process only). `runner(camp, todo, pair, plots=, bar=)`: runs the
    (index, run) pairs of `todo` elsewhere and returns the failed ones (`testbed.run.campaign_jobs.parallel`:
    side by side, or on Ray); default: one after another here, as warm trials (`testbed.run.warm`: the target,
    emulator and device processes of one run serve the next of the same pair, device set and deployment) unless
    `warm` is False."""
    from tqdm import tqdm

    done = open_campaign(camp)
    todo = [(k, r) for k, r in enumerate(camp.runs) if run_status(r.run_dir) not in FINISHED]
    bar = tqdm(total=len(camp.runs), initial=done, unit="run", desc=f"campaign {camp.sweep.key}",
               disable=not progress, dynamic_ncols=True)
    try:
        if runner is not None:
            failed = runner(camp, todo, pair, plots=plots, bar=bar)
        else:
            failed = _run_serial(camp, todo, pair, plots=plots, bar=bar, on_round=on_round, warm=warm)
    finally:
        bar.close()
    return finish_campaign(camp, failed, plots=plots, echo=echo)


def trial_label(camp: Campaign, run: CampaignRun) -> str:
    return f"{run.label} {run.policy}" + (f" rep{run.repeat}" if camp.repeats > 1 else "")


def run_trial(run: CampaignRun, meta: dict, pair: dict, *, plots: bool, title: str, on_round=None, pool=None,
              say=None):
    """One run of a campaign, resumed where it stopped when it can be (else started over); its `RunInfo`.
    Module-level and picklable: a worker process or a Ray task runs it as this process would. `pool`: the
    `testbed.run.warm.WarmPool` of the runs before it in this process; `say`: its start phases."""
    from testbed.run.compare import run_policy

    resume = _resume_or_reset(run)
    return run_policy(run.profile, run.run_dir, pair, progress=False, plots=plots, title=title, resume=resume,
                      on_round=on_round, meta=meta, pool=pool, say=say)


def trial_done(camp: Campaign, run: CampaignRun, *, plots: bool) -> None:
    """After a run (complete or not): results.csv, and its point's compare files."""
    from testbed.analysis.runs_index import run_info
    from testbed.run.compare import write_comparison

    write_results(camp)
    point_runs = [r for r in camp.runs if r.label == run.label and run_status(r.run_dir) is not None]
    write_comparison(camp.out / run.label, camp.policies, camp.repeats, [run_info(r.run_dir) for r in point_runs],
                     plots=plots)


def trial_line(camp: Campaign, k: int, run: CampaignRun, info=None, error: str | None = None) -> str:
    head = f"[{k + 1}/{len(camp.runs)}] {trial_label(camp, run)}"
    if error is not None:
        return f"{head}: failed: {error}"
    return (f"{head}: measured {_num(info.measured_tps)} tok/s, predicted {_num(info.predicted_tps)} tok/s "
            f"({info.status}, {info.rounds} rounds)")


def _run_serial(camp: Campaign, todo: list, pair: dict, *, plots: bool, bar, on_round, warm: bool = True
                ) -> list[tuple]:
    """The runs one after another in this process (warm trials with `warm`); returns the failed ones as
    (run, why)."""
    from testbed.run.warm import WarmPool

    pool = WarmPool() if warm else None
    try:
        return _serial_trials(camp, todo, pair, plots=plots, bar=bar, on_round=on_round, pool=pool)
    finally:
        if pool is not None:
            pool.close()


def _serial_trials(camp: Campaign, todo: list, pair: dict, *, plots: bool, bar, on_round, pool) -> list[tuple]:
    failed: list[tuple[CampaignRun, str]] = []
    for k, run in todo:
        what = trial_label(camp, run)
        bar.set_postfix_str(what + (" (resumed)" if (run.run_dir / "rounds.jsonl").is_file() else ""), refresh=True)

        def _say(text: str, what=what) -> None:  # a cold start's reason is kept on screen, the phases in the bar
            if text.startswith("cold"):
                bar.write(f"{what}: {text}")
            bar.set_postfix_str(f"{what}: {text}", refresh=True)

        if pool is not None:
            pool.say = _say

        def _round(rec, server, launcher, run=run, what=what):
            bar.set_postfix_str(f"{what}: round {rec['round'] + 1}/{run.profile.rounds}, "
                                f"{rec['measured']['goodput_tps'] or 0:.1f} tok/s", refresh=True)
            if on_round is not None:
                on_round(rec, run)

        try:
            info = run_trial(run, camp.run_meta(run), pair, plots=plots, on_round=_round, pool=pool, say=_say,
                             title=f"{camp.out.name}/{run.label}/{run.run_dir.name}")
            bar.write(trial_line(camp, k, run, info))
        except TestbedError as exc:
            failed.append((run, str(exc)))
            bar.write(trial_line(camp, k, run, error=str(exc)))
        finally:
            write_results(camp)  # also when interrupted: what is complete is in the table
        bar.update(1)
        trial_done(camp, run, plots=plots)
    return failed


def finish_campaign(camp: Campaign, failed: list[tuple], *, plots: bool, echo=print) -> list[dict]:
    """results.csv, summary.txt and the campaign's plots; a CampaignError naming the runs that failed."""
    rows = write_results(camp)
    text = format_orderings(rows, camp.policies)
    (camp.out / SUMMARY_FILE).write_text(text + "\n")
    echo(text)
    if plots and rows:
        echo("plots: " + ", ".join(str(p) for p in campaign_plots(camp, rows)))
    if failed:
        which = "; ".join(f"{r.label} {r.policy}: {why}" for r, why in failed)
        raise CampaignError(f"{len(failed)} of {len(camp.runs)} runs failed ({which[:600]}); run the same command "
                            f"again to retry them")
    return rows


def campaign_plots(camp: Campaign, rows: list[dict]) -> list[Path]:
    """plots/goodput (and tokens_per_j) of the campaign: against its key, or a grid's panels."""
    from testbed.analysis.campaign_plots import plot_campaign

    grid = [(s.key, sweep_column(s.key)) for s in camp.sweep.sweeps] if isinstance(camp.sweep, Grid) else None
    return plot_campaign(rows, camp.out / "plots", camp.sweep.key, title=camp.out.name, grid=grid)


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def result_row(camp: Campaign, run: CampaignRun) -> dict:
    """One tidy row of results.csv from a complete run's meta.json and summary.json."""
    from testbed.analysis.runs_index import run_info

    info = run_info(run.run_dir)
    s = info.summary
    meta = json.loads((run.run_dir / "meta.json").read_text())
    run_e = ((s.get("energy") or {}).get("run")) or {}
    devs = (s.get("devices") or {}).values()
    ul, dl = sum(d.get("ul_rounds", 0) for d in devs), sum(d.get("dl_rounds", 0) for d in devs)
    mean = s.get("goodput_mean_round_tps") or {}
    grid = {sweep_column(k): v for k, v in point_of(camp.sweep, run.value).items()} \
        if isinstance(camp.sweep, Grid) else {}
    return {"key": camp.sweep.key, "value": _row_value(camp.sweep, run.value), **grid, "policy": run.policy,
            "repeat": run.repeat,
            "seed": run.profile.seed, "status": info.status, "fallback_rounds": info.fallback_rounds,
            "fallbacks": ";".join(f"{k}={n}" for k, n in info.fallbacks.items()),
            "rounds": info.rounds, "tokens": s.get("tokens"),
            "time_s": s.get("time_s"), "time_base": s.get("time_base"), "measured_goodput_tps": info.measured_tps,
            "predicted_goodput_tps": info.predicted_tps, "measured_mean_round_tps": mean.get("measured"),
            "predicted_mean_round_tps": mean.get("predicted"), "ul_share": ul / (ul + dl) if ul + dl else None,
            "measured_energy_j": run_e.get("measured_energy_j"), "predicted_energy_j": run_e.get("predicted_energy_j"),
            "measured_tokens_per_j": run_e.get("tokens_per_j"),
            "predicted_tokens_per_j": run_e.get("predicted_tokens_per_j"), "wall_s": _wall_s(meta),
            "tags": ";".join(str(t) for t in meta.get("tags") or []), "run": str(run.run_dir.relative_to(camp.out))}


def _wall_s(meta: dict) -> float | None:
    """Wall time of a run from meta.json (start to end; a resumed run: the whole span)."""
    try:
        t0 = datetime.fromisoformat(meta["created_utc"])
        t1 = datetime.fromisoformat(meta["ended_utc"])
    except (KeyError, TypeError, ValueError):
        return None
    return (t1 - t0).total_seconds()


def write_results(camp: Campaign) -> list[dict]:
    """results.csv from every complete run (rewritten whole, then renamed: a reader never sees half a file)."""
    rows = [result_row(camp, r) for r in camp.runs if run_status(r.run_dir) in FINISHED]
    path = camp.out / RESULTS_FILE
    tmp = path.with_suffix(".csv.tmp")
    fields = list(RESULT_FIELDS)
    if isinstance(camp.sweep, Grid):  # one column per key after `value` ("2,none")
        fields[2:2] = [sweep_column(s.key) for s in camp.sweep.sweeps]
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
    return rows


def mean_by(rows: list[dict], metric: str) -> dict[tuple, float]:
    """(value, policy) -> the mean of `metric` over the repeats (rows without it left out)."""
    acc: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get(metric) is not None:
            acc.setdefault((json.dumps(r["value"]), r["policy"]), []).append(float(r[metric]))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def format_orderings(rows: list[dict], policies: list[str]) -> str:
    """Per point: measured and predicted goodput per policy (mean over repeats), and the policies ordered by
    each; `agree` when both orders are the same."""
    meas, pred = mean_by(rows, "measured_goodput_tps"), mean_by(rows, "predicted_goodput_tps")
    lines = []
    for p in dict.fromkeys(json.dumps(r["value"]) for r in rows):
        value, key = json.loads(p), rows[0]["key"]
        if "," in key:  # a grid: its point as key=value pairs
            key, value = ",".join(f"{k}={v}" for k, v in zip(key.split(","), str(value).split(","))), None
        have = [x for x in policies if (p, x) in meas]
        cells = ", ".join(f"{x} {meas[(p, x)]:.2f}/{pred.get((p, x), float('nan')):.2f}" for x in have)
        order_m = sorted(have, key=lambda x: -meas[(p, x)])
        order_p = sorted((x for x in have if (p, x) in pred), key=lambda x: -pred[(p, x)])
        lines.append(f"{key if value is None else f'{key}={value}'}: measured/predicted tok/s: {cells}")
        lines.append(f"  measured order:  {' > '.join(order_m)}")
        lines.append(f"  predicted order: {' > '.join(order_p)}  ({'agree' if order_m == order_p else 'differ'})")
    lines.append("goodput_run_tps per run (all tokens / all round time), mean over the repeats")
    return "\n".join(lines)
