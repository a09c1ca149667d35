"""Time one plan (policy `proposed` by default) for N = 8, 32, 128, 512 random devices (spec section 5 drops).

Prints, per N, the median of several runs of this tree's optimizer and, side by side, of the optimizer of
another git revision (HEAD by default; its testbed/core/optimizer.py and power.py are loaded from git into
temporary modules, the rest of testbed/core is this tree's), timed alternately so that both see the same
machine load; whether both chose the same schedule; the growth exponent of a log-log fit of the median
time against N; and the targets: N = 128 under 15 ms, N = 512 under 100 ms (issue 12), N = 1,024 under 100 ms and
N = 4,096 under 1 s with either uplink (issue 36), and N = 128 under the live controller's budget of 100 ms per plan.

The process keeps freed heap memory as `multispin` does (`testbed.runtime.heap`); --default-malloc times it with
glibc's defaults instead, under which large temporaries fault their pages in again at every greedy step.

Run: python tools/bench_optimizer.py [--repeats R] [--sizes 8,32,128,512] [--against REV | --no-compare]
     [--set dl_provisioning=expected --set rounds=asynchronous ...]   (scenario fields of every drop)
     [--default-malloc] [--ul-access dedicated|fdma_shared]   (a shared uplink: B^U = N x 1 MHz, the same spectrum)
     [--against-file PATH]   (an optimizer.py to compare with instead of the revision's, e.g. uncommitted work)
     [--against-uplink PATH] (and an uplink.py: the comparison's model and optimizer then use it, not this tree's)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
from bench_common import interleaved_medians  # tools/ is on sys.path when a script here runs

from testbed.core.optimizer import plan
from testbed.core.scenario import DropSpec, Scenario, ScenarioError
from testbed.core.simulate import draw_devices
from testbed.runtime.heap import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]  # the checkout (git revisions), not an import path

BUDGET_S = 0.100                           # the live controller's plan budget at N = 128
TARGETS_S = {128: 0.015, 512: 0.100,       # issue 12
             1024: 0.100, 4096: 1.0}       # issue 36 (dedicated and fdma_shared: --ul-access)


def _load_module(name: str, src: str, origin: str):
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, origin, "exec"), mod.__dict__)
    return mod


def load_revision(rev: str, optimizer_file: str | None = None, uplink_file: str | None = None):
    """The `plan` function of git revision `rev` (its optimizer and DL power solver; the rest is this tree's);
    optimizer_file: that optimizer.py instead of the revision's (e.g. a saved copy of uncommitted work);
    uplink_file: that uplink.py for the optimizer and for this tree's model (the shared band's split)."""
    def source(path):
        if optimizer_file and path.endswith("optimizer.py"):
            return Path(optimizer_file).read_text()
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
    power = _load_module(f"_bench_power_{rev}", source("testbed/core/power.py"), f"{rev}:testbed/core/power.py")
    opt_src = source("testbed/core/optimizer.py").replace(
        "from testbed.core.power import", f"from {power.__name__} import")
    if uplink_file:
        up = _load_module(f"_bench_uplink_{rev}", Path(uplink_file).read_text(), uplink_file)
        model_src = (ROOT / "testbed/core/model.py").read_text().replace(
            "from testbed.core import radio, uplink", f"from testbed.core import radio\nimport {up.__name__} as uplink")
        mdl = _load_module(f"_bench_model_{rev}", model_src, "testbed/core/model.py")
        opt_src = opt_src.replace("from testbed.core import model, payload, radio, uplink",
                                  f"from testbed.core import payload, radio\nimport {up.__name__} as uplink\n"
                                  f"import {mdl.__name__} as model")
        if f"import {mdl.__name__} as model" not in opt_src or f"import {up.__name__} as uplink" not in model_src:
            raise ImportError("--against-uplink: the optimizer's or model's import of uplink has changed")
    return _load_module(f"_bench_optimizer_{rev}", opt_src, f"{rev}:testbed/core/optimizer.py").plan


def timer(fn, sc, policy):
    def run():
        t0 = time.perf_counter()
        fn(sc, policy)
        return time.perf_counter() - t0
    return run


def exponent(sizes, times) -> float:
    return float(np.polyfit(np.log(sizes), np.log(times), 1)[0])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,32,128,512")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--policy", default="proposed")
    ap.add_argument("--against", default="HEAD", help="git revision to compare with (default HEAD)")
    ap.add_argument("--against-file", metavar="PATH",
                    help="compare with this optimizer.py (a saved copy of uncommitted work; power.py from --against)")
    ap.add_argument("--against-uplink", metavar="PATH",
                    help="and this uplink.py for the comparison's optimizer and model (a saved copy)")
    ap.add_argument("--no-compare", action="store_true", help="time this tree only")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a scenario field for every drop, e.g. dl_provisioning=expected (repeatable)")
    ap.add_argument("--ul-access", choices=("dedicated", "fdma_shared"), default=None,
                    help="the uplink: a dedicated band per device (default) or one shared band split by the plan")
    ap.add_argument("--default-malloc", action="store_true",
                    help="glibc's malloc defaults, not the freed-memory reuse that multispin sets")
    return ap


def print_targets(sizes, new_t, fields) -> None:
    """Each target N's median against its target, and N = 128 against the controller's budget."""
    if fields:
        print("(the targets below are for the default drop, without --set)")
    for n, target in TARGETS_S.items():
        if n in sizes:
            t = new_t[sizes.index(n)]
            print(f"N={n}: {t * 1e3:.1f} ms vs target {target * 1e3:.0f} ms -> "
                  f"{'OK' if t < target else 'OVER TARGET'}")
    if 128 in sizes:
        t128 = new_t[sizes.index(128)]
        print(f"N=128: {t128 * 1e3:.1f} ms vs the controller's budget {BUDGET_S * 1e3:.0f} ms -> "
              f"{'OK' if t128 < BUDGET_S else 'OVER BUDGET'} (ratio {t128 / BUDGET_S:.2f})")


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    kept = False if args.default_malloc else keep_freed_memory()
    print(f"heap: {'freed memory kept for reuse (as multispin)' if kept else 'malloc defaults'}")
    sizes = [int(x) for x in args.sizes.split(",")]
    from testbed.run.config_override import OverrideError, parse_set

    try:  # values read as YAML, as `multispin --set` reads them (numbers, lists, null)
        fields = {o.key: o.value for o in parse_set(args.set)}
    except OverrideError as exc:
        ap.error(str(exc))
    if args.ul_access:
        fields["ul_access"] = args.ul_access
    try:  # a bad field is named now, not as a traceback from the first drop
        Scenario.from_dict(dict(devices=draw_devices(DropSpec(), 2, (0, 0)), **fields))
    except (ScenarioError, TypeError) as exc:
        ap.error(f"--set: {exc}")
    if fields:
        print("scenario fields:", fields)
    old_plan = None
    if not args.no_compare:
        try:
            old_plan = load_revision(args.against, args.against_file, args.against_uplink)
            if args.against_file:
                args.against = Path(args.against_file).stem[:10]
        except (subprocess.CalledProcessError, OSError, SyntaxError, ImportError) as exc:
            print(f"(no comparison: cannot load {args.against}: {exc})")
    new_t, old_t = [], []
    head = f"{'N':>5} {'new ms':>8}"
    if old_plan:
        head += f" {args.against + ' ms':>10} {'speed-up':>8} {'same plan':>9}"
    print(head + f" {'K':>5} {'mean L':>7} {'evaluations':>11}")
    for n in sizes:
        sc = Scenario.from_dict(dict(devices=draw_devices(DropSpec(), n, (0, 0)), **fields))
        p = plan(sc, args.policy)  # warm-up, and the schedule to report
        line = ""
        if old_plan:
            q = old_plan(sc, args.policy)
            same = q.modes == p.modes and list(q.draft_lens) == list(p.draft_lens)
            t_new, t_old = interleaved_medians(timer(plan, sc, args.policy), timer(old_plan, sc, args.policy),
                                               args.repeats)
            old_t.append(t_old)
            line = f" {t_old * 1e3:>10.1f} {t_old / t_new:>7.1f}x {'yes' if same else 'NO':>9}"
        else:
            t_new = interleaved_medians(timer(plan, sc, args.policy), lambda: 0.0, args.repeats)[0]
        new_t.append(t_new)
        print(f"{n:>5} {t_new * 1e3:>8.1f}" + line + f" {p.evaluation.num_ul_devices:>5} "
              f"{np.mean(p.draft_lens):>7.2f} {p.info['evaluations']:>11}")
    if len(sizes) > 1:
        text = f"growth exponent (log-log fit of median time vs N): new {exponent(sizes, new_t):.2f}"
        if old_t:
            text += f", {args.against} {exponent(sizes, old_t):.2f}"
        print(text)
        for a, b in zip(range(len(sizes)), range(1, len(sizes))):
            if sizes[a] >= 128:
                print(f"  from N={sizes[a]} to {sizes[b]}: new N^{exponent(sizes[a:b + 1], new_t[a:b + 1]):.2f}"
                      + (f", {args.against} N^{exponent(sizes[a:b + 1], old_t[a:b + 1]):.2f}" if old_t else ""))
    print_targets(sizes, new_t, fields)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
