"""Testbed overhead: a live run (pass-through channel, one device process, ZeroMQ, records) against an
in-process speculative decoding loop on the same pair, settings, seeds and schedule, side by side.

    python tools/bench_overhead.py [--pair default|micro|DIR] [--rounds 40] [--draft-len 4] [--mode UL]
                                   [--curve off|on|both] [--rehearse on|off|both]

Prints tokens/s of both, their ratio (target >= 0.9) and the per-round overhead in ms, and checks that
both produced the same tokens (same seeds, same accept/reject code). Each live run is compared with the
in-process runs just before and just after it, pooled (repeats + 1 in-process runs in all): the speed of a
shared machine drifts within a minute. The live run is what `multispin run` does with this profile: a
pass-through channel schedules each round with the previous round's verdicts, and with a core for the edge
and one for the device (`busy_poll: auto`) both busy-poll (docs/architecture.md). `--curve on` authenticates and
encrypts the edge's socket (CURVE, keys made for the run; loopback tcp), `both` measures it beside a plain
tcp run in the same repetitions, so the cost of security reads off one table. `--rehearse both` likewise
runs the nodes with and without their rehearsals (`testbed.runtime.waiting`: a busy-polling node reruns the last
message's checks while it waits).

Then where the time goes: per phase of a round, the median over rounds (then over repetitions) of the live
run's times, from its round records (the device's drafting time, the draft's arrival, the edge's phases
`edge_phases_s`, the recorder's write time), beside the in-process loop's own phases. The rows:
  drafting                 the device's draft (same model, same tokens as in-process)
  schedule -> draft in     schedule sent, delivered, decoded; the draft encoded, sent, received (less drafting)
  draft decode + check     the edge decodes the upload and checks it (q rows, sums)
  verification             the target's forward pass
  accept/reject + verdict  p from the logits, accept/reject, the verdict encoded and sent
  verdict -> report        delivered, decoded, committed on the device, its report back
  between rounds           the round record (and progress) written, callbacks, the next round's housekeeping
The machine's load moves all of these (2 shared cores): compare runs made side by side, as this tool does.

`--timeline` also stamps each step of a round in both processes on the host's one monotonic clock
(`testbed.runtime.timeline`) and prints, from the edge's verdict to its next verification, when each step happened
(the median over rounds) and how long after the step before: each message's encode, send, trip, decode and
check, on the critical path or beside it.

Last, the host's penalty on a small step run right after a pause (`tools/bench_cold.py`, 5 ms): on a shared
virtual machine each of the testbed's steps pays it, which is most of the overhead there (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from testbed.core.vocabulary import MODES, UL

TARGET = 0.9


def pair_paths(which: str):
    from model_pairs.cache import ensure_default_pair
    from model_pairs.model_pair import MICRO_CONFIG, PairPaths, build_pair

    if which == "default":
        return ensure_default_pair(progress=True)
    if which == "micro":
        root = Path(tempfile.gettempdir()) / "multispin-bench-micro"
        paths = PairPaths.under(root)
        return paths if paths.manifest.is_file() else build_pair(MICRO_CONFIG, root, progress=False)
    return PairPaths.under(Path(which))


def in_process(paths, prompt_ids, rounds, L, seed, params, bits, name="d0", threads=None, device=None):
    """The same round as the testbed's edge + device, in one process with no messages."""
    from device_node.drafter import OnnxDrafter
    from edge_node.verifier import BatchedVerifier, load_target
    from testbed.core.sampling import RoundRandomness, exact_from_wire, to_probs, to_wire_precision, verify_draft

    drafter = OnnxDrafter(paths.draft_onnx, threads=1)
    verifier = BatchedVerifier(load_target(paths.target_dir, device=device), device=device, threads=threads)
    drafter.reset(prompt_ids)
    verifier.open("s", prompt_ids)
    pending, out, times, counts, phases = [], [], [], [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        rr = RoundRandomness(seed, name, r)
        # As the device and the edge do: q sampled through the wire precision, p = f(wire rows of p).
        drafted = drafter.draft(L, params, rr.draft_generator(), wire_bits=bits)
        toks, q = drafted.tokens, drafted.q
        t1 = time.perf_counter()
        logits = verifier.verify([("s", pending, toks)])[0]
        t2 = time.perf_counter()
        p = exact_from_wire(to_wire_precision(to_probs(np.asarray(logits, dtype=np.float32), params), bits))
        # The edge's own decision; UL mode, so the correction (if any) is sampled here as well.
        verdict = verify_draft(p, q[np.arange(L), toks], q, toks, "UL", rr)
        n, token = verdict.n_accepted, verdict.token
        verifier.commit("s", n)
        drafter.commit(n, token)
        pending = [token]
        out.extend(toks[:n] + [token])
        t3 = time.perf_counter()
        times.append(t3 - t0)
        counts.append(n + 1)
        phases.append({"draft": t1 - t0, "verify": t2 - t1, "decide": t3 - t2})
    return out, times, counts, phases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="default", help="default | micro | a pair directory")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--mode", choices=MODES, default=UL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the target (both sides)")
    ap.add_argument("--device", default=None, help="torch device of the target (default: cuda if any, else cpu)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repetitions (the median is reported)")
    ap.add_argument("--curve", choices=["off", "on", "both"], default="off",
                    help="CURVE on the edge socket (tcp loopback); both: plain and CURVE side by side")
    ap.add_argument("--busy-poll", choices=["auto", "on", "off"], default="auto",
                    help="the live run's busy_poll setting (default auto, as multispin run)")
    ap.add_argument("--rehearse", choices=["on", "off", "both"], default="on",
                    help="busy-polling nodes rehearse a message's checks while they wait (testbed.runtime.waiting); "
                         "both: with and without, side by side")
    ap.add_argument("--timeline", action="store_true",
                    help="also stamp each step in both processes (runtime.timeline) and print a round's timeline")
    ap.add_argument("--no-cold-probe", action="store_true",
                    help="skip the host's cold-step probe (tools/bench_cold.py, about 3 s) after the runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from testbed.core.sampling import SamplingParams
    from testbed.run.launcher import load_tokenizer
    from testbed.run.live import run_live
    from testbed.run.profile import load_profile
    from testbed.runtime.records import load_run
    from testbed.runtime.waiting import REHEARSE_ENV

    paths = pair_paths(args.pair)
    stamps_dir = Path(tempfile.mkdtemp(prefix="ms-bench-timeline-")) if args.timeline else None
    if stamps_dir is not None:
        from testbed.runtime import timeline

        timeline.enable(stamps_dir)  # the edge runs in this process; the device process inherits it
    prompt = "The :mod:`json` module provides"
    base = {
        "name": "bench-overhead", "rounds": args.rounds, "seed": args.seed, "prompts": [prompt],
        "model": {"pair": "local", "target": str(paths.target_dir), "draft_onnx": str(paths.draft_onnx),
                  "tokenizer": str(paths.tokenizer), "threads": args.threads, "device": args.device},
        "channel": {"mode": "passthrough"}, "pin": {"mode": args.mode, "draft_len": args.draft_len},
        "busy_poll": args.busy_poll,
        "estimator": {"fit_verify_after": 0},
        "scenario": {"bits_per_prob": 16, "max_draft_len": max(8, args.draft_len),
                     "devices": [{"name": "d0", "distance_m": 100, "draft_time_s": 0.001, "acceptance": 0.65}]},
    }
    keys_dir = Path(tempfile.mkdtemp(prefix="ms-bench-keys-"))
    transports = {"off": ["ipc"], "on": ["curve"], "both": ["tcp", "curve"]}[args.curve]
    rehearsals = {"on": ["on"], "off": ["off"], "both": ["on", "off"]}[args.rehearse]
    # variant name -> (its profile, MULTISPIN_REHEARSE for the run: the edge here, the device process inherits it)
    variants = {t + ("" if r == "on" else "/no-rehearse"): (load_profile(variant_profile(base, t, keys_dir)), r)
                for t in transports for r in rehearsals}
    profile = next(iter(variants.values()))[0]
    params = SamplingParams(**profile.sampling.model_dump())
    prompt_ids = load_tokenizer(str(paths.tokenizer)).encode(prompt).ids

    def reference():
        return in_process(paths, prompt_ids, args.rounds, args.draft_len, args.seed, params, 16,
                          threads=args.threads, device=args.device)

    # The sides alternate, and each live run is compared with the in-process runs just before and just after
    # it, pooled: this machine's speed drifts by 20% within a minute (shared cores), which a single reference
    # run on one side would count as the testbed's.
    results, before = [], reference()
    for _rep in range(args.repeats):
        lives = []
        for variant, (prof, rehearse) in variants.items():
            writes: list[float] = []  # the recorder's write time, as each round's callback finds it
            os.environ[REHEARSE_ENV] = rehearse
            with tempfile.TemporaryDirectory() as tmp:
                run_live(prof, Path(tmp) / "run", progress=False,
                         on_round=lambda rec, server, launcher, w=writes: w.append(server.recorder.write_s))
                _, records = load_run(Path(tmp) / "run")
                outputs = json.loads((Path(tmp) / "run" / "outputs.json").read_text())
            lives.append((variant, records, outputs, np.diff(writes)))
        after = reference()
        ref_tokens = before[0]
        ref_times, ref_counts, ref_phases = (before[i][1:] + after[i][1:] for i in (1, 2, 3))  # warm-ups out
        for variant, records, outputs, writes in lives:
            results.append({"transport": variant, "identical_tokens_after": outputs["d0"]["output_ids"] == after[0],
                            **compare_sides(records, outputs, ref_tokens, ref_times, ref_counts),
                            "phases_ms": phase_breakdown(records, writes, ref_phases)})
        before = after
    shutil.rmtree(keys_dir, ignore_errors=True)
    by_transport = {v: [r for r in results if r["transport"] == v] for v in variants}
    result = {"pair": args.pair, "rounds": args.rounds, "draft_len": args.draft_len, "mode": args.mode,
              "repeats": results,
              "identical_tokens": all(r["identical_tokens"] and r["identical_tokens_after"] for r in results),
              "transports": {v: {"median_ratio": float(np.median([r["ratio"] for r in rs])),
                                 "median_overhead_ms_per_round": float(np.median([r["overhead_ms_per_round"]
                                                                                  for r in rs])),
                                 "phases_ms": median_phases([r["phases_ms"] for r in rs])}
                             for v, rs in by_transport.items()}}
    if stamps_dir is not None:
        result["timeline_ms"] = round_timeline(timeline.take() + timeline.load(stamps_dir))
        shutil.rmtree(stamps_dir, ignore_errors=True)
    if not args.no_cold_probe:
        result["cold_step_ratio_5ms"] = cold_step_ratio()
    first = next(iter(result["transports"].values()))
    result["median_ratio"], result["median_overhead_ms_per_round"] = (first["median_ratio"],
                                                                      first["median_overhead_ms_per_round"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(args, result, results)
        if "timeline_ms" in result:
            print_timeline(result["timeline_ms"])
        if "cold_step_ratio_5ms" in result:
            print(f"  this host: a step right after a 5 ms pause took {result['cold_step_ratio_5ms']:.1f}x its "
                  "back-to-back time (median of tools/bench_cold.py's steps)")
    return 0


def cold_step_ratio() -> float:
    """The host's penalty on a step run after a pause (`bench_cold`): the testbed has more such steps per round."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_cold import cold_ratio, measure

    return cold_ratio(measure([5.0], samples=60), 5.0)


def round_timeline(events: list) -> list[dict]:
    """From the edge's verdict to its next verification, each step's median time after the verdict (over the
    live runs' rounds, both processes on one clock) and the step before it."""
    from testbed.runtime.timeline import critical_path

    rows = critical_path(events, "edge: verdict encoded", "edge: verification starts")
    most = max((n for _, _, n in rows), default=0)
    rows = [r for r in rows if 2 * r[2] >= most]  # steps of most rounds (not the first schedule, nor the bye)
    return [{"step": tag, "at_ms": at, "delta_ms": at - (rows[i - 1][1] if i else 0.0), "rounds": n}
            for i, (tag, at, n) in enumerate(rows)]


def print_timeline(rows: list[dict]) -> None:
    print("  a round between the two processes (medians over rounds; ms after the edge encoded the verdict):")
    print("       at     step  what")
    for r in rows:
        print(f"    {r['at_ms']:6.3f}  {r['delta_ms']:+6.3f}  {r['step']}")


def variant_profile(base: dict, variant: str, keys_dir: Path) -> dict:
    """The live side over ipc (the default), plain loopback tcp, or CURVE on loopback tcp."""
    if variant == "ipc":
        return base
    port = free_port()
    prof = {**base, "endpoints": {"edge_bind": f"tcp://127.0.0.1:{port}"}}
    if variant == "curve":
        from testbed.runtime.security import generate_keys

        if not (keys_dir / "server.key_secret").exists():
            generate_keys(keys_dir, ["d0"])
        prof["security"] = {"keys": str(keys_dir)}
    return prof


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare_sides(records, outputs, ref_tokens, ref_times, ref_counts) -> dict:
    """One repetition: the testbed's rate and overhead against the in-process loop's."""
    # Skip the first round of each (prefill and warm-up). The testbed's time is wall time between round
    # starts, so planning, channel configuration and record writing (fsync) between rounds count too.
    tb_time = records[-1]["t_start_s"] + records[-1]["measured"]["round_s"] - records[1]["t_start_s"]
    tb_tokens = sum(r["measured"]["tokens"] for r in records[1:])
    n = len(records) - 1
    ip_round = sum(ref_times) / len(ref_times)  # the reference comes without its warm-up rounds
    return {"identical_tokens": outputs["d0"]["output_ids"] == ref_tokens,
            "testbed_tokens_per_s": tb_tokens / tb_time,
            "in_process_tokens_per_s": sum(ref_counts) / sum(ref_times),
            "ratio": (tb_tokens / tb_time) / (sum(ref_counts) / sum(ref_times)),
            "mean_round_ms_testbed": 1000 * tb_time / n, "mean_round_ms_in_process": 1000 * ip_round,
            "overhead_ms_per_round": 1000 * (tb_time / n - ip_round),
            "median_plan_ms": 1000 * float(np.median([r.get("plan_s") or 0.0 for r in records[1:]]))}


# (row, what the live run's time of it is, the in-process loop's phase of it or None)
PHASES = (("drafting", "draft", "draft"), ("schedule -> draft in", "uplink", None),
          ("draft decode + check", "draft_in", None), ("verification", "verify", "verify"),
          ("accept/reject + verdict", "reply", "decide"), ("verdict -> report", "reports", None),
          ("between rounds", "between", None), ("  of which records written", "writes", None))


def phase_breakdown(records: list[dict], writes, ref_phases: list[dict]) -> dict:
    """Per phase (`PHASES`), the median over rounds (the first left out) of the live run and of the in-process
    loop, in ms. The live run's phases come from its records: the device's drafting and the draft's arrival
    (schedule sent -> draft in, the first device's), the edge clock's `edge_phases_s`, the recorder's writes."""
    live: dict[str, list[float]] = {k: [] for _, k, _ in PHASES}
    for rec in records[1:]:
        dev = next(iter(rec["devices"].values()))["measured"] or {}
        ep, meas = rec.get("edge_phases_s") or {}, rec["measured"]
        draft, up = dev.get("draft_s"), dev.get("uplink_phase_s")
        values = {"draft": draft, "uplink": None if None in (up, draft) else up - draft,
                  "draft_in": None if None in (ep.get("drafts_s"), up) else ep["drafts_s"] - up,
                  "verify": meas.get("verify_s"), "reply": ep.get("reply_s"), "reports": ep.get("reports_s"),
                  "between": ep.get("between_s")}
        for k, v in values.items():
            if v is not None:
                live[k].append(v)
    live["writes"] = list(writes[1:])
    out = {}
    for row, key, ref in PHASES:
        ip = float(1000 * np.median([p[ref] for p in ref_phases])) if ref else None
        tb = float(1000 * np.median(live[key])) if live[key] else None
        out[row] = {"testbed": tb, "in_process": ip,
                    "overhead": None if tb is None else tb - (ip or 0.0)}
    return out


def median_phases(per_repeat: list[dict]) -> dict:
    """The median over repetitions of each phase's numbers."""
    def med(values):
        values = [v for v in values if v is not None]
        return float(np.median(values)) if values else None

    return {row: {k: med([r[row][k] for r in per_repeat]) for k in ("testbed", "in_process", "overhead")}
            for row in per_repeat[0]}


def print_phases(phases: dict) -> None:
    print("    per round, ms (medians)           testbed  in-process  overhead")
    for row, v in phases.items():
        cells = [f"{v[k]:9.3f}" if v[k] is not None else " " * 9 for k in ("testbed", "in_process", "overhead")]
        print(f"    {row:32s} {cells[0]}  {cells[1]}  {cells[2]}")


def print_result(args, result: dict, results: list[dict]) -> None:
    print(f"pair {args.pair}, {args.rounds} rounds, L = {args.draft_len}, {args.mode} mode, pass-through channel")
    print(f"  identical tokens: {result['identical_tokens']}")
    for i, r in enumerate(results):
        print(f"  [{i}] {r['transport']:5s} testbed {r['testbed_tokens_per_s']:7.1f} tok/s "
              f"({r['mean_round_ms_testbed']:.2f} ms/round, "
              f"planning {r['median_plan_ms']:.2f} ms)  in-process {r['in_process_tokens_per_s']:7.1f} tok/s "
              f"({r['mean_round_ms_in_process']:.2f} ms/round)  ratio {r['ratio']:.3f}  "
              f"overhead {r['overhead_ms_per_round']:.2f} ms/round")
    for variant, t in result["transports"].items():
        print(f"  {variant:5s} median ratio {t['median_ratio']:.3f} (target >= {TARGET}); median overhead "
              f"{t['median_overhead_ms_per_round']:.2f} ms per round; where the time goes:")
        print_phases(t["phases_ms"])


if __name__ == "__main__":
    sys.exit(main())
