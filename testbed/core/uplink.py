"""The shared uplink band (`ul_access: fdma_shared`): the min-max split of a total band B among the devices.

Each device k uploads S_k bits after c_k seconds of drafting at power p_k over its share b_k of the band:

    tau_k(b_k) = c_k + S_k / r_k(b_k),   r_k(b) = b log2(1 + a_k / b),   a_k = p_k g_k / N_0  (Hz)

and the split minimises the uplink phase max_k tau_k(b_k) subject to sum_k b_k = B, b_k >= b_min. r_k grows
with b (towards a_k / ln 2), so every tau_k falls with b_k, and at the optimum every device above its minimum
share finishes at one common time U. For a deadline U device k needs the band

    b_k(U) = max(b_min, beta(S_k / (U - c_k), a_k)),   beta(rho, a) = the b with b log2(1 + a / b) = rho,

convex and decreasing in U, so F(U) = sum_k b_k(U) - B is convex and decreasing and U* is its root. F is
also convex (and increasing) in V = 1 / U, so Newton in V from a point left of the root in U (the time of the
device that is slowest with all the band the others leave it, or the V-tangent's zero from the equal split's
time) climbs onto it monotonically, never overshooting (`split`). beta has no closed form without Lambert's
W; with x = a / b it is the positive root of ln(1 + x) = c x, c = rho ln 2 / a in (0, 1) (`band_for_rate_hz`),
solved by Newton from a tabulated start (two steps).

A device whose upload time does not depend on its band (S_k = 0 here: a given rate, or nothing to send)
keeps b_min and bounds U from below by c_k. Pure numpy, vectorised over leading axes (rows of candidates).
"""

from __future__ import annotations

import numpy as np

LN2 = float(np.log(2.0))


def _start_table(step: float = 0.002):
    """The root of ln(1 + x) = c x tabulated for the solver's start: ln x at points evenly spaced in
    w = ln(-ln c) (ln x is smooth in w at both ends: ~w + ln 2 as c -> 1, ~e^w as c -> 0), from x = 1e-9 to
    1e18. Linear interpolation in w starts Newton within 2e-5 (relative) of the root."""
    t = np.arange(np.log(1e-9), np.log(1e18), step / 8)  # ln x, dense
    x = np.exp(t)
    w = np.log(-np.log(np.log1p(x) / x))
    w_even = np.arange(w[0], w[-1], step)
    t_even = np.interp(w_even, w, t)
    return float(w_even[0]), float(step), t_even, np.diff(t_even)


_W0, _DW, _LNX, _DLNX = _start_table()
_C_MAX, _C_MIN = np.exp(-np.exp(_W0)), np.exp(-np.exp(_W0 + _DW * (_LNX.size - 1)))


