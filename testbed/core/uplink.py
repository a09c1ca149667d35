"""The shared uplink band (`ul_access: fdma_shared`): the min-max split of a total band B among the devices.

Each device k uploads S_k bits after c_k seconds of drafting at power p_k over its share b_k of the band:

    tau_k(b_k) = c_k + S_k / r_k(b_k),   r_k(b) = b log2(1 + a_k / b),   a_k = p_k g_k / N_0  (Hz)

and the split minimises the uplink phase max_k tau_k(b_k) subject to sum_k b_k = B, b_k >= b_min. r_k grows
with b (towards a_k / ln 2), so every tau_k falls with b_k, and at the optimum every device above its minimum
share finishes at one common time U. For a deadline U device k needs the band

    b_k(U) = max(b_min, beta(S_k / (U - c_k), a_k)),   beta(rho, a) = the b with b log2(1 + a / b) = rho,

convex and decreasing in U, so F(U) = sum_k b_k(U) - B is convex and decreasing and U* is its root: Newton
from a point left of the root (the time of the device that is slowest with all the band the others leave it)
climbs onto it monotonically, never overshooting (`split`). beta has no closed form without Lambert's W;
with x = a / b it is the positive root of ln(1 + x) = c x, c = rho ln 2 / a in (0, 1) (`band_for_rate_hz`),
solved by Newton from the right of the root.

A device whose upload time does not depend on its band (S_k = 0 here: a given rate, or nothing to send)
keeps b_min and bounds U from below by c_k. Pure numpy, vectorised over leading axes (rows of candidates).
"""

from __future__ import annotations

import numpy as np

LN2 = float(np.log(2.0))


def band_for_rate_hz(rate_bps, snr_hz, iters: int = 60):
    """The band b with b log2(1 + a / b) = rate, a = p g / N_0 (Hz): 0 for rate 0, inf where rate >= a / ln 2
    (no band is enough: the rate of an infinite band at that power). Vectorised."""
    rho = np.asarray(rate_bps, float)
    a = np.asarray(snr_hz, float)
    rho, a = np.broadcast_arrays(rho, a)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = rho * LN2 / a
    ok = (c > 0) & (c < 1)
    cc = np.where(ok, c, 0.5)
    # Start right of the root of h(x) = ln(1 + x) - c x (concave): ln(1 + x) <= sqrt(x) gives x = 1 / c^2;
    # near c = 1, ln(1 + x) <= x - x^2 / 6 on [0, 1] gives x = 6 (1 - c). Newton then descends onto the root.
    # For small c, (2 / c) ln(2 / c) is right of the root too (with y = 2 / c >= 2, 1 + y ln y < y^2) and much
    # nearer: fewer Newton steps.
    x = np.minimum(1.0 / cc ** 2, (2.0 / cc) * np.log(2.0 / cc))
    near = 6.0 * (1.0 - cc)
    x = np.where(near <= 1.0, np.minimum(x, near), x)
    for _ in range(iters):
        lg = np.log1p(x)
        h = lg - cc * x
        dh = 1.0 / (1.0 + x) - cc
        step = h / dh
        x_new = np.maximum(x - step, 0.5 * x)  # stays right of 0 (the trivial root)
        # Done when no step moves x by more than 2 ulp, or h is at the level of its own rounding (near c = 1
        # h is a difference of two nearly equal terms and Newton then hops between neighbouring floats: it
        # used to run all `iters` steps there). Newton converges quadratically: this step lands on the root.
        if np.all((np.abs(x_new - x) <= 4e-16 * x) | (np.abs(h) <= 1e-15 * (lg + cc * x))):
            x = x_new
            break
        x = x_new
    with np.errstate(divide="ignore", invalid="ignore"):
        b = a / x
    return np.where(ok, b, np.where(rho <= 0, 0.0, np.inf))


