"""The acceptance of a device under each top-k option, from its rounds of every option (pure).

Model: alpha_k = r_k x alpha, with alpha the device's dense acceptance and r_k the ratio of k (calibrated
before round 0, `edge_node.topk_calibration`, else the scenario's `topk_acceptance_ratio`). A round drafted
under k' with s accepted out of n Bernoulli trials is, in expectation, s / r_k' successes of the dense alpha
in n trials, so every option's rounds inform the dense alpha and through it the prior of every other k (an
option the plan never tried still learns the device). Each k then has a Beta posterior around that prior
mean, with the profile's `alpha_prior_trials` pseudo-trials, that its own rounds refine (a ratio that is off
for one k is corrected by that k's rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from testbed.core.payload import ALPHA_MAX, ALPHA_MIN


def dense_alpha(est, topk_trials: Mapping[tuple[str, int], list], name: str, ratio: Callable[[int], float],
                skip: int | None = None) -> float:
    """The dense alpha's posterior mean of device `name`: its dense rounds (`est`: alpha_prior, prior_trials,
    successes, trials, as `edge_node.controller.DeviceEstimate`) and its rounds under each k but `skip`
    (`topk_trials`: (name, k) -> [successes, trials]), each success under k counting 1 / r_k."""
    counts = [(k, c) for (n, k), c in topk_trials.items() if n == name and k != skip]
    s = est.alpha_prior * est.prior_trials + est.successes + sum(c[0] / max(ratio(k), ALPHA_MIN) for k, c in counts)
    n = est.prior_trials + est.trials + sum(c[1] for _, c in counts)
    return float(np.clip(est.alpha_prior if n <= 0 else s / n, ALPHA_MIN, ALPHA_MAX))


def alpha_under(k: int, dense: float, prior_trials: float, counts: tuple[float, float] | None,
                ratio: Callable[[int], float]) -> float:
    """alpha under k: Beta posterior of k's own rounds (`counts`: successes, trials) around r_k x `dense`."""
    prior = float(np.clip(dense * ratio(k), ALPHA_MIN, ALPHA_MAX))
    s, n = counts or (0.0, 0.0)
    total = prior_trials + n
    return prior if total <= 0 else float(np.clip((prior * prior_trials + s) / total, ALPHA_MIN, ALPHA_MAX))
