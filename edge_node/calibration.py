"""Calibration of the verification model before round 0: T_ver = t0 + t1 * sum_k (L_k + 1).

`calibrate_verification` times the target's batched verification (`Verifier.verify`, the very call a round
makes) at two or three batch shapes: one device at L = 1, all N devices at L = L_max, and one between, each
after a warm-up forward (the prompts' prefill), on synthetic sessions whose contexts are the run's prompts.
The median of a few repeats per shape (for a slow target the fastest of two), a least-squares line through them,
and the controller plans round 0 on it (`Controller.calibrate_verify`) until its online fit replaces it
(`Controller.observe_verify`).
`tools/calibrate_verifier.py` is the offline, finer version of the same measurement (a grid of shapes).

Works with any `edge_node.verifier.Verifier`; imports no torch itself.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import numpy as np

log = logging.getLogger("multispin.edge")

SESSION_PREFIX = "calibration#"
REPEATS = 3
# A forward slower than this is timed SLOW_REPEATS times per shape, and the fastest counts (a large target on a
# CPU: 26 s per forward was seen). One timing alone was as likely as not disturbed by the host's other load: the
# Qwen 1.5B target on a busy 2-core host timed 2.77 s at 5 positions, then verified 6-8 positions in 1.3-1.6 s
# in the rounds (round 0 predicted +149%); the fastest of two is the undisturbed forward a round mostly sees.
SLOW_FORWARD_S = 1.0
SLOW_REPEATS = 2
# A round's verification follows an idle wait (the devices draft and upload meanwhile): each timed forward here
# follows a pause too. Back to back, with the clocks up and the caches holding the weights, the default pair
# verified in half the time it took in the rounds that followed (4.4 against 9 ms at 10 positions on 2 cores).
PAUSE_S = 0.03


def shapes_for(n_devices: int, max_draft_len: int) -> list[tuple[int, int]]:
    """(devices, draft length) to time: 1 x 1, N x L_max and one between, without repeated position counts."""
    n, length = max(1, int(n_devices)), max(1, int(max_draft_len))
    out, seen = [], set()
    for shape in ((1, 1), ((n + 1) // 2, (length + 1) // 2), (n, length)):
        positions = shape[0] * (shape[1] + 1)
        if positions not in seen:
            seen.add(positions)
            out.append(shape)
    return out


def fit_line(x: list[float], y: list[float]) -> tuple[float, float, str]:
    """(t0, t1, how): least squares through the points (`fit`); a line through the origin (`origin`) when
    there is one x only or a term comes out negative (as `Controller.observe_verify` does)."""
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    if len(set(xs.tolist())) >= 2:
        t1, t0 = np.polyfit(xs, ys, 1)
        if t0 >= 0 and t1 >= 0:
            return float(t0), float(t1), "fit"
    return 0.0, float(max(0.0, np.sum(xs * ys) / np.sum(xs * xs))), "origin"


def calibrate_verification(verifier, n_devices: int, max_draft_len: int, prompts: list[list[int]], *,
                           repeats: int = REPEATS, seed: int = 0, pause_s: float = PAUSE_S) -> dict:
    """Time `verifier.verify` at `shapes_for(n_devices, max_draft_len)` and fit t0, t1. Returns
    {verify_t0_s, verify_t1_s, fit ("fit" or "origin"), shapes: [{devices, draft_len, positions, verify_s,
    repeats}], took_s}. Opens sessions `calibration#<i>` and closes them all, whatever happens."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    vocab = int(verifier.vocab_size)
    shapes = shapes_for(n_devices, max_draft_len)
    names = [f"{SESSION_PREFIX}{i}" for i in range(max(n for n, _ in shapes))]
    rows = []
    try:
        for i, name in enumerate(names):
            verifier.open(name, list(prompts[i % len(prompts)]))
        _round(verifier, names, max_draft_len, rng, vocab)  # warm-up: the prompts' prefill, the first forward
        slow = _round(verifier, names, max_draft_len, rng, vocab) > SLOW_FORWARD_S  # a second, steady state
        for n, length in shapes:
            times = [_round(verifier, names[:n], length, rng, vocab, pause_s)
                     for _ in range(SLOW_REPEATS if slow else repeats)]
            rows.append({"devices": n, "draft_len": length, "positions": n * (length + 1),
                         "verify_s": min(times) if slow else statistics.median(times), "repeats": len(times)})
    finally:
        for name in names:
            verifier.close(name)
    t0, t1, how = fit_line([r["positions"] for r in rows], [r["verify_s"] for r in rows])
    took = time.perf_counter() - start
    log.info("verification calibrated in %.2f s: t0 = %.3g s, t1 = %.3g s/position (%s; %s)", took, t0, t1, how,
             ", ".join(f"{r['devices']}x{r['draft_len']}: {1e3 * r['verify_s']:.1f} ms" for r in rows))
    return {"verify_t0_s": t0, "verify_t1_s": t1, "fit": how, "shapes": rows, "took_s": took}


def _round(verifier, names: list[str], draft_len: int, rng, vocab: int, pause_s: float = 0.0) -> float:
    """One batched verification of `names`, each with `draft_len` random drafts, after `pause_s` idle, then each
    commits none (the contexts stay as they were); returns its seconds, as a round times it (the call that
    returns the logits)."""
    items = [(name, [], rng.integers(0, vocab, size=draft_len).tolist()) for name in names]
    if pause_s > 0:
        time.sleep(pause_s)
    t = time.perf_counter()
    verifier.verify(items)
    took = time.perf_counter() - t
    for name in names:
        verifier.commit(name, 0)
    return took if math.isfinite(took) else 0.0
