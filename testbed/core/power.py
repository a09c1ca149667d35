"""Downlink power allocation (spec section 7): minimise the DL phase max_k S_k / r^D_k over a DL set.

Notation: W is each DL device's bandwidth, N0 the noise PSD, P_s the edge's total power. At the optimum
all DL latencies are equal to some tau. With x = 1 / (W tau) (bits per Hz-second per payload bit),
p_k = (N0 W / g_k) (2^(S_k x) - 1), and sum_k p_k = P_s reads
    F(x) = sum_k (1 / g_k) (2^(S_k x) - 1) = R := P_s / (N0 W).
F is convex and increasing, so Newton from a point right of the root descends monotonically onto it.
"""

from __future__ import annotations

import numpy as np

from testbed.core import radio

LN2 = float(np.log(2.0))


def dl_power_channel_inversion(payload_bits: float, gains, bandwidth_hz: float, total_power_w: float,
                               noise_psd_w_hz: float):
    """Equal payloads S: p_k = P_s g_k^-1 / sum_j g_j^-1 and tau = S / (W log2(1 + P_s/(N0 W sum 1/g)))."""
    inv = 1.0 / np.asarray(gains, dtype=float)
    powers = total_power_w * inv / inv.sum()
    tau = payload_bits / (bandwidth_hz * np.log2(1.0 + total_power_w / (noise_psd_w_hz * bandwidth_hz
                                                                         * inv.sum())))
    return powers, float(tau)


def dl_power_bisection(payload_bits, gains, bandwidth_hz: float, total_power_w: float,
                       noise_psd_w_hz: float, iters: int = 200):
    """Reference solver: bisect on tau until sum_k p_k(tau) = P_s (spec section 7). Slow and simple."""
    s = np.asarray(payload_bits, dtype=float)
    g = np.asarray(gains, dtype=float)
    need = lambda tau: float(np.sum(radio.power_for_rate_w(bandwidth_hz, s / tau, g, noise_psd_w_hz)))
    lo, hi = 1e-12, 1.0
    while need(hi) > total_power_w:
        hi *= 2.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if need(mid) > total_power_w:
            lo = mid
        else:
            hi = mid
    tau = hi
    return radio.power_for_rate_w(bandwidth_hz, s / tau, g, noise_psd_w_hz), float(tau)


def solve_x(weights, payload_bits, target, iters: int = 100, rtol: float = 1e-13):
    """Vectorised root of F(x) = sum_v w_v (2^(u_v x) - 1) = R over the last axis.

    weights: (..., nv) non-negative (sums of 1/g over devices with payload u_v); payload_bits: (nv,) or
    (..., nv), positive; target R: (...). Rows whose weights are all zero return x = inf (no DL device).
    Newton from an upper bound, guarded by geometric bisection, so it converges even when the payloads
    differ by orders of magnitude."""
    w = np.asarray(weights, dtype=float)
    u = np.broadcast_to(np.asarray(payload_bits, dtype=float), w.shape)
    r = np.asarray(target, dtype=float)
    wsum = w.sum(axis=-1)
    empty = wsum <= 0
    wsum_safe = np.where(empty, 1.0, wsum)
    active = w > 0
    umin = np.where(active, u, np.inf).min(axis=-1)
    umax = np.where(active, u, 0.0).max(axis=-1)
    umin = np.where(empty, 1.0, umin)
    umax = np.where(empty, 1.0, umax)
    base = np.log2(1.0 + r / wsum_safe)
    hi = base / umin  # F(hi) >= R: every payload is at least umin
    lo = base / umax  # F(lo) <= R

    def f_and_df(x):
        e = np.exp2(np.minimum(u * x[..., None], 1000.0))
        return (w * (e - 1.0)).sum(-1) - r, (w * u * e).sum(-1) * LN2

    for it in range(iters):
        fh, dfh = f_and_df(hi)
        if np.all((np.abs(fh) <= rtol * r) | empty):
            break
        hi = np.maximum(hi - fh / np.where(dfh > 0, dfh, 1.0), lo)  # Newton: stays right of the root
        if it % 4 == 3:  # far from the root Newton creeps; a geometric bisection step bounds the work
            mid = np.sqrt(lo * hi)
            above = f_and_df(mid)[0] >= 0
            hi = np.where(above, mid, hi)
            lo = np.where(above, lo, mid)
    return np.where(empty, np.inf, hi)


def optimal_dl_powers(payload_bits, gains, bandwidth_hz: float, total_power_w: float,
                      noise_psd_w_hz: float):
    """Optimal DL powers for one DL set (all at bandwidth W): returns (powers, tau)."""
    s = np.asarray(payload_bits, dtype=float)
    g = np.asarray(gains, dtype=float)
    if s.size == 0:
        return np.zeros(0), 0.0
    r = total_power_w / (noise_psd_w_hz * bandwidth_hz)
    x = float(solve_x(1.0 / g, s, r))
    powers = (noise_psd_w_hz * bandwidth_hz / g) * (np.exp2(s * x) - 1.0)
    powers *= total_power_w / powers.sum()  # remove the last ulp of drift so the budget holds exactly
    return powers, float(1.0 / (bandwidth_hz * x))
