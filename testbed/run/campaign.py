"""A live campaign: the testbed run once per sweep point x policy x repeat, into one folder that a second
start resumes (`multispin campaign`).

Layout of a campaign folder:
  campaign.json         what the campaign is: sweep key and values, policies, repeats, the base profile (after
                        --set and the flags, before the sweep), code version; a restart must match it
  <key>=<value>/        one compare directory per sweep point (`multispin report` reads it as one):
      <policy>[-rep<r>]/  a run directory (testbed.runtime.records); compare.json / compare.txt / plots/
  results.csv           one row per run: the point, policy, repeat, seed, status, measured and predicted
                        goodput, energy, tags; rewritten after every run
  summary.txt           per point: the policies ordered by measured and by predicted goodput
  plots/goodput.png     measured goodput per policy against the swept key, the model's prediction beside it

Every run of a point uses the same seeds per repeat (repeat r: seed + r) whatever the policy, so the prompts,
sampling and channel draws (seeded per device name and round) are the same across policies; `devices=N`
keeps the first devices of a point in the next one. A run whose meta.json says `complete` is never run again;
an interrupted one is resumed in its own directory (`testbed.run.session.load_resume`), and one that cannot be
resumed is started over.
"""

from __future__ import annotations

import copy
import csv
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


def point_label(sweep: Sweep, value) -> str:
    """The folder of a sweep point: `<key>=<value>` with a plain, path-safe value."""
    shown = format(value, "g") if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9._+=-]", "_", f"{sweep.key}={shown}")


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


def point_profile(base: Profile, sweep: Sweep, value) -> Profile:
    """The base profile at one sweep point; a bad value is reported as `--sweep KEY=VALUE: ...`."""
    data = base.snapshot()
    flag = f"--sweep {sweep.key}={value}"
    overrides = device_overrides(data, value, flag) if sweep.key == DEVICES else [Override(sweep.path, value, flag)]
    try:
        return load_profile(data, overrides)
    except ProfileError as exc:
        raise CampaignError(str(exc)) from None


def check_sweep_key(base: Profile, sweep: Sweep) -> None:
    """An unknown profile key fails before anything runs (with a did-you-mean)."""
    if sweep.path is None:
        return
    try:
        apply_override(base.snapshot(), Override(sweep.path, sweep.values[0], f"--sweep {sweep.key}"), root=Profile)
    except OverrideError as exc:
        also = "" if "." in sweep.key else f" (or a sweep key: {DEVICES}, {', '.join(ALIASES)})"
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
    sweep: Sweep
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
        return {"sweep": {"key": self.sweep.key, "values": list(self.sweep.values)}, "policies": self.policies,
                "repeats": self.repeats, "profile": _json_roundtrip(self.base.snapshot())}


def _json_roundtrip(obj):
    return json.loads(json.dumps(obj))


def plan_campaign(out: Path, base: Profile, sweep: Sweep, policies: list[str], repeats: int) -> Campaign:
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
        spec_path.write_text(json.dumps({**spec, "created_utc": created, "version": __version__,
                                         "git_revision": git_revision()}, indent=2) + "\n")
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
                 echo=print) -> list[dict]:
    """Run what is not complete yet, resuming an interrupted run; after each run results.csv, the point's
    compare files and (at the end) summary.txt and the plots are written. Returns the result rows (one per
    complete run, in campaign order). A run that fails is reported and the campaign goes on; `on_round(record,
    run)` is called after every round."""
    from tqdm import tqdm

    from testbed.analysis.runs_index import run_info
    from testbed.run.compare import run_policy, write_comparison

    done = open_campaign(camp)
    failed: list[tuple[CampaignRun, str]] = []
    bar = tqdm(total=len(camp.runs), initial=done, unit="run", desc=f"campaign {camp.sweep.key}",
               disable=not progress, dynamic_ncols=True)
    try:
        for k, run in enumerate(camp.runs):
            if run_status(run.run_dir) in FINISHED:
                continue
            what = f"{run.label} {run.policy}" + (f" rep{run.repeat}" if camp.repeats > 1 else "")
            resume = _resume_or_reset(run)
            bar.set_postfix_str(what + (" (resumed)" if resume else ""), refresh=True)

            def _round(rec, server, launcher, run=run, what=what):
                bar.set_postfix_str(f"{what}: round {rec['round'] + 1}/{run.profile.rounds}, "
                                    f"{rec['measured']['goodput_tps'] or 0:.1f} tok/s", refresh=True)
                if on_round is not None:
                    on_round(rec, run)

            meta = {**camp.meta, "campaign": str(camp.out), "sweep": {"key": camp.sweep.key, "value": run.value},
                    "compare": {"dir": str(run.run_dir.parent), "policy": run.policy, "repeat": run.repeat}}
            try:
                info = run_policy(run.profile, run.run_dir, pair, progress=False, plots=plots,
                                  title=f"{camp.out.name}/{run.label}/{run.run_dir.name}", resume=resume,
                                  on_round=_round, meta=meta)
                bar.write(f"[{k + 1}/{len(camp.runs)}] {what}: measured {_num(info.measured_tps)} tok/s, predicted "
                          f"{_num(info.predicted_tps)} tok/s ({info.status}, {info.rounds} rounds)")
            except TestbedError as exc:
                failed.append((run, str(exc)))
                bar.write(f"[{k + 1}/{len(camp.runs)}] {what}: failed: {exc}")
            finally:
                write_results(camp)  # also when interrupted: what is complete is in the table
            bar.update(1)
            point_runs = [r for r in camp.runs if r.label == run.label and run_status(r.run_dir) is not None]
            write_comparison(camp.out / run.label, camp.policies, camp.repeats,
                             [run_info(r.run_dir) for r in point_runs], plots=plots)
    finally:
        bar.close()
    rows = write_results(camp)
    text = format_orderings(rows, camp.policies)
    (camp.out / SUMMARY_FILE).write_text(text + "\n")
    echo(text)
    if plots and rows:
        from testbed.analysis.campaign_plots import plot_campaign

        echo("plots: " + ", ".join(str(p) for p in plot_campaign(rows, camp.out / "plots", camp.sweep.key,
                                                                title=camp.out.name)))
    if failed:
        which = "; ".join(f"{r.label} {r.policy}: {why}" for r, why in failed)
        raise CampaignError(f"{len(failed)} of {len(camp.runs)} runs failed ({which[:600]}); run the same command "
                            f"again to retry them")
    return rows


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
    return {"key": camp.sweep.key, "value": run.value, "policy": run.policy, "repeat": run.repeat,
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
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(RESULT_FIELDS))
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
        have = [x for x in policies if (p, x) in meas]
        cells = ", ".join(f"{x} {meas[(p, x)]:.2f}/{pred.get((p, x), float('nan')):.2f}" for x in have)
        order_m = sorted(have, key=lambda x: -meas[(p, x)])
        order_p = sorted((x for x in have if (p, x) in pred), key=lambda x: -pred[(p, x)])
        lines.append(f"{key}={value}: measured/predicted tok/s: {cells}")
        lines.append(f"  measured order:  {' > '.join(order_m)}")
        lines.append(f"  predicted order: {' > '.join(order_p)}  ({'agree' if order_m == order_p else 'differ'})")
    lines.append("goodput_run_tps per run (all tokens / all round time), mean over the repeats")
    return "\n".join(lines)