def rate_bps(band_hz, snr_hz):
    """r = b log2(1 + a / b) (a = p g / N_0); 0 for b = 0."""
    b = np.asarray(band_hz, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = b * np.log1p(np.asarray(snr_hz, float) / b) / LN2
    return np.where(b > 0, r, 0.0)


def split(bits, before_s, snr_hz, total_hz: float, min_hz: float, iters: int = 100, start_s=None):
    """The min-max split of `total_hz` over the last axis: (bands (..., N), U (...)), sum of bands = B exactly.

    bits S_k >= 0 (0: the device's time does not depend on its band), before_s c_k (drafting, and for a given
    rate its air time), snr_hz a_k = p_k g_k / N_0. Requires N b_min <= B. U is the uplink phase the split
    reaches (max_k tau_k); the bands give each device above b_min that time up to rounding. start_s (...): a
    known lower bound of U (a warm start: the U of a problem whose S_k and c_k are all at most these; U only
    grows with them), where Newton starts if it is above the cold start."""
    S, c, a = np.broadcast_arrays(*(np.asarray(v, float) for v in (bits, before_s, snr_hz)))
    n = S.shape[-1]
    B, bmin = float(total_hz), float(min_hz)
    band = S > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        def tau(b):
            return c + np.where(band, S / rate_bps(b, a), 0.0)
        # U* is at least the slowest device's time with all the band the others leave it, at most the
        # slowest time of the equal split (feasible: b_min <= B / N)
        U = tau(np.full(S.shape, B - (n - 1) * bmin)).max(-1)
        if start_s is not None:
            U = np.maximum(U, start_s)
        U_hi = tau(np.full(S.shape, B / n)).max(-1)
        done = np.zeros(U.shape, bool)
        for _ in range(iters):
            gap = U[..., None] - c
            rho = np.where(band, S / gap, 0.0)
            need = np.where(band, band_for_rate_hz(rho, a), 0.0)
            b = np.maximum(need, bmin)
            F = b.sum(-1) - B
            active = band & (need > bmin)
            x = a / np.where(active, need, 1.0)
            drho_db = np.log1p(x) / LN2 - x / ((1.0 + x) * LN2)
            dF = np.where(active, -(rho / gap) / drho_db, 0.0).sum(-1)
            step = np.where(dF < 0, -F / dF, 0.0)
            U_new = np.minimum(U + np.maximum(step, 0.0), np.maximum(U_hi, U))
            done |= (F <= 1e-13 * B) | (U_new - U <= 1e-15 * U)
            U = np.where(done, U, U_new)
            if done.all():
                break
        gap = U[..., None] - c
        need = np.where(band, band_for_rate_hz(np.where(band, S / gap, 0.0), a), 0.0)
        b = np.maximum(np.where(np.isfinite(need), need, B), bmin)
    # Newton stops within rounding of the root, on either side: rescale the shares above b_min so that the
    # band sums to B exactly (all at b_min: the rest equally)
    extra = b - bmin
    tot = extra.sum(-1, keepdims=True)
    free = B - n * bmin
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.where(tot > 0, bmin + extra * (free / tot), bmin + free / n)
    return b, tau(b).max(-1)


def demand(bits, before_s, snr_hz, deadline_s, min_hz: float):
    """Each device's band b_k(U) for the deadline U (as in `split`: at least b_min; inf where no band is enough)
    and its derivative db_k/dU (<= 0; 0 at b_min). F(U) = sum b_k(U) - B is convex, so F(U) + F'(U) (V - U)
    bounds F(V) from below: one Newton step from the left of a root stays left of it (the greedy's bounds,
    `optimizer._shared_neighbors`). Vectorised."""
    S, c, a, U = np.broadcast_arrays(*(np.asarray(v, float) for v in (bits, before_s, snr_hz, deadline_s)))
    band = S > 0
    gap = U - c
    late = band & (gap <= 0)  # the deadline is before the upload can start
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(band & ~late, S / gap, 0.0)
        need = np.where(band & ~late, band_for_rate_hz(rho, a), 0.0)
        need = np.where(late, np.inf, need)
        b = np.maximum(need, float(min_hz))
        active = band & np.isfinite(need) & (need > min_hz)
        x = a / np.where(active, need, 1.0)
        drho_db = np.log1p(x) / LN2 - x / ((1.0 + x) * LN2)
        db = np.where(active, -(rho / np.where(active, gap, 1.0)) / drho_db, 0.0)
    return b, db
