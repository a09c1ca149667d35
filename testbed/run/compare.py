"""One comparison of policies (`multispin compare`, and each point of a campaign): the runs' folders and
profiles, one run with its plots, and the comparison's table and files."""

from __future__ import annotations

from pathlib import Path


def run_name(policy: str, repeat: int, repeats: int) -> str:
    """A run's folder in the compare directory: the policy (one repeat), or policy-rep<r>; a plug-in's Python
    path (module:Class) with every character but letters, digits, '.', '_' and '-' as '-'."""
    import re

    policy = re.sub(r"[^A-Za-z0-9._-]", "-", policy)
    return policy if repeats == 1 else f"{policy}-rep{repeat}"


def policy_profile(base, policy: str, repeat: int):
    """The profile of one policy and repeat: repeat r uses seed + r, shared by the policies of that repeat (the
    same prompts, sampling and channel draws)."""
    return base.model_copy(update={"policy": policy, "seed": base.seed + repeat})


def run_policy(profile, run_dir: Path, pair: dict, *, progress: bool, plots: bool, title: str,
               resume=None, on_round=None, meta: dict | None = None, pool=None, say=None):
    """One run of a comparison (or a campaign): the live run, its plots, and its `RunInfo`; `meta`: more
    fields of a new run's meta.json (`testbed.run.live.run_meta`); `pool`: the `testbed.run.warm.WarmPool` of the
    trials run one after another here (warm trials); `say`: the start phases (`run_live`)."""
    from testbed.analysis.runs_index import run_info
    from testbed.run.live import run_live
    from testbed.runtime.records import load_run

    run_live(profile, run_dir, progress=progress, pair=pair, resume=resume, on_round=on_round, meta=meta, pool=pool,
             say=say)
    if plots:
        from testbed.analysis import report

        _, records = load_run(run_dir)
        if records:
            report.write_plots(records, run_dir / "plots", title=title)
    return run_info(run_dir)


def write_comparison(parent: Path, policies: list[str], repeats: int, infos: list, *, plots: bool):
    """compare.txt, compare.json and (with `plots`) plots/compare_goodput.png of a compare directory; returns
    (per-policy rows, the table as text, the plot paths)."""
    from testbed.analysis.runs_index import aggregate, format_aggregate, plot_compare
    from testbed.runtime.records import json_text

    rows = aggregate(infos)
    text = format_aggregate(rows, reference=policies[0])
    (parent / "compare.txt").write_text(text + "\n")
    (parent / "compare.json").write_text(json_text({"policies": policies, "repeats": repeats, "per_policy": rows,
                                                      "runs": [i.as_dict() for i in infos]}, indent=2))
    paths = plot_compare(rows, Path(parent) / "plots", title=parent.name) if plots else []
    return rows, text, paths
