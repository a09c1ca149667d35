"""Downlink power allocation (spec section 7): minimise the DL phase max_k S_k / r^D_k over a DL set.

Notation: W is each DL device's bandwidth, N0 the noise PSD, P_s the edge's total power. At the optimum
all DL latencies are equal to some tau. With x = 1 / (W tau) (bits per Hz-second per payload bit),
p_k = (N0 W / g_k) (2^(S_k x) - 1), and sum_k p_k = P_s reads
    F(x) = sum_k (1 / g_k) (2^(S_k x) - 1) = R := P_s / (N0 W).
The solver works on h(x) = log(sum_k (1 / g_k) 2^(S_k x)) = log(sum_k 1/g_k + R) instead: h is a
log-sum-exp of affine functions of x, hence convex and increasing, and it never overflows. Newton on a
convex increasing function from a point right of the root descends monotonically onto it; far from the
root h is almost affine, so a step lands near the root whatever the payloads (ratios of 10^6 and more).
Near the root the step is the plain Newton step on F (computed with expm1, no cancellation), so the
convergence is quadratic. A bracket [lo, hi] guards every step.
"""

from __future__ import annotations

import numpy as np

LN2 = float(np.log(2.0))
_EXP_SAFE = 500.0  # exponents up to this are summed directly (e^500 * 1e80 is still finite)


class DlPowerError(ValueError):
    """DL power inputs that have no meaningful allocation (non-positive power, gain, bandwidth or noise)."""


def dl_power_channel_inversion(payload_bits: float, gains, bandwidth_hz: float, total_power_w: float,
                               noise_psd_w_hz: float):
    """Equal payloads S: p_k = P_s g_k^-1 / sum_j g_j^-1 and tau = S / (W log2(1 + P_s/(N0 W sum 1/g)))."""
    inv = 1.0 / np.asarray(gains, dtype=float)
    powers = total_power_w * inv / inv.sum()
    tau = payload_bits / (bandwidth_hz * np.log1p(total_power_w / (noise_psd_w_hz * bandwidth_hz
                                                                   * inv.sum())) / LN2)
    return powers, float(tau)


def dl_power_bisection(payload_bits, gains, bandwidth_hz: float, total_power_w: float,
                       noise_psd_w_hz: float, iters: int = 200):
    """Reference solver: geometric bisection on tau until sum_k p_k(tau) = P_s. Slow and simple.

    The bracket is channel inversion with the smallest and the largest payload; the power sum is
    evaluated directly (it may overflow to inf, which only means "too much power")."""
    s = np.asarray(payload_bits, dtype=float)
    g = np.asarray(gains, dtype=float)
    if s.size == 0 or not np.any(s > 0):
        return np.zeros(s.size), 0.0
    pos = s > 0
    scale = noise_psd_w_hz * bandwidth_hz / g
    need = lambda tau: float(np.sum(scale[pos] * np.expm1(LN2 * s[pos] / (bandwidth_hz * tau))))
    rate = bandwidth_hz * np.log1p(total_power_w / (noise_psd_w_hz * bandwidth_hz * np.sum(1.0 / g[pos]))) / LN2
    lo, hi = s[pos].min() / rate, s[pos].max() / rate
    with np.errstate(over="ignore"):
        for _ in range(iters):
            mid = float(np.sqrt(lo * hi))
            if not lo < mid < hi:
                break
            if need(mid) > total_power_w:
                lo = mid
            else:
                hi = mid
        tau = hi
        p = np.where(pos, scale * np.expm1(LN2 * s / (bandwidth_hz * tau)), 0.0)
    return p, float(tau)


def _h_step(x, a, w, wa, wr, r, active, big):
    """(d, step) at x: d = h(x) - log(wsum + R), whose sign says on which side of the root x lies, and the
    Newton step d / h'(x). Rows are the leading axes, payload values the last one; wa = w a, wr = wsum + R.
    Call under np.errstate(divide="ignore", invalid="ignore") (rows without an active entry are unused)."""
    ax = a * x[..., None]
    em1 = np.expm1(np.minimum(ax, _EXP_SAFE) if big else ax)
    f = (w * em1).sum(-1)                          # F(x), exact while no exponent is large
    d = np.log1p((f - r) / wr)
    step = d * (wr - r + f) / (wa * em1 + wa).sum(-1)  # d / h'(x), h' = F' / (wsum + F)
    if big and ax.max(initial=0.0) > _EXP_SAFE:    # log-sum-exp form where 2^(S x) would overflow
        t = np.where(active, np.log(np.where(active, w, 1.0)) + ax, -np.inf)
        top = t.max(-1)
        top = np.where(np.isfinite(top), top, 0.0)  # rows without an active entry
        e = np.exp(t - top[..., None])
        s0 = e.sum(-1)
        small = np.where(active, ax, -np.inf).max(-1) <= _EXP_SAFE
        d = np.where(small, d, top + np.log(s0) - np.log(wr))
        step = np.where(small, step, d * s0 / (a * e).sum(-1))
    return d, step


def log1p_ratio(r, w):
    """ln(1 + r / w) for r >= 0, w > 0, finite where r / w overflows: a gain near the optimizer's cap (1e300,
    the equivalent gain of a fixed DL rate far above what the band carries, such as a measured loopback link)
    makes a sum of 1/g tiny. Where r / w is finite, exactly np.log1p(r / w)."""
    r, w = np.asarray(r, dtype=float), np.asarray(w, dtype=float)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        ratio = r / w
        big = np.isinf(ratio) & np.isfinite(r) & (w > 0)
        if not big.any():
            return np.log1p(ratio)
        return np.where(big, np.logaddexp(0.0, np.log(r) - np.log(w)), np.log1p(ratio))


