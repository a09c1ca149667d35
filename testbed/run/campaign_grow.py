"""A campaign folder read back (`load_campaign`: what `multispin report CAMPAIGN_DIR` and `campaign extend` start
from), and grown (`extend_campaign`: more values of its keys, more repeats).

Growing keeps everything that is there: the stored base profile, policies and seeds are reused, so the new
runs are those the original command would have run had it asked for the larger campaign; runs already
finished are never run again (their folders, records and results.csv rows stay). When one repeat becomes
several, the runs' folders `<policy>` become `<policy>-rep0` (the names a campaign of several repeats uses),
renamed in place. campaign.json keeps its creation stamp and gains an `extended` entry per growth.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from testbed.run.campaign import (
    FINISHED,
    SPEC_FILE,
    Campaign,
    CampaignError,
    Grid,
    Sweep,
    plan_campaign,
    run_status,
    sweep_from_spec,
)
from testbed.run.compare import run_name
from testbed.run.profile import ProfileError, load_profile


def read_spec(out: Path) -> dict:
    path = Path(out) / SPEC_FILE
    if not path.is_file():
        raise CampaignError(f"{out}: not a campaign folder (no {SPEC_FILE})")
    try:
        spec = json.loads(path.read_text())
        spec["sweep"], spec["policies"], spec["repeats"], spec["profile"]  # noqa: B018 - the fields it needs
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CampaignError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    return spec


def load_campaign(out: str | Path, spec: dict | None = None) -> Campaign:
    """The campaign a folder holds, planned from its campaign.json (every run, finished or not); its runs'
    meta fields (tags, note) are those it was started with."""
    out = Path(out)
    spec = read_spec(out) if spec is None else spec
    try:
        base = load_profile(spec["profile"])
    except ProfileError as exc:
        raise CampaignError(f"{out / SPEC_FILE}: its profile no longer loads: {exc}") from None
    camp = plan_campaign(out, base, sweep_from_spec(spec["sweep"]), list(spec["policies"]), int(spec["repeats"]))
    camp.meta = dict(spec.get("run_meta") or _first_run_meta(camp))
    return camp


def _first_run_meta(camp: Campaign) -> dict:
    """tags and note of a campaign written before campaign.json kept them: its first run's."""
    for r in camp.runs:
        try:
            meta = json.loads((r.run_dir / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        return {k: meta[k] for k in ("tags", "note", "overrides") if k in meta}
    return {}


def grown_sweep(old: Sweep | Grid, added: Sweep | Grid | None) -> Sweep | Grid:
    """`old` with the values of `added` appended per key (values it has already are left as they are); a key
    the campaign does not sweep is refused: every point of it would change."""
    if added is None:
        return old
    keys = [s.key for s in old.sweeps]
    new = {s.key: list(s.values) for s in old.sweeps}
    for s in added.sweeps:
        if s.key not in new:
            raise CampaignError(f"--sweep {s.key}: the campaign sweeps {', '.join(keys)}; a new key would change "
                                f"every point it has (start another campaign for it)")
        have = {json.dumps(v) for v in new[s.key]}
        new[s.key] += [v for v in s.values if json.dumps(v) not in have]
    sweeps = tuple(Sweep(k, tuple(new[k])) for k in keys)
    return sweeps[0] if len(sweeps) == 1 else Grid(sweeps)


def check_not_running(camp: Campaign) -> None:
    from testbed.analysis.runs_index import _alive

    for r in camp.runs:
        try:
            meta = json.loads((r.run_dir / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if meta.get("status") == "running" and _alive(meta):
            raise CampaignError(f"{camp.out}: run {r.run_dir} is running (pid {meta.get('pid')}); extend the "
                                f"campaign once it has stopped")


def extend_campaign(out: str | Path, added: Sweep | Grid | None = None, repeats: int | None = None,
                    argv: list[str] | None = None) -> tuple[Campaign, str]:
    """The campaign in `out` grown by `added` values and to `repeats` repeats (a total, not a number more);
    campaign.json rewritten, folders of a single repeat renamed. Returns (the campaign, what was added)."""
    out = Path(out)
    spec = read_spec(out)
    old = load_campaign(out, spec)
    check_not_running(old)
    if repeats is not None and repeats < old.repeats:
        raise CampaignError(f"--repeats {repeats}: the campaign has {old.repeats} repeats already (--repeats is the "
                            f"total; runs are never removed)")
    sweep = grown_sweep(old.sweep, added)
    total = old.repeats if repeats is None else repeats
    camp = plan_campaign(out, old.base, sweep, old.policies, total)  # every new point checked before any change
    camp.meta = old.meta
    new_points = len(sweep.values) - len(old.sweep.values)
    what = ", ".join(x for x in (f"{new_points} point(s)" if new_points else "",
                                 f"repeats {old.repeats} -> {total}" if total != old.repeats else "") if x)
    renamed = _rename_single_repeat(old, total) if old.repeats == 1 and total > 1 else []
    fresh = {**spec, **camp.spec()}
    if what or fresh != spec:  # also when only the profile's snapshot reads differently now (a newer release)
        fresh.setdefault("run_meta", old.meta)
        if what:
            stamp = datetime.now().astimezone().isoformat(timespec="seconds")
            fresh.setdefault("extended", []).append({"utc": stamp, "added": what, "renamed": renamed, "argv": argv})
        tmp = out / (SPEC_FILE + ".tmp")
        tmp.write_text(json.dumps(fresh, indent=2) + "\n")
        tmp.replace(out / SPEC_FILE)
    return camp, what or "nothing (every value and repeat is there already)"


def _rename_single_repeat(old: Campaign, repeats: int) -> list[str]:
    """`<point>/<policy>` -> `<point>/<policy>-rep0`: the folder a campaign of several repeats gives repeat 0;
    returns the renamed folders (relative)."""
    renamed = []
    for r in old.runs:
        new = r.run_dir.parent / run_name(r.policy, 0, repeats)
        if r.run_dir.exists() and not new.exists():
            r.run_dir.rename(new)
            renamed.append(str(r.run_dir.relative_to(old.out)))
    return renamed


def finished_count(camp: Campaign) -> int:
    return sum(run_status(r.run_dir) in FINISHED for r in camp.runs)
