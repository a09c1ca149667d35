"""The upload format as part of the plan: dense, or top-k with k chosen each round (`topk_choices`).

An option o is dense (None) or a k: every device of the round drafts from q truncated to its top k entries
(`sampling.DraftParams`), so a UL-mode device uploads k (b_id + b_p) bits per position instead of V b_p,
at the acceptance alpha_k of the truncated q; a DL-mode device uploads the same few scalars either way.
One option per round (uniform k): then each option is an ordinary scenario (payload_format, topk_k and every
device's acceptance set to the option's), the policy plans it unchanged, and the model evaluates it exactly.
`best_plan` plans every option and keeps the best predicted goodput (dense on a tie), so a round with
choices is never predicted worse than the dense plan. The price: a device cannot be dense while another
uploads top-k in the same round (a DL-mode device of a top-k round drafts from the truncated q too).

alpha under k: the caller's estimates (the live controller learns them per (device, k), its prior the
ratios a run calibrates before round 0 with `topk_acceptance`), else the scenario's prior
`topk_acceptance_ratio[k]` x acceptance (a k without an entry: ratio 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from testbed.core.scenario import Scenario

DENSE = None
ALPHA_MIN, ALPHA_MAX = 1e-3, 1.0 - 1e-3  # the model needs alpha in (0, 1) (as Scenario.with_device_updates)


def topk_of(sc: Scenario) -> int | None:
    """The k a scenario's devices draft and upload with, or None (dense): topk_k with payload_format topk,
    unless k >= V (then top-k is the whole distribution and the model counts it dense)."""
    return sc.topk_k if sc.payload_format == "topk" and sc.topk_k < sc.vocab_size else None


def options(sc: Scenario) -> list[int | None]:
    """The options a plan chooses among: dense and each k of `topk_choices` below V (ascending); without
    choices, the scenario's own format alone."""
    if sc.topk_choices:
        return [DENSE, *sorted(k for k in set(sc.topk_choices) if k < sc.vocab_size)]
    return [topk_of(sc)]


def ratio(sc: Scenario, k: int | None) -> float:
    """The prior alpha_k / alpha of a k (1 for dense and for a k without an entry)."""
    return 1.0 if k is None else float(sc.topk_acceptance_ratio.get(int(k), 1.0))


def unmodelled(sc: Scenario) -> list[int]:
    """The top-k options whose acceptance loss the scenario does not give (`topk_acceptance_ratio`): planned
    offline as if top-k lost nothing (a live run calibrates them on its pair)."""
    return [k for k in options(sc) if k is not None and int(k) not in sc.topk_acceptance_ratio]


def prior_acceptance(sc: Scenario, k: int | None, acceptance=None) -> np.ndarray:
    """Per device, alpha under option k from the (dense) `acceptance` (default: the scenario's) and the ratio."""
    a = sc.device_array("acceptance") if acceptance is None else np.asarray(acceptance, float)
    return np.clip(a * ratio(sc, k), ALPHA_MIN, ALPHA_MAX)


def option_scenario(sc: Scenario, k: int | None, acceptance: Mapping[str, float] | None = None) -> Scenario:
    """The scenario of one option: its payload format and k, and every device's acceptance under it (the
    given estimates, name -> alpha, else the prior). A plain scenario: no choices, no ratios left to apply."""
    alpha = dict(zip([d.name for d in sc.devices], prior_acceptance(sc, k).tolist()))
    if acceptance:
        alpha.update({n: float(a) for n, a in acceptance.items() if n in alpha})
    same_format = sc.payload_format == "dense" if k is None else (sc.payload_format == "topk" and sc.topk_k == k)
    if (same_format and not sc.topk_choices and not sc.topk_acceptance_ratio
            and all(d.acceptance == alpha[d.name] for d in sc.devices)):
        return sc  # already that plain scenario: a rebuild would validate every device again for nothing
    data = sc.model_dump(exclude_none=True)
    data.update(payload_format="dense" if k is None else "topk", topk_choices=(), topk_acceptance_ratio={})
    if k is not None:
        data["topk_k"] = int(k)
    else:
        data.pop("topk_k", None)  # a dense scenario reads no k (and refuses one)
    option = Scenario.from_dict(data, source=f"payload option {'dense' if k is None else f'topk {k}'}")
    return option.with_device_updates(acceptance=alpha)


