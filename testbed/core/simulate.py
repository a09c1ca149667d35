"""The offline simulator: sweeps of one scenario parameter over seeded random drops, every policy.

For each sweep point and drop the devices are drawn from the profile's `drop` settings (distances,
drafting times and acceptance uniform in their ranges; spec section 5), each policy plans, and the
analytic prediction is recorded. With Monte Carlo on, each plan is also run for R token-level rounds:
accepted counts drawn from the acceptance law, the realized DL set (DL-mode devices that rejected) and
its DL time recomputed (`model.realized_round`). Output: a tidy list of rows (one per point x drop x
policy); the `simulate` command writes them as CSV and plots. Each point x drop is one task (`run_task`)
seeded from (seed, point, drop) alone, so the command may run the tasks in any process and order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import numpy as np

from testbed.core import model, payload
from testbed.core.optimizer import POLICIES, plan
from testbed.core.policy import DeviceResult, RoundOutcome, policy_name
from testbed.core.scenario import DropSpec, Scenario

# sweep key -> (scenario field or special, description)
SWEEP_KEYS = {
    "devices": "number of devices N (drawn per drop; the first N of the largest draw)",
    "dl_bandwidth": "downlink_bandwidth_hz, Hz",
    "dl_power": "downlink_power_w, W",
    "ul_bandwidth": "uplink_bandwidth_hz, Hz (per device; a shared band's default total is N times it)",
    "uplink_total_bandwidth_hz": "the shared uplink's total band B^U, Hz (with ul_access: fdma_shared)",
    "ul_access": "dedicated or fdma_shared",
    "bits_per_prob": "bits_per_prob, bits",
    "acceptance": "every device's acceptance (replaces the drop's acceptance range)",
    "vocab_size": "vocab_size, entries",
    "max_draft_len": "max_draft_len, tokens",
}
_FIELD = {"dl_bandwidth": "downlink_bandwidth_hz", "dl_power": "downlink_power_w",
          "ul_bandwidth": "uplink_bandwidth_hz", "bits_per_prob": "bits_per_prob",
          "vocab_size": "vocab_size", "max_draft_len": "max_draft_len", "ul_access": "ul_access",
          "uplink_total_bandwidth_hz": "uplink_total_bandwidth_hz"}
_ALIAS = {field: key for key, field in _FIELD.items()}  # a scenario field -> its sweep key
INT_KEYS = {"devices", "bits_per_prob", "vocab_size", "max_draft_len"}  # sweep keys whose values are integers
TEXT_KEYS = {"ul_access"}  # sweep keys whose values are names
DEFAULT_POLICIES = [p for p in POLICIES if p != "exhaustive"]


class SimulationError(ValueError):
    """A sweep request that cannot run (unknown key, bad values, missing drop settings)."""


def draw_devices(drop: DropSpec, n: int, seed) -> list[dict]:
    """n random devices per the drop settings. One stream per quantity, so the first n devices of a
    drop are the same whatever n is (a `devices` sweep adds devices to the same drop)."""
    d = np.random.default_rng([*seed, 0]).uniform(*drop.distance_m, size=n)
    t = np.random.default_rng([*seed, 1]).uniform(*drop.draft_time_s, size=n)
    a = np.random.default_rng([*seed, 2]).uniform(*drop.acceptance, size=n)
    return [dict(name=f"d{i}", distance_m=float(d[i]), max_power_w=drop.max_power_w,
                 draft_time_s=float(t[i]), acceptance=float(a[i])) for i in range(n)]


def sweep_key(key: str) -> str:
    """The sweep key that `key` names: a key of SWEEP_KEYS, or a scenario field (``downlink_bandwidth_hz``,
    ``ul_min_share``, ``drop.max_power_w``), with or without a leading ``scenario.`` (a campaign's spelling); a
    field with a sweep key of its own is that key (``scenario.downlink_bandwidth_hz`` -> ``dl_bandwidth``).
    Anything else raises `SimulationError` naming the allowed keys."""
    key = key.strip()
    bare = key[len("scenario."):] if key.startswith("scenario.") else key
    if bare in SWEEP_KEYS:
        return bare
    if bare in _ALIAS:
        return _ALIAS[bare]
    head, _, rest = bare.partition(".")
    if head == "drop" and rest in DropSpec.model_fields and rest != "num_devices":
        return bare
    if not rest and head in Scenario.model_fields and head not in ("devices", "drop"):
        return bare
    hint = (" (devices are drawn per drop: sweep `devices`, `acceptance` or a drop.* field)"
            if head == "devices" else "")
    raise SimulationError(f"sweep key {key!r} is not allowed; allowed keys: {', '.join(SWEEP_KEYS)}, or a "
                          f"scenario field (e.g. ul_min_share, scenario.downlink_power_w, drop.max_power_w){hint}")


def key_kind(key: str) -> str:
    """'int', 'float' or 'text': what the values of a sweep key are (`sweep_key`'s result)."""
    if key in INT_KEYS:
        return "int"
    if key in TEXT_KEYS:
        return "text"
    if key in SWEEP_KEYS:
        return "float"
    head, _, rest = key.partition(".")
    field = DropSpec.model_fields[rest] if head == "drop" else Scenario.model_fields[head]
    ann = field.annotation
    if ann is int:
        return "int"
    if ann is float or ann == (float | None) or ann == (int | None):
        return "float"
    return "text"


def sweep_values(key: str, values: Iterable) -> list:
    """The values of a sweep key, typed: integers for an integer key, floats for a number (text that reads as a
    number is one), names as given; a value of the wrong kind raises `SimulationError`."""
    kind, out = key_kind(key), []
    for item in values:
        if kind == "text":
            out.append(item)
            continue
        try:
            v = float(item) if not isinstance(item, bool) else float("nan")
        except (TypeError, ValueError):
            raise SimulationError(f"sweep value {item!r} for {key} is not a number") from None
        if not np.isfinite(v):
            raise SimulationError(f"sweep value {item!r} for {key} is not a number")
        if kind == "int":
            if not v.is_integer():
                raise SimulationError(f"sweep value {item!r} for {key} must be an integer")
            v = int(v)
        out.append(v)
    if not out:
        raise SimulationError(f"sweep {key}: no values given")
    return out


def point_scenario(base: Scenario, key: str, value, drop_index: int, seed: int) -> Scenario:
    """The scenario of one sweep point and drop (`key` as `sweep_key` returns it)."""
    data = base.model_dump(exclude_none=True)
    head, _, rest = key.partition(".")
    if head == "drop":
        if base.drop is None:
            raise SimulationError(f"sweep key {key!r} needs a `drop:` section in the profile")
        data["drop"][rest] = value
        try:
            drop = DropSpec.model_validate(data["drop"])
        except ValueError as exc:
            raise SimulationError(f"sweep point {key}={value}: {exc}") from None
    else:
        drop = base.drop
    if drop is None:
        if key in ("devices", "acceptance"):
            raise SimulationError(f"sweep key {key!r} needs a `drop:` section in the profile")
        devices = data["devices"]
    else:
        n = int(value) if key == "devices" else drop.num_devices
        devices = draw_devices(drop, n, (seed, drop_index))
    if key == "acceptance":
        for d in devices:
            d["acceptance"] = float(value)
    elif key != "devices" and head != "drop":
        data[_FIELD.get(key, key)] = value
    data["devices"] = devices
    return Scenario.from_dict(data, source=f"sweep point {key}={value}")


def monte_carlo(sc: Scenario, ev: model.Evaluation, rounds: int, rng: np.random.Generator) -> dict:
    """Token-level simulation of `rounds` rounds of one plan: goodput and mean round time."""
    acc = sc.device_array("acceptance")
    tokens = np.zeros(sc.num_devices)
    time_k = np.zeros(sc.num_devices)
    total_T = 0.0
    per_round = []
    for _ in range(rounds):
        accepted = model.draw_accepted(rng, acc, ev.draft_lens)
        r = model.realized_round(sc, ev, accepted)
        tokens += r["tokens"]
        time_k += r["device_round_s"]
        total_T += r["round_time_s"]
        per_round.append(r["tokens"].sum() / r["round_time_s"])
    if sc.rounds == "synchronous":
        g = tokens.sum() / total_T
    else:
        g = float((tokens / time_k).sum())
    return dict(mc_goodput_tps=float(g), mc_round_time_s=total_T / rounds,
                mc_goodput_sem=float(np.std(per_round) / np.sqrt(rounds)))


def channel_monte_carlo(sc: Scenario, policy, gains_at: Callable, rounds: int, rng: np.random.Generator, *,
                        fixed_length: int = 4, seed: int = 0) -> dict:
    """Token-level simulation of `rounds` rounds on a channel: each round the channel's gains
    (``gains_at(round, t_s)``: name -> dB) replace the scenario's, the policy plans anew (the previous simulated
    round as its `RoundContext.previous`), accepted counts are drawn and the clock advances by the realized
    round time. Same columns as `monte_carlo`, plus the mean predicted goodput and UL devices per round."""
    tokens = np.zeros(sc.num_devices)
    time_k = np.zeros(sc.num_devices)
    total_T, t_s, previous = 0.0, 0.0, None
    per_round, predicted, num_ul = [], [], []
    for r in range(rounds):
        sc_r = sc.with_device_updates(channel_gain_db=dict(gains_at(r, t_s)))
        p = plan(sc_r, policy, fixed_length=fixed_length, seed=seed + r, round_index=r, previous=previous)
        ev, sc_p = p.evaluation, p.scenario  # the plan's own scenario: its upload format and acceptance
        accepted = model.draw_accepted(rng, sc_p.device_array("acceptance"), ev.draft_lens)
        real = model.realized_round(sc_p, ev, accepted)
        tokens += real["tokens"]
        time_k += real["device_round_s"]
        total_T += real["round_time_s"]
        per_round.append(real["tokens"].sum() / real["round_time_s"])
        predicted.append(ev.goodput_tps)
        num_ul.append(ev.num_ul_devices)
        previous = RoundOutcome(round=r, devices={
            n: DeviceResult(ev.modes[k], int(ev.draft_lens[k]), int(accepted[k]), int(real["tokens"][k]))
            for k, n in enumerate(ev.names)}, measured_round_s=real["round_time_s"],
            measured_goodput_tps=per_round[-1], predicted_goodput_tps=ev.goodput_tps)
        t_s += real["round_time_s"]
    g = tokens.sum() / total_T if sc.rounds == "synchronous" else float((tokens / time_k).sum())
    return dict(mc_goodput_tps=float(g), mc_round_time_s=total_T / rounds,
                mc_goodput_sem=float(np.std(per_round) / np.sqrt(rounds)),
                mc_predicted_goodput_tps=float(np.mean(predicted)), mc_num_ul_devices=float(np.mean(num_ul)))


def sweep_tasks(values: Iterable, drops: int) -> list[tuple[int, object, int]]:
    """The independent tasks of a sweep, (point index, value, drop), in the order their rows are written."""
    return [(pi, value, drop) for pi, value in enumerate(values) for drop in range(drops)]


def run_task(base: Scenario, key: str, point: int, value, drop: int, *, policies: list[str], seed: int = 0,
             monte_carlo_rounds: int = 0, fixed_length: int = 4, progress: Callable | None = None,
             channel: Callable | None = None) -> list[dict]:
    """The rows of one sweep point and drop, one per policy. Every random stream is seeded from (seed, point,
    drop) alone, so the rows are the same whichever process runs the task, and in whatever order.
    `channel(scenario, drop)` -> ``gains_at(round, t_s)``: the Monte Carlo rounds run on that channel,
    re-planned every round (`channel_monte_carlo`)."""
    sc = point_scenario(base, key, value, drop, seed)
    gains_at = channel(sc, drop) if channel is not None and monte_carlo_rounds > 0 else None
    rows = []
    for policy in policies:
        p = plan(sc, policy, fixed_length=fixed_length, seed=seed + drop)
        ev = p.evaluation
        label = policy if isinstance(policy, str) else policy_name(policy)  # a plug-in: its name
        row = dict(sweep_key=key, value=value, drop=drop, policy=label, num_devices=sc.num_devices,
                   goodput_tps=ev.goodput_tps, round_time_s=ev.round_time_s,
                   num_ul_devices=ev.num_ul_devices,
                   phase_uplink_s=ev.phases["uplink"], phase_verify_s=ev.phases["verify"],
                   phase_downlink_s=ev.phases["downlink"],
                   mean_draft_len=float(np.mean(ev.draft_lens)),
                   expected_tokens=float(ev.expected_tokens.sum()),
                   topk_k=payload.topk_of(p.scenario))  # the plan's upload: None dense, else top-k k
        if monte_carlo_rounds > 0:
            # Common random numbers: the same stream for every policy at one point and drop.
            rng = np.random.default_rng([seed, drop, point, 7])
            if gains_at is None:  # the plan's scenario: a top-k option's acceptance and payload
                row.update(monte_carlo(p.scenario, ev, monte_carlo_rounds, rng))
            else:
                row.update(channel_monte_carlo(sc, policy, gains_at, monte_carlo_rounds, rng,
                                               fixed_length=fixed_length, seed=seed + drop))
        rows.append(row)
        if progress:
            progress(1)
    return rows


def run_sweep(base: Scenario, key: str, values: Iterable, *, drops: int = 5,
              policies: list[str] | None = None, seed: int = 0, monte_carlo_rounds: int = 0,
              fixed_length: int = 4, progress: Callable | None = None,
              map_tasks: Callable | None = None, channel: Callable | None = None) -> list[dict]:
    """Rows: one per (point, drop, policy), in point, drop, policy order. `progress(n)` is called after each
    plan when the tasks run here. `map_tasks(task, tasks)` runs them elsewhere (processes, a cluster): it
    calls `task(*t)` for each t of `tasks` and returns the results in the order of `tasks`. `channel`: see
    `run_task` (it travels to the workers, so a picklable callable). Policies: names in POLICIES or Policy
    objects (testbed.runtime.plugins.load_policy)."""
    policies = list(policies or DEFAULT_POLICIES)
    # a name in POLICIES, or a Policy object (a plug-in; testbed.runtime.plugins.load_policy)
    bad = [p for p in policies if isinstance(p, str) and p not in POLICIES or not isinstance(p, str)
           and not callable(getattr(p, "decide", None))]
    if bad:
        raise SimulationError(f"unknown policy {bad[0]!r}; allowed: {', '.join(POLICIES)}")
    key = sweep_key(key)
    if drops < 1:
        raise SimulationError(f"drops: {drops} is not allowed: must be >= 1")
    tasks = sweep_tasks(values, drops)
    task = partial(run_task, base, key, policies=policies, seed=seed, monte_carlo_rounds=monte_carlo_rounds,
                   fixed_length=fixed_length, channel=channel)
    if map_tasks is None:
        results = [task(*t, progress=progress) for t in tasks]
    else:
        results = list(map_tasks(task, tasks))
        if len(results) != len(tasks):
            raise SimulationError(f"map_tasks returned {len(results)} results for {len(tasks)} tasks")
    return [row for rows in results for row in rows]


def summarize(rows: list[dict]) -> dict:
    """{value: {policy: (mean goodput, mean K, mean MC goodput or None)}}."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["value"], {}).setdefault(r["policy"], []).append(r)
    summary = {}
    for v, per in out.items():
        summary[v] = {}
        for p, rs in per.items():
            mc = [r["mc_goodput_tps"] for r in rs if "mc_goodput_tps" in r]
            summary[v][p] = (float(np.mean([r["goodput_tps"] for r in rs])),
                             float(np.mean([r["num_ul_devices"] for r in rs])),
                             float(np.mean(mc)) if mc else None)
    return summary


def _shown(value) -> str:
    """A sweep value as the table writes it: a number in %g, a name as it is."""
    return format(value, "g") if isinstance(value, (int, float)) else str(value)


def summary_table(rows: list[dict]) -> str:
    """Mean goodput per policy per point, K* of `proposed`, and how proposed compares with the best
    other policy (a ratio < 1 means another policy beat it on average)."""
    s = summarize(rows)
    key = rows[0]["sweep_key"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    has_mc = any("mc_goodput_tps" in r for r in rows)
    width = max(12, *(len(p) for p in policies)) + 1
    kw = max(12, len(key), *(len(_shown(v)) for v in s))
    head = (f"{key:>{kw}} " + "".join(f"{p:>{width}}" for p in policies)
            + f"{'K*':>7}{'best other':>{width}}{'prop/best':>10}")
    lines = ["mean goodput, tokens/s (K* = mean UL devices of `proposed`)", head]
    for v, per in s.items():
        line = f"{_shown(v):>{kw}} " + "".join(f"{per[p][0]:>{width}.2f}" for p in policies)
        k = f"{per['proposed'][1]:.1f}" if "proposed" in per else "-"
        others = {p: per[p][0] for p in policies if p != "proposed"}
        best = max(others, key=others.get) if others else "-"
        # '-' where there is nothing to compare: no proposed, or no other policy (not "nan").
        ratio = f"{per['proposed'][0] / others[best]:.4f}" if "proposed" in per and others and others[best] else "-"
        line += f"{k:>7}{best:>{width}}{ratio:>10}"
        lines.append(line)
    if has_mc:
        lines.append("Monte Carlo goodput (token-level, realized DL set), tokens/s")
        for v, per in s.items():
            lines.append(f"{_shown(v):>{kw}} " + "".join(
                f"{(per[p][2] if per[p][2] is not None else float('nan')):>{width}.2f}" for p in policies))
    return "\n".join(lines)
