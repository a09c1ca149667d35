"""Calibration of the top-k acceptance before round 0: alpha_k / alpha per k of the run's top-k options.

A top-k upload makes every device draft from q truncated to its k largest entries, at a lower acceptance
alpha_k = E[sum_x min(p, q_k)] (docs/system-model.md, section 3). How much lower depends on the pair and
the sampling, so the run measures it: `calibrate_topk_acceptance` drafts a few rounds from each device's
prompt with the run's own draft model and sampling, verifies them with the target, and averages
sum_x min(p, q_k) over every drafted position for dense and each k (`testbed.core.payload.topk_acceptance`).
The ratios alpha_k / alpha are the controller's prior for each k (`Controller.calibrate_topk`), which its
rounds then refine per device and k.

The drafter is passed in (the run's `device_node.drafter.OnnxDrafter`); imports no torch itself.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from testbed.core import payload
from testbed.core.sampling import RoundRandomness, speculative_round, to_probs

log = logging.getLogger("multispin.edge")

SESSION_PREFIX = "topk-calibration#"
ROUNDS = 4  # rounds per prompt: with 4 prompts and L = 8, 128 positions (the ratio's spread: a few %)


def calibrate_topk_acceptance(drafter, verifier, prompts: list[list[int]], ks, params, *, draft_len: int,
                              rounds: int = ROUNDS, seed: int = 0) -> dict:
    """Draft `rounds` rounds of `draft_len` tokens from each prompt (dense q, the run's sampling `params`),
    verify and continue each as a UL-mode round does, and measure the acceptance under every k of `ks`.
    Returns {acceptance: {"dense": a, "<k>": a_k}, ratio: {k: a_k / a}, positions, took_s}. Opens verifier
    sessions `topk-calibration#<i>` and closes them all, whatever happens."""
    start = time.perf_counter()
    p_rows, q_rows = [], []
    names = [f"{SESSION_PREFIX}{i}" for i in range(len(prompts))]
    try:
        for name, prompt in zip(names, prompts):
            verifier.open(name, list(prompt))
            drafter.reset(list(prompt))
            pending: list[int] = []
            for r in range(max(1, int(rounds))):
                rr = RoundRandomness(seed, name, r)
                d = drafter.draft(int(draft_len), params, rr.draft_generator())
                logits = verifier.verify([(name, pending, list(d.tokens))])[0]
                p = to_probs(np.asarray(logits, dtype=np.float32), params).astype(np.float64)
                n, token = speculative_round(d.tokens, d.q, p, rr)
                verifier.commit(name, n)
                drafter.commit(n, token)
                pending = [token]
                p_rows.append(p[:len(d.tokens)])
                q_rows.append(np.asarray(d.q, np.float64))
    finally:
        for name in names:
            verifier.close(name)
    acceptance = payload.topk_acceptance(np.concatenate(p_rows), np.concatenate(q_rows), ks)
    took = time.perf_counter() - start
    ratio = payload.ratios(acceptance)
    log.info("top-k acceptance calibrated in %.2f s over %d positions: dense %.3f; %s", took,
             sum(len(x) for x in p_rows), acceptance[payload.DENSE],
             ", ".join(f"k={k} {a:.3f} (ratio {ratio[k]:.3f})" for k, a in acceptance.items() if k is not None))
    return {"acceptance": {("dense" if k is None else str(k)): a for k, a in acceptance.items()},
            "ratio": ratio, "positions": int(sum(len(x) for x in p_rows)), "took_s": took}