def is_plain(sc: Scenario, acceptance_by_option: Mapping | None = None) -> bool:
    """Whether planning `sc` involves no choice and no change of acceptance: one option, no estimates for
    it and no prior ratio (then the plan is the policy's plan of `sc` itself)."""
    opts = options(sc)
    return len(opts) == 1 and not (acceptance_by_option or {}).get(opts[0]) and ratio(sc, opts[0]) == 1.0


def best_plan(sc: Scenario, plan_one: Callable, acceptance_by_option: Mapping | None = None, *,
              infeasible: type[Exception] = ValueError):
    """Plan every option (`plan_one(option scenario)` -> a Plan) and return the one with the highest predicted
    goodput (the earlier option on a tie: dense first, then the smaller k), with ``info["payload"]``:
    format, k and every option's goodput (None: no feasible schedule). `acceptance_by_option`:
    k -> {device name: alpha under k} (the live estimates); options without one use the prior. Raises the
    first option's `infeasible` error when no option has a feasible plan."""
    tried, best, first_error = [], None, None
    for k in options(sc):
        try:
            p = plan_one(option_scenario(sc, k, (acceptance_by_option or {}).get(k)))
        except infeasible as exc:
            first_error = first_error or exc
            tried.append({"k": k, "goodput_tps": None})
            continue
        tried.append({"k": k, "goodput_tps": float(p.goodput_tps)})
        if best is None or p.goodput_tps > best.goodput_tps:
            best = p
    if best is None:
        raise first_error
    k = topk_of(best.scenario)
    best.info["payload"] = {"format": "dense" if k is None else "topk", "k": k, "options": tried}
    return best


def topk_acceptance(p_rows, q_rows, ks) -> dict:
    """The expected acceptance of a draft token sampled from q truncated to its top k, per k: the mean over
    rows of sum_x min(p(x), q_k(x)) (speculative sampling accepts with exactly that probability), with q_k as
    `sampling.truncate_top_k` makes it (ties towards the lower index). Key None: the dense q. `p_rows`,
    `q_rows`: (n, V) distributions (each row normalized here); a k >= V is the dense q."""
    p = np.asarray(p_rows, float)
    q = np.asarray(q_rows, float)
    if p.ndim != 2 or p.shape != q.shape or p.shape[0] < 1:
        raise ValueError(f"p_rows {p.shape}, q_rows {q.shape}: need two (n, V) arrays of the same shape, n >= 1")
    p = p / p.sum(axis=1, keepdims=True)
    q = q / q.sum(axis=1, keepdims=True)
    order = np.argsort(-q, axis=1, kind="stable")
    qs, ps = np.take_along_axis(q, order, axis=1), np.take_along_axis(p, order, axis=1)
    mass = np.cumsum(qs, axis=1)
    out = {DENSE: float(np.minimum(p, q).sum(axis=1).mean())}
    for k in sorted({int(k) for k in ks if k is not None}):
        if k < 1:
            raise ValueError(f"k={k}: must be >= 1")
        if k >= q.shape[1]:
            out[k] = out[DENSE]
            continue
        kept = qs[:, :k] / mass[:, k - 1:k]
        out[k] = float(np.minimum(ps[:, :k], kept).sum(axis=1).mean())
    return out


def ratios(acceptance: Mapping) -> dict[int, float]:
    """k -> alpha_k / alpha (dense) from `topk_acceptance`'s result (a dense acceptance of 0: ratio 1)."""
    dense = acceptance[DENSE]
    return {k: (float(a) / dense if dense > 0 else 1.0) for k, a in acceptance.items() if k is not None}


def unmodelled_note(sc: Scenario) -> str | None:
    """The warning `plan` and `simulate` print for `unmodelled` options; None when every option's loss is given."""
    ks = unmodelled(sc)
    if not ks:
        return None
    return (f"top-k k={', '.join(map(str, ks))}: no topk_acceptance_ratio, planned as if top-k lost no acceptance "
            "(it does: alpha_k < alpha); give measured ratios, e.g. a live run's meta.json calibration.topk.ratio "
            "(--set scenario.topk_acceptance_ratio={16: 0.56, 64: 0.73})")