def solve_x(weights, payload_bits, target, iters: int = 100, rtol: float = 2.5e-16, x0=None):
    """Vectorised root of F(x) = sum_v w_v (2^(u_v x) - 1) = R over the last axis.

    weights: (..., nv) non-negative (sums of 1/g over devices with payload u_v); payload_bits: (nv,) or
    (..., nv), non-negative; target R: (...) or scalar. Entries with w_v = 0 or u_v = 0 take no power.
    Rows without such an entry return x = inf (no DL device: tau = 0); rows with R <= 0 return x = 0
    (no power: tau = inf). Newton on the convex h(x) (module docstring) from an upper bound of the root,
    log2(1 + R/sum w) / u_mean with u_mean the w-weighted mean payload (Jensen), or `x0` where a caller
    knows a smaller one, clamped to the lower bound log2(1 + R/sum w) / u_max; a row stops when its step
    is below the last ulps. Finite for any finite positive inputs; typically 3 to 6 steps, about 20
    at most with payloads 10^6 apart and gains 140 dB apart."""
    w = np.asarray(weights, dtype=float)
    u = np.asarray(payload_bits, dtype=float)
    active = (w > 0) & (u > 0)
    w = np.where(active, w, 0.0)
    wsum = w.sum(-1)
    r = np.broadcast_to(np.asarray(target, dtype=float), wsum.shape)
    ok = (wsum > 0) & (r > 0)
    wsum_s = np.where(ok, wsum, 1.0)
    r_s = np.where(ok, r, 1.0)
    a = u * LN2
    wa = w * a
    with np.errstate(divide="ignore", invalid="ignore"):
        base = log1p_ratio(r_s, wsum_s)  # ln(1 + R / sum w); x = base / (u ln 2) for equal payloads u
        lo = np.where(ok, base / np.where(active, a, 0.0).max(-1), 0.0)
        # Jensen: F(x) >= sum w (2^(u_mean x) - 1), so the root is at most base / (u_mean ln 2)
        x = np.where(ok, base * wsum_s / wa.sum(-1), 0.0)
        if x0 is not None:  # a caller's upper bound (e.g. the root before payloads grew)
            x = np.where(ok & (np.asarray(x0) < x) & (np.asarray(x0) >= lo), x0, x)
        # x only falls from its start (but for a few ulps): the overflow-safe form is needed only if
        # the largest exponent can exceed the safe range there
        big = bool((a.max(initial=0.0) * x.max(initial=0.0)) > _EXP_SAFE)
        wr = wsum_s + r_s
        done = ~ok | (x <= lo)  # equal payloads: the bracket is the root (channel inversion)
        right = np.ones(x.shape, bool)
        for _ in range(iters):
            if done.all():
                break
            d, step = _h_step(x, a, w, wa, wr, r_s, active, big)
            # Left of the root (x - step can cancel to a few ulps of a much smaller x) the step points
            # right; back on the right after that, a step of a few ulps is rounding going back and forth.
            size = np.abs(step)
            done |= (d == 0) | ~(size > rtol * x) | ((d > 0) & ~right & (size <= 64 * rtol * x))
            right = d > 0
            x = np.where(done, x, np.maximum(x - step, lo))
    return np.where(wsum <= 0, np.inf, np.where(ok, x, 0.0))


def optimal_dl_powers(payload_bits, gains, bandwidth_hz: float, total_power_w: float,
                      noise_psd_w_hz: float):
    """Optimal DL powers for one DL set (all at bandwidth W): returns (powers, tau).

    Devices with a zero payload get no power; a set without payload has tau = 0. Raises DlPowerError for
    a non-positive or non-finite power, bandwidth, noise density or gain, or a negative payload."""
    s = np.asarray(payload_bits, dtype=float)
    g = np.asarray(gains, dtype=float)
    if s.shape != g.shape:
        raise DlPowerError(f"payload_bits has shape {s.shape} but gains has shape {g.shape}")
    if s.size == 0:
        return np.zeros(0), 0.0
    for name, v in (("bandwidth_hz", bandwidth_hz), ("total_power_w", total_power_w),
                    ("noise_psd_w_hz", noise_psd_w_hz)):
        if not (np.isfinite(v) and v > 0):
            raise DlPowerError(f"{name}: {v!r} is not allowed: must be a finite number > 0")
    if not np.all(np.isfinite(g) & (g > 0)):
        raise DlPowerError(f"gains: {g.tolist()} are not allowed: each must be a finite number > 0")
    if not np.all(np.isfinite(s) & (s >= 0)):
        raise DlPowerError(f"payload_bits: {s.tolist()} are not allowed: each must be a finite number >= 0")
    if not np.any(s > 0):
        return np.zeros(s.size), 0.0
    r = total_power_w / (noise_psd_w_hz * bandwidth_hz)
    x = float(solve_x(1.0 / g, s, r))
    with np.errstate(over="ignore"):
        powers = (noise_psd_w_hz * bandwidth_hz / g) * np.expm1(s * x * LN2)
    total = powers.sum()
    if np.isfinite(total) and total > 0:
        powers *= total_power_w / total  # remove the last ulp of drift so the budget holds exactly
    else:  # only reachable with astronomically large R: fall back to the log-space shares
        logp = np.where(s > 0, s * x * LN2 - np.log(g), -np.inf)
        powers = total_power_w * np.exp(logp - logp.max()) / np.exp(logp - logp.max()).sum()
    return powers, float(1.0 / (bandwidth_hz * x))