def _root_start(cc):
    """A start for the root x of ln(1 + x) = c x (c in (0, 1)), and whether some entry is outside the table:
    the table (`_start_table`) where c is in its range, else a point right of the root."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = (np.log(-np.log(cc)) - _W0) / _DW
    i = np.clip(np.asarray(p).astype(np.intp), 0, _LNX.size - 2)
    x = np.exp(_LNX[i] + (p - i) * _DLNX[i])
    if cc.size == 0 or (cc.min() > _C_MIN and cc.max() < _C_MAX):
        return x, False
    # ln(1 + x) <= sqrt(x) gives x = 1 / c^2; near c = 1, ln(1 + x) <= x - x^2 / 6 on [0, 1] gives x = 6 (1 - c);
    # for small c, (2 / c) ln(2 / c) (with y = 2 / c >= 2, 1 + y ln y < y^2). All right of the root.
    far = np.minimum(1.0 / cc ** 2, (2.0 / cc) * np.log(2.0 / cc))
    near = 6.0 * (1.0 - cc)
    far = np.where(near <= 1.0, np.minimum(far, near), far)
    return np.where((cc > _C_MIN) & (cc < _C_MAX), x, far), True


def band_for_rate_hz(rate_bps, snr_hz, iters: int = 60):
    """The band b with b log2(1 + a / b) = rate, a = p g / N_0 (Hz): 0 for rate 0, inf where rate >= a / ln 2
    (no band is enough: the rate of an infinite band at that power). Vectorised; each entry's result is its
    own (the same whatever else is solved with it: `split` of one row alone or among others)."""
    rho = np.asarray(rate_bps, float)
    a = np.asarray(snr_hz, float)
    rho, a = np.broadcast_arrays(rho, a)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = rho * LN2 / a
    ok = (c > 0) & (c < 1)
    if ok.all():
        x = _root(c, iters)
    else:  # only the entries with a finite positive band (a shared uplink's demand tables: a third are not)
        x = np.ones(c.shape)
        x[ok] = _root(c[ok], iters)
    with np.errstate(divide="ignore", invalid="ignore"):
        b = a / x
    return np.where(ok, b, np.where(rho <= 0, 0.0, np.inf))


def _root(cc, iters: int):
    """The positive root x of ln(1 + x) = c x for each c in (0, 1), each entry on its own."""
    # Newton on h(x) = ln(1 + x) - c x (concave) from the tabulated start (within 2e-5 of the root; where that
    # start is left of the root the first step lands right of it, and from there Newton descends onto it)
    x, far = _root_start(cc)
    done = None
    for i in range(iters):
        lg = np.log1p(x)
        h = lg - cc * x
        step = h / (1.0 / (1.0 + x) - cc)
        x_new = x - step
        if far:  # from far right of the root: stay right of 0 (the trivial root); never binds near the root
            x_new = np.maximum(x_new, 0.5 * x)
        if i == 0:  # the start is ~1e-5 off: no test yet
            x = x_new
            continue
        # An entry is done after a step within 1e-8 of x: Newton converges quadratically (the relative error
        # after a step is at most about the square of the step's), so that step lands on the root to rounding.
        # Or once h is at the level of its own rounding (near c = 1 h is a difference of two nearly equal terms
        # and Newton then hops between neighbouring floats). Each entry stops on its own test.
        converged = np.abs(step) <= 1e-8 * x
        if not (converged if done is None else converged | done).all():
            converged |= np.abs(h) <= 1e-15 * (lg + cc * x)
        x = x_new if done is None else np.where(done, x, x_new)
        done = converged if done is None else done | converged
        if done.all():
            break
    return x


def rate_bps(band_hz, snr_hz):
    """r = b log2(1 + a / b) (a = p g / N_0); 0 for b = 0."""
    b = np.asarray(band_hz, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = b * np.log1p(np.asarray(snr_hz, float) / b) / LN2
    return np.where(b > 0, r, 0.0)


def _excess(U, S, c, a, band, B: float, bmin: float):
    """At deadlines U (...): each device's band need beta(S_k / (U - c_k), a_k) (0 where S_k = 0), F(U) =
    sum_k max(b_min, need_k) - B, dF/dU (<= 0), and each device's d max(b_min, need_k) / dU."""
    gap = U[..., None] - c
    rho = np.where(band, S / gap, 0.0)
    need = np.where(band, band_for_rate_hz(rho, a), 0.0)
    F = np.maximum(need, bmin).sum(-1) - B
    active = band & (need > bmin)
    x = a / np.where(active, need, 1.0)
    drho_db = np.log1p(x) / LN2 - x / ((1.0 + x) * LN2)
    slope = np.where(active, -(rho / gap) / drho_db, 0.0)
    return need, F, slope.sum(-1), slope


def _v_newton(U, F, dF):
    """The Newton step on F in V = 1 / U, as a deadline: F is convex and increasing in V too (rho_k =
    S_k V / (1 - c_k V) is convex in V, beta convex in rho), so from either side of the root the tangent's zero
    in V is at or above the root's (U at or left of U*). In U: U / (1 - delta / U) with delta = -F / F', the
    U-Newton step: far left of the root, where F ~ A / U - B, U-Newton only doubles U a step (10 steps from
    the cold start at N = 1,024); V-Newton is nearly exact there. inf where the tangent has no zero at V > 0."""
    delta = np.where(dF < 0, -F / dF, 0.0)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return np.where(delta < U, U / (1.0 - delta / U), np.inf)


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
        U_hi = tau(np.full(S.shape, B / n)).max(-1)
        if start_s is not None:
            U = np.maximum(U, start_s)
        else:  # cold: the V-tangent at U_hi (F <= 0 there) is a lower bound too, usually far nearer
            _, F, dF, _ = _excess(U_hi, S, c, a, band, B, bmin)
            U = np.maximum(U, np.where((F < 0) & (dF < 0), _v_newton(U_hi, F, dF), U))
        done = np.zeros(U.shape, bool)
        final = np.zeros(S.shape)
        for _ in range(iters):
            need, F, dF, slope = _excess(U, S, c, a, band, B, bmin)
            U_new = np.minimum(np.maximum(_v_newton(U, F, dF), U), np.maximum(U_hi, U))
            step = np.where(F <= 1e-13 * B, 0.0, U_new - U)  # at the root to rounding: no step
            # A row stops at a step within 1e-8 of U: Newton converges quadratically, so the step lands on the
            # root to rounding, and the needs there are the linear ones to rounding (no band solve at U_new)
            stop = ~done & (step <= 1e-8 * U)
            moved = np.where(step[..., None] > 0, need + slope * step[..., None], need)
            final = np.where(stop[..., None], moved, final)
            done |= stop
            U = np.where(done, U, U_new)
            if done.all():
                break
        else:
            final = np.where(done[..., None], final, _excess(U, S, c, a, band, B, bmin)[0])
        b = np.maximum(np.where(np.isfinite(final), final, B), bmin)
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
