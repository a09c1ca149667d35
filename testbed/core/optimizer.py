"""The optimizer (spec sections 6-9): modes, draft lengths and powers that maximise goodput.

Inner problem (fixed L): the prefix search over K (the K devices with the cheapest UL mode go UL, the rest
DL) with the optimal DL power for each candidate DL set. Outer problem: greedy draft lengths, basic or with
fill (the proposed policy runs greedy with fill from several starts and keeps the best). Baselines:
all-UL, all-DL (optimal or equal DL power), random modes, one common length, a fixed length, and
exhaustive search. `plan()` is the entry point; scoring is batched over many candidate schedules at once
(numpy), and the chosen schedule is re-evaluated with `model.evaluate` so a plan's numbers are exactly
the model's.

Cost. A greedy step scores N single increments and up to N fill rows. The increments are
scored from one sorted base row (`Scorer.prefix_neighbors`, `Scorer.fixed_neighbors`): no sort per
candidate, O(1) corrections of the base row's prefix and suffix statistics, and the round time only at
the few K that lower bounds leave open. A fill row is scored only if an upper bound of its goodput
(`_score_bounded`) can beat the step's best. The DL solve runs only where it can decide a best K or a best
row (bounds from channel inversion, best first). None of this changes a decision: the same steps as
scoring every row in full (the optimizer's tests check both ways). A plan with no finite round time
raises InfeasiblePlanError.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np

from testbed.core import model, payload, radio, uplink
from testbed.core.policy import (  # OptimizerError lives there: PolicyError is one
    Decision,
    OptimizerError,
    Policy,
    PolicyError,
    RoundContext,
    RoundOutcome,
    check_decision,
    checked_ul_bandwidths,
    policy_name,
)
from testbed.core.power import LN2, log1p_ratio, solve_x
from testbed.core.scenario import Scenario
from testbed.core.vocabulary import DL, MODES, REL_TOL, UL, within

POLICIES = {
    "proposed": "greedy draft lengths with fill (multi-start) + prefix mode search + optimal DL power",
    "proposed-basic": "basic greedy draft lengths (no fill) + prefix mode search + optimal DL power",
    "all-ul": "every device in UL mode (existing designs), greedy lengths with fill",
    "all-dl": "every device in DL mode (DSSD-style), optimal DL power, greedy lengths with fill",
    "all-dl-equal-power": "every device in DL mode, DL power split equally, greedy lengths with fill",
    "random-modes": "modes drawn at random (seeded), greedy lengths with fill, optimal DL power",
    "common-length": "one draft length for all (best of 1..L_max), prefix modes, optimal DL power",
    "fixed-length": "one fixed draft length (default 4), prefix modes, optimal DL power",
    "multispin-homogeneous": "Multi-SPIN, homogeneous: every device UL, one common length, min-max UL band split",
    "multispin-heterogeneous": "Multi-SPIN, heterogeneous: every device UL, greedy per-device lengths, each "
                               "candidate with its min-max UL band split",
    "exhaustive": "all 2^N mode vectors x all L_max^N lengths (tiny N only): the optimality check",
}
_POLISH_MAX_N = 64  # proposed on a shared uplink polishes its best candidate by greedy up to this many devices
EXHAUSTIVE_LIMIT = 2_000_000
_REL_GAIN = 1e-12  # a greedy step must improve goodput by more than this (relative) to be taken


class InfeasiblePlanError(OptimizerError):
    """No schedule the policy may choose has a finite round time: some device cannot upload at all (its
    energy budget is below the least energy of its smallest upload, in every mode the policy allows)."""


# ---------------------------------------------------------------- batched scoring

_GROUP_VALUES = 16  # at most this many distinct DL payloads: the DL solve runs on per-payload weight sums
# Below this many devices (or fill rows) one batched call over every row costs less than the incremental
# and bounded paths' extra numpy calls; the results are the same either way.
_INCREMENTAL_MIN_N = 48
_BOUNDED_MIN_ROWS = 32
_BEST_FIRST_MIN = 64  # fewer open (row, K) pairs than this are solved in one call
_ASYNC_CHUNK = 4_000_000  # asynchronous rounds score (rows, K, devices) arrays: this many entries at a time
# A shared uplink's cold splits are kept per scorer for calls of up to this many rows (not the exhaustive
# search's batches), up to about this many (row, device) entries
_SPLIT_CACHE_ROWS = 64
_SPLIT_CACHE_ENTRIES = 1 << 20
_COLD = object()  # `Scorer.shared_up`'s start_s: split without a warm start and without the cache


class Scorer:
    """Scores many schedules of one scenario at once. L arrays are (C, N) integers in 1..L_max.

    Every per-device table (model.device_tables) is flattened to one entry per (device, length) and, for
    the prefix search, also laid out in the order of the prefix key (ties by device index, as a stable
    sort of each row would give). Sorting a candidate's devices by that key is then a sort of small
    integers (their global ranks) instead of an argsort of floats, and every sorted quantity is one
    gather by rank."""

    def __init__(self, sc: Scenario, ul_bandwidths=None):
        self.sc = sc
        self.tb = tb = model.device_tables(sc, ul_bandwidths)
        self.shared = sc.ul_access == "fdma_shared"
        self.n = n = sc.num_devices
        self.lmax = lmax = sc.max_draft_len
        self.inv_g = 1.0 / tb.dl_gains  # DL only: the UL is in the tables
        self.n0 = sc.noise_psd_w_hz
        if sc.dl_access == "tdma":
            self.tdma_rate = radio.shannon_rate_bps(sc.downlink_bandwidth_hz, sc.downlink_power_w,
                                                    tb.dl_gains, self.n0)
        self.evaluations = 0
        self.greedy_fixed, self.sweep_orders = {}, {}  # per mode vector (`fixed_greedy`), pattern (`_sweep_order`)
        self.split_cache: dict[bytes, tuple] = {}  # (L, modes) row -> its cold split (`_cached_shared_up`)
        self.sync = sc.rounds == "synchronous"
        self.t_over = sc.round_overhead_s
        # flat tables: entry j * lmax + (L - 1)
        self.offset = (np.arange(n) * lmax)[None, :]
        inv_g_tab = np.repeat(self.inv_g[:, None], lmax, axis=1)
        flat = dict(E=tb.expected_tokens, up_u=tb.up_ul, up_d=tb.up_dl, post_u=tb.post_ul, S=tb.dl_bits,
                    inv_g=inv_g_tab)
        self.flat = {k: np.ascontiguousarray(v, dtype=float).ravel() for k, v in flat.items()}
        # distinct DL payloads: group the DL solve by payload value when there are few
        self.values, vidx = np.unique(self.flat["S"], return_inverse=True)
        self.nv = self.values.size
        self.grouped = self.nv <= _GROUP_VALUES
        self.flat["vidx"] = vidx.ravel()
        # the prefix key: the cost UL mode adds (eager: the UL-mode uplink; lazy: the post-verification time)
        self.key_is_up = sc.ul_protocol == "eager"
        key = self.flat["up_u"] if self.key_is_up else self.flat["post_u"]
        dev = np.repeat(np.arange(n), lmax)
        order = np.argsort(key, kind="stable")  # ties by flat index: by device, then L (as a lexsort would)
        self.rank = np.empty(n * lmax, np.int32)
        self.rank[order] = np.arange(n * lmax, dtype=np.int32)
        self.by_rank = {k: v[order] for k, v in self.flat.items()}
        self.by_rank["dev"] = dev[order]
        if sc.dl_access == "tdma":
            self.by_rank["t_tdma"] = self.by_rank["S"] / self.tdma_rate[self.by_rank["dev"]]
        self.by_rank["inv_gS"] = self.by_rank["inv_g"] * self.by_rank["S"]
        post = tb.post_ul
        self.post_const = float(post.flat[0]) if np.all(post == post.flat[0]) else None
        # the prefix maxima that a sorted row gives for free
        self.up_sorted = self.key_is_up
        self.post_sorted = not self.key_is_up
        k = np.arange(n + 1)
        self.nd = n - k
        self.w = self._bandwidth(self.nd)  # (n+1,) band per DL device for K = 0..n
        self.R = sc.downlink_power_w / (self.n0 * self.w)
        # Every table grows with L (the model's payloads and times do): then a candidate's key only rises
        # when its length does (incremental neighbours), and a schedule's best round time only grows with
        # its lengths (the greedy's fill rows can be bounded). Checked, not assumed.
        grows = all(bool(np.all(t[:, 1:] >= t[:, :-1])) for t in (tb.up_ul, tb.up_dl, tb.post_ul, tb.dl_bits))
        self.monotone = grows and bool(np.all(np.diff(self.rank.reshape(n, lmax), axis=1) > 0))
        self.incremental = self.monotone and self.sync
        # The greedy's bound on fill rows needs the prefix search to be exact over all 2^N mode vectors.
        # Eager (docs/system-model.md, section 7): moving every device whose UL-mode uplink fits under the
        # uplink phase into UL mode keeps that phase and only shrinks the DL set. Lazy (key: the time
        # after verification): the same move keeps the post-verification phase, and keeps the uplink
        # phase if no device's UL-mode uplink exceeds its DL-mode one, which is checked here (it fails
        # with dl_protocol all_positions, or an energy budget that lowers the UL-mode power).
        self.prefix_exact = self.incremental and (sc.ul_protocol == "eager" or bool(np.all(tb.up_ul <= tb.up_dl)))

    def _bandwidth(self, num_dl):
        return model.dl_bandwidth_split(self.sc.dl_access, self.sc.downlink_bandwidth_hz, num_dl, self.n)

    def _index(self, L):
        """Flat table index of each (candidate, device) entry."""
        return self.offset + (np.asarray(L) - 1)

    def _goodput(self, E, up_k, post_k, t_ver, T_sync):
        """Sync: sum E / T. Async: sum_k E_k / T_k with T_k the device's own cycle."""
        if self.sync:
            return E.sum(-1) / T_sync
        Tk = up_k + t_ver[..., None] + post_k + self.t_over
        return (E / Tk).sum(-1)

    # -- fixed modes
    def exact(self, L, ul, equal_power: bool = False, start_s=None):
        """`fixed` with the scenario's uplink: dedicated bands as tabulated; a shared uplink split anew for each
        row (min-max, `model.shared_ul_split`) whatever bands the tables hold. Returns (G, T, bands or None).
        start_s: a lower bound of every row's uplink phase (`shared_up`)."""
        if not self.shared:
            return (*self.fixed(L, ul, equal_power=equal_power), None)
        up, bands = self.shared_up(L, ul, start_s)
        return (*self.fixed(L, ul, equal_power=equal_power, up=up), bands)

    def shared_inputs(self, idx, ul):
        """The split's inputs (bits S_k, time before the upload c_k) of flat table entries idx in modes ul: a
        device with a fixed UL rate has its air time in c_k and S_k = 0 (as `model.shared_ul_split`)."""
        tb = self.tb
        bits = np.where(ul, tb.bits_ul.ravel()[idx], tb.bits_dl.ravel()[idx])
        before = tb.draft_s.ravel()[idx]
        fixed = tb.fixed_ul[np.asarray(idx) // self.lmax]
        if np.isfinite(fixed).any():
            is_fixed = np.isfinite(fixed)
            with np.errstate(invalid="ignore"):
                before = before + np.where(is_fixed, bits / np.where(is_fixed, fixed, 1.0), 0.0)
            bits = np.where(is_fixed, 0.0, bits)
        return bits, before

    def shared_up(self, L, ul, start_s=None):
        """Each device's uplink phase (drafting + first upload) under the min-max split of each row, and the
        bands: ((C, N), (C, N)). start_s: a lower bound of every row's uplink phase (the greedy's: the phase of
        a schedule below all rows in the same modes), where the split's Newton starts (`uplink.split`)."""
        L = np.asarray(L)
        ul = np.asarray(ul, bool)
        if start_s is None and L.ndim == 2 and L.shape[0] <= _SPLIT_CACHE_ROWS:
            return self._cached_shared_up(L, np.broadcast_to(ul, L.shape))
        tb = self.tb
        idx = self._index(L)
        bits = np.where(ul, tb.bits_ul.ravel()[idx], tb.bits_dl.ravel()[idx])
        draft = tb.draft_s.ravel()[idx]
        if start_s is None or start_s is _COLD:
            bands, _ = model.shared_ul_split(self.sc, bits, draft, tb.snr_hz, tb.fixed_ul)
        else:  # the same split (`shared_inputs` is model.shared_ul_split's handling of fixed rates), warm
            S, before = self.shared_inputs(idx, ul)
            bands, _ = uplink.split(S, before, tb.snr_hz, self.sc.ul_total_bandwidth_hz(), self.sc.ul_min_band_hz(),
                                    start_s=start_s)
        fixed = np.isfinite(tb.fixed_ul)
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = np.where(fixed, tb.fixed_ul, radio.shannon_rate_bps(bands, tb.snr_hz * self.n0, 1.0, self.n0))
            up = draft + bits / rate
        return up, bands

    def _cached_shared_up(self, L, ul):
        """`shared_up` without a warm start, each distinct (L, modes) row split once per scorer: `proposed`
        scores the same schedules in several places (the greedy's start and its bounds' base, the candidates,
        the polish). A row's cold split does not depend on the rows split with it (`uplink.split`), so a
        cached row is bit for bit the row split again."""
        cache = self.split_cache
        keys = [L[i].tobytes() + ul[i].tobytes() for i in range(L.shape[0])]
        missing: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key not in cache:
                missing.setdefault(key, i)
        found: dict[bytes, tuple] = {}
        if missing:
            rows = np.fromiter(missing.values(), int, len(missing))
            up, bands = self.shared_up(L[rows], ul[rows], start_s=_COLD)
            found = {key: (up[j], bands[j]) for j, key in enumerate(missing)}
            if len(cache) * self.n <= _SPLIT_CACHE_ENTRIES:
                cache.update(found)
        rows = [found[k] if k in found else cache[k] for k in keys]
        return np.array([r[0] for r in rows]), np.array([r[1] for r in rows])

    def fixed(self, L, ul, equal_power: bool = False, floor: float | None = None, up=None):
        """Goodput for given modes ul (C, N) bool; returns (G, T). `up`: each device's uplink phase (C, N)
        instead of the tables' (a shared uplink's split, `exact`).

        floor (synchronous rounds): rows whose goodput provably stays below it are not solved exactly and
        get G = -inf and a lower bound of T (channel inversion with the 1/g-weighted mean payload bounds
        the DL phase from below)."""
        sc, f = self.sc, self.flat
        L = np.asarray(L)
        ul = np.asarray(ul, bool)
        idx = self._index(L)
        self.evaluations += L.shape[0]
        dl = ~ul
        nd = dl.sum(-1)
        E, S = f["E"][idx], f["S"][idx]
        up_k = np.where(ul, f["up_u"][idx], f["up_d"][idx]) if up is None else up
        t_ver = model.verify_time(sc, L)
        w = self._bandwidth(nd)
        own = None
        if sc.dl_access == "tdma":
            tau = np.where(dl, S / self.tdma_rate, 0.0).sum(-1)
        elif equal_power:
            pw = sc.downlink_power_w / np.maximum(nd, 1)
            r = radio.shannon_rate_bps(w[:, None], pw[:, None], self.tb.dl_gains[None, :], self.n0)
            with np.errstate(divide="ignore"):
                own = np.where(dl, S / r, 0.0)  # unequal latencies: each device has its own
            tau = own.max(-1)
        else:
            wts = np.where(dl, self.inv_g, 0.0)
            R = sc.downlink_power_w / (self.n0 * w)
            keep = nd > 0  # a row without DL devices has no DL phase to solve
            if floor is not None and self.sync and self.nv > 1:
                wsum = wts.sum(-1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    tau = np.where(nd > 0, (wts * S).sum(-1) / wsum / (w * log1p_ratio(R, wsum) / LN2), 0.0)
                T_lo = (up_k.max(-1) + t_ver + np.where(ul, f["post_u"][idx], tau[:, None]).max(-1)
                        + self.t_over)
                hopeless = E.sum(-1) / T_lo * (1 + REL_TOL) < floor
                keep &= ~hopeless
            else:
                tau = np.zeros(L.shape[0])
            if keep.any():
                if self.grouped:
                    x = solve_x(self._group(wts[keep], f["vidx"][idx][keep]), self.values, R[keep])
                else:
                    x = solve_x(wts[keep], S[keep], R[keep])
                with np.errstate(divide="ignore"):
                    tau[keep] = 1.0 / (w[keep] * x)
        post_k = np.where(ul, f["post_u"][idx], own if own is not None else tau[:, None])
        T = up_k.max(-1) + t_ver + post_k.max(-1) + self.t_over
        G = self._goodput(E, up_k, post_k, t_ver, T)
        if floor is not None and own is None and sc.dl_access != "tdma" and self.sync and self.nv > 1:
            G[hopeless] = -np.inf
        return G, T

    def _group(self, wts, vidx):
        """Per-row sums of wts by payload value: (C, N) -> (C, nv)."""
        C = wts.shape[0]
        bins = (np.arange(C)[:, None] * self.nv + vidx).ravel()
        return np.bincount(bins, wts.ravel(), minlength=C * self.nv).reshape(C, self.nv)

    # -- the prefix search (spec section 7)
    def prefix(self, L, floor: float | None = None):
        """Best prefix K per row. Returns (G, T, ul mask) for the best K of each row.

        floor (synchronous rounds): rows whose goodput provably stays below it skip the exact DL solves
        and get G = -inf (their T and modes are then those of an upper bound)."""
        sc, br = self.sc, self.by_rank
        L = np.asarray(L)
        C, n = L.shape
        if not self.sync and C > 1 and C * (n + 1) * n > _ASYNC_CHUNK:
            step = max(1, _ASYNC_CHUNK // ((n + 1) * n))
            parts = [self.prefix(L[a:a + step], floor) for a in range(0, C, step)]
            return tuple(np.concatenate(x) for x in zip(*parts))
        self.evaluations += C
        # Sort each row's devices by the key: sort their global ranks (small integers).
        idx = self._index(L)
        r = self.rank[idx]
        r.sort(axis=1)
        E_sum = self.flat["E"][idx].sum(-1)
        t_ver = model.verify_time(sc, L)
        up_u, up_d = br["up_u"][r], br["up_d"][r]
        # K = 0..n: the first K sorted devices go UL. Prefix maxima of UL-mode times, suffix maxima of
        # the DL-mode uplinks. The key's own prefix maximum is the sorted row itself.
        pre_up = np.zeros((C, n + 1))
        pre_up[:, 1:] = up_u if self.up_sorted else np.maximum.accumulate(up_u, axis=1)
        if self.post_const is not None:
            pre_post = np.full(n + 1, self.post_const)
            pre_post[0] = 0.0
            pre_post = np.broadcast_to(pre_post, (C, n + 1))
        else:
            pre_post = np.zeros((C, n + 1))
            post = br["post_u"][r]
            pre_post[:, 1:] = post if self.post_sorted else np.maximum.accumulate(post, axis=1)
        suf_up_d = np.zeros((C, n + 1))
        suf_up_d[:, :n] = np.maximum.accumulate(up_d[:, ::-1], axis=1)[:, ::-1]
        base_T = np.maximum(pre_up, suf_up_d) + t_ver[:, None] + self.t_over  # (C, n+1) without the DL phase
        if sc.dl_access == "tdma":
            tau = np.zeros((C, n + 1))
            tau[:, :n] = np.cumsum(br["t_tdma"][r][:, ::-1], axis=1)[:, ::-1]
        elif self.sync:
            t_cap = None if floor is None else E_sum / floor * (1 + REL_TOL)
            tau, hopeless = self._tau_bracketed(r, base_T, pre_post, t_cap)
        else:
            tau = self._tau_all(r)
        T = base_T + np.maximum(pre_post, tau)  # (C, n+1)
        if self.sync:
            G = E_sum[:, None] / T
            if floor is not None and sc.dl_access != "tdma" and hopeless is not None:
                G[hopeless] = -np.inf
        else:
            K = np.arange(n + 1)
            is_ul = np.arange(n)[None, :] < K[:, None]  # (n+1, n) in sorted order
            up_k = np.where(is_ul[None], up_u[:, None, :], up_d[:, None, :])
            post_k = np.where(is_ul[None], br["post_u"][r][:, None, :], tau[..., None])
            Tk = up_k + t_ver[:, None, None] + post_k + self.t_over
            G = (br["E"][r][:, None, :] / Tk).sum(-1)
        best = np.argmax(G, axis=1)
        rows = np.arange(C)
        ul = np.zeros((C, n), bool)
        ul[rows[:, None], br["dev"][r]] = np.arange(n)[None, :] < best[:, None]
        return G[rows, best], T[rows, best], ul

    def _suffix_sum(self, v):
        out = np.zeros((v.shape[0], v.shape[1] + 1))
        out[:, :-1] = np.cumsum(v[:, ::-1], axis=1)[:, ::-1]
        return out

    def _exact_tau(self, r, rows, ks):
        """Exact optimal-power DL phase of the DL sets (sorted positions >= ks) of the given rows."""
        br, n = self.by_rank, self.n
        rr = r[rows]
        wts = np.where(np.arange(n)[None, :] >= ks[:, None], br["inv_g"][rr], 0.0)
        if self.grouped:
            x = solve_x(self._group(wts, br["vidx"][rr]), self.values, self.R[ks])
        else:
            x = solve_x(wts, br["S"][rr], self.R[ks])
        with np.errstate(divide="ignore"):
            return np.where(self.nd[ks] > 0, 1.0 / (self.w[ks] * x), 0.0)

    def _tau_all(self, r):
        """Exact optimal-power DL phase for every suffix DL set (rows: candidates, columns: K)."""
        br = self.by_rank
        C, n = r.shape
        if self.grouped:  # suffix sums per payload value, O(C N nv)
            onehot = np.zeros((C, n + 1, self.nv))
            onehot[np.arange(C)[:, None], np.arange(n)[None, :], br["vidx"][r]] = br["inv_g"][r]
            x = solve_x(np.cumsum(onehot[:, ::-1], axis=1)[:, ::-1], self.values, self.R)
            with np.errstate(divide="ignore"):
                return np.where(self.nd > 0, 1.0 / (self.w * x), 0.0)
        rows = np.repeat(np.arange(C), n + 1)
        ks = np.tile(np.arange(n + 1), C)
        return self._exact_tau(r, rows, ks).reshape(C, n + 1)

    def _tau_bracketed(self, r, base_T, pre_post, t_cap=None):
        """The DL phase where it decides the best K (synchronous rounds), exactly; elsewhere a bound.

        Channel inversion with the largest payload of a DL set bounds tau from above, and with the
        payloads' mean weighted by 1/g from below (Jensen: 2^(S x) is convex in S). Only the K whose
        lower-bound round time beats the best upper bound, and whose DL phase matters there, can be
        optimal; the exact solver runs on those alone. With equal payloads the bounds coincide.
        Rows whose round time cannot get below t_cap (C,) skip the solves: returned as `hopeless`."""
        br, n = self.by_rank, self.n
        C = r.shape[0]
        suf_inv = self._suffix_sum(br["inv_g"][r])
        last = self.nd > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            # W log2(1 + R / sum 1/g): the rate per payload bit of channel inversion
            rate_per_bit = self.w * (log1p_ratio(self.R, suf_inv) / LN2)
            if self.nv == 1:
                return np.where(last, self.values[0] / rate_per_bit, 0.0), None
            s_mean = self._suffix_sum(br["inv_gS"][r]) / suf_inv
            s_max = np.zeros((C, n + 1))
            s_max[:, :n] = np.maximum.accumulate(br["S"][r][:, ::-1], axis=1)[:, ::-1]
            lo = np.where(last, s_mean / rate_per_bit, 0.0)
            hi = np.where(last, s_max / rate_per_bit, 0.0)
        T_lo = base_T + np.maximum(pre_post, lo)
        T_hi = base_T + np.maximum(pre_post, hi)
        bound = T_hi.min(axis=1)
        hopeless = None
        if t_cap is not None:
            hopeless = T_lo.min(axis=1) > t_cap
            bound[hopeless] = -np.inf  # no candidate pair in these rows
        rows, ks = np.nonzero((T_lo < T_hi) & (T_lo <= bound[:, None]))
        tau = hi
        if rows.size:  # a second lower bound on the open pairs: no device's DL time beats all the power
            rr = r[rows]
            single = self._single_bound(br["S"][rr], br["inv_g"][rr], np.arange(n)[None, :] >= ks[:, None], ks)
            t_lo = base_T[rows, ks] + np.maximum(pre_post[rows, ks], np.maximum(lo[rows, ks], single))
            keep = t_lo <= bound[rows]
            rows, ks, t_lo = rows[keep], ks[keep], t_lo[keep]
        if rows.size:
            def exact(idx):
                rr, kk = rows[idx], ks[idx]
                tau[rr, kk] = t = self._exact_tau(r, rr, kk)
                return base_T[rr, kk] + np.maximum(pre_post[rr, kk], t)
            _best_first(rows, t_lo, bound, exact)
        return tau, hopeless

    def _single_bound(self, s, inv_g, mask, K):
        """max over the DL set (mask) of S_j / (W log2(1 + R / (1/g_j))): each device's DL time with the whole
        power, a lower bound of the set's DL phase that is tight when one device dominates it."""
        with np.errstate(divide="ignore", invalid="ignore"):
            per_bit = self.w[K][:, None] * (log1p_ratio(self.R[K][:, None], inv_g) / LN2)
            return np.where(mask, s / per_bit, 0.0).max(axis=1, initial=0.0)

    # -- the greedy's candidates: single increments of one schedule, evaluated incrementally

    @staticmethod
    def _top2(a):
        """Prefix maximum and prefix second maximum (with multiplicity) of a non-negative 1-D array, as
        (n+1,) vectors over the prefix length (0 for an empty prefix). The maximum over a prefix without
        position i is then: the second maximum where a[i] is the maximum, else the maximum."""
        m1 = np.zeros(a.size + 1)
        m1[1:] = np.maximum.accumulate(a)
        m2 = np.zeros(a.size + 1)
        m2[1:] = np.maximum.accumulate(np.minimum(a, m1[:-1]))
        return m1, m2

    @classmethod
    def _top2_suffix(cls, a):
        m1, m2 = cls._top2(a[::-1])
        return m1[::-1], m2[::-1]

    def _verify_raised(self, L0, ks, steps=1):
        """model.verify_time of L0 + steps e_k for each k, from its sum and maximum (no (C, N) array)."""
        positions = (L0 + 1).sum() + np.asarray(steps, float)
        longest = np.maximum(L0.max(), L0[ks] + steps)
        return np.broadcast_to(model.verify_time_of(self.sc, positions, longest, self.n), ks.shape)

    def _base_row(self, L0):
        """One schedule's sorted row and its prefix / suffix statistics over K = 0..N (`prefix_neighbors`)."""
        br, n = self.by_rank, self.n
        b = {}
        r0 = np.sort(self.rank[self.offset[0] + L0 - 1])
        pos0 = np.empty(n, np.intp)
        pos0[br["dev"][r0]] = np.arange(n)
        b["r0"], b["pos0"] = r0, pos0
        for k in ("up_u", "up_d", "post_u", "S", "inv_g"):
            b[k] = br[k][r0]
        b["PU1"], b["PU2"] = self._top2(b["up_u"])
        b["PP1"], b["PP2"] = self._top2(b["post_u"])
        b["SD1"], b["SD2"] = self._top2_suffix(b["up_d"])
        b["t_ver"] = float(model.verify_time(self.sc, L0))
        if self.sc.dl_access == "tdma":
            b["t"] = br["t_tdma"][r0]
            b["TD"] = self._suffix_sum(b["t"][None])[0]
            lo = hi = b["TD"]
        else:
            b["SV"] = self._suffix_sum(b["inv_g"][None])[0]
            with np.errstate(divide="ignore", invalid="ignore"):
                b["RPB"] = self.w * (log1p_ratio(self.R, b["SV"]) / LN2)
                if self.nv == 1:
                    lo = hi = np.where(self.nd > 0, self.values[0] / b["RPB"], 0.0)
                else:
                    b["SVS"] = self._suffix_sum((b["inv_g"] * b["S"])[None])[0]
                    b["SM1"], b["SM2"] = self._top2_suffix(b["S"])
                    lo = np.where(self.nd > 0, b["SVS"] / b["SV"] / b["RPB"], 0.0)
                    hi = np.where(self.nd > 0, b["SM1"] / b["RPB"], 0.0)
                    if self.grouped:
                        onehot = np.zeros((n + 1, self.nv))
                        onehot[np.arange(n), br["vidx"][r0]] = b["inv_g"]
                        b["Wv"] = np.cumsum(onehot[::-1], axis=0)[::-1]  # per-value suffix sums, last row 0
                        b["vidx"] = br["vidx"][r0]
        # Lower bounds of the round time of the base schedule's prefix sets (A, C below) and of a prefix set
        # of K + 1 without one device (B): second maxima bound a maximum without one entry, and the DL set
        # then contains the base one of K + 1, whose DL phase is at least its lower bound.
        up = np.maximum(b["PU1"], b["SD1"]) + b["t_ver"] + self.t_over
        b["LBA"] = up + np.maximum(b["PP1"], lo)
        b["TBhi"] = up + np.maximum(b["PP1"], hi)
        lbb = np.full(n + 1, np.inf)
        lbb[:n] = (np.maximum(b["PU2"][1:], b["SD1"][1:]) + b["t_ver"] + self.t_over
                   + np.maximum(b["PP2"][1:], lo[1:]))
        b["LBB"] = lbb
        for key in ("LBA", "LBB"):
            order = np.argsort(b[key], kind="stable")
            b[key + "_order"], b[key + "_sorted"] = order, b[key][order]
        return b

    def _pairs_T(self, b, cand, c, K):
        """Round time bounds (T_lo, T_hi) of candidate rows c at prefix sizes K, with the parts the exact
        DL solve needs. Three cases by where K falls relative to k's old (i) and new (j) sorted position."""
        f, n = self.flat, self.n
        i, j, new = cand["i"][c], cand["j"][c], cand["new"][c]
        A = K <= i
        B = ~A & (K <= j)
        K1 = np.minimum(K + 1, n)

        def excl(m1, m2, at, a):
            return np.where(a[i] == m1[at], m2[at], m1[at])

        pre_up = np.where(A, b["PU1"][K], np.where(B, excl(b["PU1"], b["PU2"], K1, b["up_u"]),
                                                   np.maximum(excl(b["PU1"], b["PU2"], K, b["up_u"]),
                                                              f["up_u"][new])))
        pre_post = np.where(A, b["PP1"][K], np.where(B, excl(b["PP1"], b["PP2"], K1, b["post_u"]),
                                                     np.maximum(excl(b["PP1"], b["PP2"], K, b["post_u"]),
                                                                f["post_u"][new])))
        ad_new = f["up_d"][new]
        suf_d = np.where(A, np.maximum(excl(b["SD1"], b["SD2"], K, b["up_d"]), ad_new),
                         np.where(B, np.maximum(b["SD1"][K1], ad_new), b["SD1"][K]))
        up = np.maximum(pre_up, suf_d)  # the uplink phase: the greedy's bottleneck for its fill rows
        base_T = up + cand["t_ver"][c] + self.t_over
        last = self.nd[K] > 0
        parts = dict(A=A, B=B, K=K, K1=K1, c=c, base_T=base_T, pre_post=pre_post, last=last, up=up)
        if self.sc.dl_access == "tdma":
            t_new = f["S"][new] / self.tdma_rate[cand["k"][c]]
            tau = np.where(A, b["TD"][K] - b["t"][i] + t_new, np.where(B, b["TD"][K1] + t_new, b["TD"][K]))
            T = base_T + np.maximum(pre_post, tau)
            return T, T, parts
        vk = self.inv_g[cand["k"][c]]
        with np.errstate(divide="ignore", invalid="ignore"):
            rpb = np.where(B, self.w[K] * (log1p_ratio(self.R[K], b["SV"][K1] + vk) / LN2), b["RPB"][K])
            if self.nv == 1:
                tau = np.where(last, self.values[0] / rpb, 0.0)
                T = base_T + np.maximum(pre_post, tau)
                return T, T, parts
            s_new = f["S"][new]
            num = np.where(A, b["SVS"][K] + vk * (s_new - b["S"][i]),
                           np.where(B, b["SVS"][K1] + vk * s_new, b["SVS"][K]))
            den = np.where(B, b["SV"][K1] + vk, b["SV"][K])
            s_max = np.where(A, np.maximum(excl(b["SM1"], b["SM2"], K, b["S"]), s_new),
                             np.where(B, np.maximum(b["SM1"][K1], s_new), b["SM1"][K]))
            lo = np.where(last, num / den / rpb, 0.0)
            hi = np.where(last, s_max / rpb, 0.0)
        return base_T + np.maximum(pre_post, lo), base_T + np.maximum(pre_post, hi), parts

    def _base_exact_tau(self, b, Ks):
        """Exact DL phase of the base row's DL sets (sorted positions >= K) for the given K."""
        n = self.n
        wts = np.where(np.arange(n)[None, :] >= Ks[:, None], b["inv_g"], 0.0)
        if self.grouped:
            x = solve_x(self._group(wts, np.broadcast_to(self.by_rank["vidx"][b["r0"]], wts.shape)),
                        self.values, self.R[Ks])
        else:
            x = solve_x(wts, b["S"], self.R[Ks])
        with np.errstate(divide="ignore"):
            return np.where(self.nd[Ks] > 0, 1.0 / (self.w[Ks] * x), 0.0)

    def _pairs_exact_tau(self, b, cand, p):
        """Exact DL phase of the pairs described by `p` (a subset of `_pairs_T`'s parts)."""
        f, n = self.flat, self.n
        A, B, K, c = p["A"], p["B"], p["K"], p["c"]
        k_from = np.where(B, K + 1, K)  # base positions >= k_from are DL (without i in case A) ...
        i, new = cand["i"][c], cand["new"][c]
        vk = self.inv_g[cand["k"][c]]   # ... and so is k (cases A and B) with its new payload
        if self.grouped:
            W = b["Wv"][k_from].copy()
            q = np.arange(K.size)
            np.subtract.at(W, (q[A], b["vidx"][i[A]]), vk[A])
            np.add.at(W, (q[A | B], f["vidx"][new[A | B]]), vk[A | B])
            x = solve_x(np.maximum(W, 0.0), self.values, self.R[K])
        else:
            pos = np.arange(n)[None, :]
            wts = np.where((pos >= k_from[:, None]) & ~(A[:, None] & (pos == i[:, None])), b["inv_g"], 0.0)
            wts = np.concatenate([wts, np.where(A | B, vk, 0.0)[:, None]], axis=1)
            pay = np.concatenate([np.broadcast_to(b["S"], (K.size, n)), f["S"][new][:, None]], axis=1)
            x = solve_x(wts, pay, self.R[K])
        with np.errstate(divide="ignore"):
            return np.where(p["last"], 1.0 / (self.w[K] * x), 0.0)

    def _select(self, b, key, theta, keep):
        """Pairs (row, K) with b[key][K] <= theta[row] and keep(row, K), sorted by row: a prefix of the
        bound's sorted order per row."""
        cnt = np.searchsorted(b[key + "_sorted"], theta, side="right")
        rows = np.repeat(np.arange(theta.size), cnt)
        starts = np.cumsum(cnt) - cnt
        Ks = b[key + "_order"][np.arange(rows.size) - np.repeat(starts, cnt)]
        ok = keep(rows, Ks)
        return rows[ok], Ks[ok]

    def prefix_neighbors(self, L0, ks, Lc=None, steps=1, compact: bool = False):
        """`prefix(Lc)` for the single increments Lc[c] = L0 + e_{ks[c]}, without sorting or scanning them
        (steps (C,): L0 + steps[c] e_{ks[c]}, the same way: any raise of L_k only raises k's key).

        Raising L_k only raises device k's key, so its sorted row is the base row with k moved from
        position i to a position j >= i. For a prefix size K the UL set is then the base prefix of K (case
        A, K <= i, k DL), the base prefix of K + 1 without k (B, i < K <= j, k DL), or the base prefix of K
        (C, K > j, k UL). Every maximum and sum of a candidate at one K is the base row's, corrected for k
        in O(1) (a second maximum replaces a maximum that was k's). The base row also gives, per K, a lower
        bound of the candidate's round time there (phases only grow with L, and T_ver grows by a known
        amount); after an upper bound from a few guesses (K near the base's best, and near i and j), only
        the K whose lower bound does not exceed it are evaluated: usually one to three per candidate.
        Synchronous rounds only; otherwise (or if a key could fall with L) this is `prefix`. compact: the modes
        as `_PrefixModes` (no (C, N) array) where they come from the base row."""
        L0 = np.asarray(L0)
        ks = np.asarray(ks)
        if Lc is None:
            Lc = np.repeat(L0[None], ks.size, axis=0)
            Lc[np.arange(ks.size), ks] += steps
        if not self.incremental:
            return (*self.prefix(Lc), None)
        n, C = self.n, ks.size
        self.evaluations += C
        b = self._base_row(L0)
        new = ks * self.lmax + L0[ks] + (np.asarray(steps) - 1)  # flat index of the raised entry
        cand = dict(k=ks, new=new, i=b["pos0"][ks], j=np.searchsorted(b["r0"], self.rank[new]) - 1,
                    t_ver=self._verify_raised(L0, ks, steps))
        # an upper bound of each candidate's best round time from a few guesses of K
        kb = int(np.argmin(b["TBhi"]))
        guesses = np.clip(np.stack([np.full(C, kb - 1), np.full(C, kb), np.full(C, kb + 1), cand["i"],
                                    cand["i"] + 1, cand["j"], cand["j"] + 1]), 0, n)
        gc = np.tile(np.arange(C), guesses.shape[0])
        ub = self._pairs_T(b, cand, gc, guesses.ravel())[1].reshape(guesses.shape).min(axis=0)  # guess-major
        # every K whose lower bound does not exceed it (a margin for rounding)
        theta = ub * (1 + REL_TOL) - (cand["t_ver"] - b["t_ver"])
        i, j = cand["i"], cand["j"]
        ra, ka = self._select(b, "LBA", theta, lambda r, K: (K <= i[r]) | (K > j[r]))
        rb, kb_ = self._select(b, "LBB", theta, lambda r, K: (K > i[r]) & (K <= j[r]))
        rows, Ks = np.concatenate([ra, rb]), np.concatenate([ka, kb_])
        order = np.lexsort((Ks, rows))
        rows, Ks = rows[order], Ks[order]
        T_lo, T_hi, parts = self._pairs_T(b, cand, rows, Ks)
        T = T_hi
        if T_lo is not T_hi:  # unequal payloads: exact DL phase where it can decide the best K
            bound = np.full(C, np.inf)
            np.minimum.at(bound, rows, T_hi)
            need = np.flatnonzero((T_lo < T_hi) & (T_lo <= bound[rows]))
            T = T_hi.copy()
            if need.size > 2 * C:
                # Many open pairs (payloads far apart): the base row's own DL sets, solved once per K, bound
                # them tightly. Case C is such a set (exact); A and B contain one (with k's payload grown).
                A, B, K = parts["A"][need], parts["B"][need], parts["K"][need]
                at = np.where(B, K + 1, K)
                Ku, inv = np.unique(at, return_inverse=True)
                tb = self._base_exact_tau(b, Ku)[inv]
                t_base = parts["base_T"][need] + np.maximum(parts["pre_post"][need], tb)
                T_lo = T_lo.copy()
                T_lo[need] = np.maximum(T_lo[need], t_base)
                exact_c = need[~(A | B)]
                T[exact_c] = T_lo[exact_c] = t_base[~(A | B)]
                bound = np.full(C, np.inf)
                np.minimum.at(bound, rows, T)
                need = np.flatnonzero((T_lo < T) & (T_lo <= bound[rows]))
            if need.size:  # a second lower bound on the open pairs (see `_single_bound`)
                p = {k: v[need] for k, v in parts.items()}
                k_from = np.where(p["B"], p["K"] + 1, p["K"])
                i_p = cand["i"][p["c"]]
                pos = np.arange(n)[None, :]
                mask = (pos >= k_from[:, None]) & ~(p["A"][:, None] & (pos == i_p[:, None]))
                single = np.maximum(
                    self._single_bound(np.broadcast_to(b["S"], mask.shape), np.broadcast_to(b["inv_g"], mask.shape),
                                       mask, p["K"]),
                    self._single_bound(self.flat["S"][cand["new"][p["c"]]][:, None],
                                       self.inv_g[cand["k"][p["c"]]][:, None], (p["A"] | p["B"])[:, None], p["K"]))
                t_lo = np.maximum(T_lo[need], p["base_T"] + np.maximum(p["pre_post"], single))
                keep = t_lo <= bound[rows[need]]
                need, t_lo = need[keep], t_lo[keep]

            def exact(idx):
                sub = {k: v[need[idx]] for k, v in parts.items()}
                T[need[idx]] = t = sub["base_T"] + np.maximum(sub["pre_post"], self._pairs_exact_tau(b, cand, sub))
                return t
            if need.size:
                _best_first(rows[need], t_lo, bound, exact)
        pick = _first_min_per_row(rows, T)  # each row's smallest T, the smallest K among equals
        if pick.size != C:  # cannot happen with valid bounds; score in full rather than guess
            return (*self.prefix(Lc), None)
        best, T_best = Ks[pick], T[pick]
        G = self._raised_tokens(L0, new, steps) / T_best
        # UL: sorted position < best. Only two devices of a row sit elsewhere than in the base row: k (at j),
        # and, when k moved past best, the base's device at position best (one down, into the UL set).
        moved = (i < best) & (best <= j)
        up = np.where(moved, self.by_rank["dev"][b["r0"][np.minimum(best, n - 1)]], -1)
        ul = _PrefixModes(b["pos0"], best, ks, j < best, up)
        return G, T_best, (ul if compact else ul.rows(slice(None))), parts["up"][pick]

    def _raised_tokens(self, L0, new, steps=1):
        """Expected tokens of L0 + steps e_k for each raised flat entry `new` (its length's entry; `steps` below
        is L0's)."""
        E = self.flat["E"]
        return E[self.offset[0] + L0 - 1].sum() + (E[new] - E[new - steps])

    def fixed_neighbors(self, L0, ks, Lc, ul, equal_power: bool = False, exact: bool = True):
        """`fixed(Lc, ul)` for the single increments Lc[c] = L0 + e_{ks[c]} in fixed modes ul (N,): the
        maxima over devices without k come from the base row's maximum and second maximum, and the DL
        solve changes one payload. Synchronous rounds only; otherwise this is `fixed`.

        exact=False (the greedy): with many distinct payloads, a candidate whose goodput provably stays
        below another candidate's gets lower bounds of G and T instead of the exact values (it cannot be
        the best candidate, and a lower bound of T keeps the fill rows' bound valid). With DL payloads
        grown from s to s' the DL phase lies in [tau, tau max(1, s'/s)] (all payloads scaled by s'/s
        cover the new set) and above channel inversion with the 1/g-weighted mean payload."""
        if not self.incremental:
            ul = np.broadcast_to(ul, Lc.shape)
            return (*self.fixed(Lc, ul, equal_power=equal_power), ul, None)
        sc, f = self.sc, self.flat
        L0 = np.asarray(L0)
        ks = np.asarray(ks)
        ul = np.asarray(ul, bool)
        dl = ~ul
        self.evaluations += ks.size
        idx0 = self.offset[0] + L0 - 1
        new = ks * self.lmax + L0[ks]
        t_ver = self._verify_raised(L0, ks)
        E = self._raised_tokens(L0, new)

        def top_without_k(base, raised):
            m1, m2 = (m[-1] for m in self._top2(base))
            return np.maximum(np.where(base[ks] == m1, m2, m1), raised)

        up = top_without_k(np.where(ul, f["up_u"][idx0], f["up_d"][idx0]),
                           np.where(ul[ks], f["up_u"][new], f["up_d"][new]))
        post_ul = top_without_k(np.where(ul, f["post_u"][idx0], 0.0), np.where(ul[ks], f["post_u"][new], 0.0))
        nd = int(dl.sum())
        S0, S_new = f["S"][idx0], f["S"][new]
        dl_k = dl[ks]
        if nd == 0:
            down = np.zeros(ks.size)
        elif sc.dl_access == "tdma":
            t0 = np.where(dl, S0 / self.tdma_rate, 0.0)
            down = t0.sum() + np.where(dl_k, S_new / self.tdma_rate[ks] - t0[ks], 0.0)
        else:
            w = float(self._bandwidth(nd))
            if equal_power:
                rate = radio.shannon_rate_bps(w, sc.downlink_power_w / nd, self.tb.dl_gains, self.n0)
                with np.errstate(divide="ignore"):
                    own = np.where(dl, S0 / rate, 0.0)
                    down = top_without_k(own, np.where(dl_k, S_new / rate[ks], 0.0))
            else:
                R = sc.downlink_power_w / (self.n0 * w)
                wts = np.where(dl, self.inv_g, 0.0)
                c = np.flatnonzero(dl_k)
                # the base set's root bounds the candidates' from above (their payloads only grew)
                if self.grouped:
                    vid = f["vidx"][idx0]
                    base = np.bincount(vid, wts, minlength=self.nv)
                    x_base = solve_x(base, self.values, R)
                    W = np.repeat(base[None, :], c.size, axis=0)
                    p = np.arange(c.size)
                    np.subtract.at(W, (p, vid[ks[c]]), wts[ks[c]])
                    np.add.at(W, (p, f["vidx"][new[c]]), wts[ks[c]])
                    x = solve_x(np.maximum(W, 0.0), self.values, R, x0=x_base)
                    down = np.full(ks.size, 1.0 / (w * x_base))
                    down[c] = 1.0 / (w * x)
                else:
                    x_base = solve_x(wts, S0, R)
                    down = np.full(ks.size, 1.0 / (w * x_base))
                    if not exact and c.size > 1:
                        wsum = wts.sum()
                        per_bit = w * log1p_ratio(R, wsum) / LN2
                        mean = ((wts * S0).sum() + wts[ks[c]] * (S_new[c] - S0[ks[c]])) / wsum
                        lo, hi = down.copy(), down.copy()
                        lo[c] = np.maximum(down[c], mean / per_bit)
                        hi[c] = down[c] * np.maximum(S_new[c] / S0[ks[c]], 1.0)
                        rest = up + t_ver + self.t_over
                        T_lo = rest + np.maximum(post_ul, lo)
                        g_lb = E / (rest + np.maximum(post_ul, hi))
                        open_ = within(g_lb.max(), E / T_lo)
                        solve = c[open_[c]]
                    else:
                        solve = c
                    pay = np.repeat(S0[None, :], solve.size, axis=0)
                    pay[np.arange(solve.size), ks[solve]] = S_new[solve]
                    x = solve_x(np.broadcast_to(wts, pay.shape), pay, R, x0=x_base)
                    if solve is not c:  # the others: lower bounds of T (and, through the upper DL bound, of G)
                        T = T_lo.copy()
                        g = g_lb.copy()
                        down[solve] = 1.0 / (w * x)
                        T[solve] = up[solve] + t_ver[solve] + np.maximum(post_ul[solve], down[solve]) + self.t_over
                        g[solve] = E[solve] / T[solve]
                        return g, T, np.broadcast_to(ul, Lc.shape), up
                    down[solve] = 1.0 / (w * x)
        T = up + t_ver + np.maximum(post_ul, down) + self.t_over
        return E / T, T, np.broadcast_to(ul, Lc.shape), up


def _first_min_per_row(rows, T):
    """For pairs sorted by (row, K): the index of each row's smallest T, the first (smallest K) among equals and
    NaN last, as a lexsort by (row, T, K) would pick, without sorting. Rows in increasing order."""
    starts = np.flatnonzero(np.concatenate([[True], rows[1:] != rows[:-1]]))
    seg = np.repeat(np.arange(starts.size), np.diff(np.append(starts, rows.size)))
    t_min = np.fmin.reduceat(T, starts)[seg]  # NaN only where the whole row is NaN: then its first pair
    hit = np.flatnonzero((T == t_min) | np.isnan(t_min))
    first = np.ones(hit.size, bool)
    first[1:] = seg[hit][1:] != seg[hit][:-1]
    return hit[first]


def _best_first(rows, T_lo, bound, exact, rounds: int = 3):
    """Solve exactly, lowest lower bound first, the pairs that can still be their row's minimum.

    rows, T_lo: pairs whose exact round time is at least T_lo and not known yet; bound: per row, an upper
    bound of the row's minimum round time (updated); exact(idx) -> the exact round times of pairs idx.
    Each of the first `rounds` rounds solves one pair per row; then every remaining candidate at once (and
    at once from the start when there are few: one solve costs less than another round). A pair left
    unsolved has T_lo above its row's minimum, so it cannot be (or tie) the minimum."""
    open_ = np.ones(rows.size, bool)
    for rnd in itertools.count():
        cand = np.flatnonzero(open_ & (T_lo <= bound[rows]))
        if cand.size == 0:
            return
        if rnd < rounds and cand.size > _BEST_FIRST_MIN:  # one per row: the smallest lower bound
            cand = cand[np.lexsort((T_lo[cand], rows[cand]))]
            first = np.ones(cand.size, bool)
            first[1:] = rows[cand][1:] != rows[cand][:-1]
            cand = cand[first]
        np.minimum.at(bound, rows[cand], exact(cand))
        open_[cand] = False


# ---------------------------------------------------------------- draft lengths (spec section 8)

def _fill_levels(scorer: Scorer, ul, bottleneck):
    """Per (candidate, device): the number of lengths whose uplink phase, in the candidate's mode, is at most
    the candidate's bottleneck (uplink tables increase with L). Counted per distinct bottleneck."""
    tb = scorer.tb
    thr, inv = np.unique(bottleneck * (1 + 1e-12), return_inverse=True)
    same = bool(np.all(ul == ul[:1]))
    tabs = [(tb.up_ul, ul[0]), (tb.up_dl, ~ul[0])] if same else [(tb.up_ul, None), (tb.up_dl, None)]
    counts = []
    for tab, used in tabs:
        if used is not None and not used.any():
            counts.append(None)
            continue
        # tab[j, lev] <= thr[t] exactly from t = first[j, lev] on (thr sorted): count those per (t, j) and
        # accumulate over t, instead of comparing every length with every threshold
        first = np.searchsorted(thr, tab, side="left")
        hits = np.bincount((first * scorer.n + np.arange(scorer.n)[:, None]).ravel(),
                           minlength=(thr.size + 1) * scorer.n)
        c = np.cumsum(hits.reshape(thr.size + 1, scorer.n)[:-1], axis=0)
        counts.append(c[inv])
    cu, cd = counts
    if cu is None:
        return cd
    if cd is None:
        return cu
    return np.where(ul, cu, cd)


class FixedModes:
    """A greedy scorer with the same modes for every schedule (the baselines): score(L) -> (G, T, ul)."""

    def __init__(self, scorer: Scorer, ul, equal_power: bool = False):
        self.scorer, self.ul, self.equal_power = scorer, np.asarray(ul, bool), equal_power

    def __call__(self, L, floor: float | None = None):
        """Score draft-length vectors L (one per row) with the fixed modes: (G, T, ul)."""
        ul = np.broadcast_to(self.ul, np.shape(L))
        G, T = self.scorer.fixed(L, ul, equal_power=self.equal_power, floor=floor)
        return G, T, ul

    def neighbors(self, L0, ks, Lc):
        """The single increments Lc = L0 + e_k, incrementally; exact for every candidate that can be the
        best one (see `Scorer.fixed_neighbors`, exact=False)."""
        return self.scorer.fixed_neighbors(L0, ks, Lc, self.ul, self.equal_power, exact=False)


def _score_bounded(scorer: Scorer, score, Lf, Lc, T_c, floor: float):
    """G of the fill rows Lf, each raised from the candidate Lc with best round time T_c; -inf for rows
    that provably cannot reach `floor`, which are not scored.

    Every phase but T_ver grows with any L_k, whatever the modes, so the best round time of Lf is at least
    T_c + T_ver(Lf) - T_ver(Lc), and its goodput at most E(Lf) / that (synchronous rounds). Rows are scored
    in decreasing order of this bound, in growing chunks, and the floor rises with each chunk's best."""
    E = scorer.flat["E"][scorer._index(Lf)].sum(-1)
    dt = model.verify_time(scorer.sc, Lf) - model.verify_time(scorer.sc, Lc)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = E / (T_c + dt) * (1 + REL_TOL)  # the margin covers rounding
    bound = np.where(np.isnan(bound), np.inf, bound)
    G = np.full(Lf.shape[0], -np.inf)
    order = np.argsort(-bound, kind="stable")
    start, size = 0, 4
    while start < order.size:
        chunk = order[start:start + size]
        chunk = chunk[bound[chunk] >= floor]
        if chunk.size == 0:
            break  # sorted: no later row can reach the floor either
        G[chunk] = score(Lf[chunk], floor=floor)[0]  # rows provably below the floor come back as -inf
        floor = max(floor, float(G[chunk].max()))
        start, size = start + size, size * 4
    return G


_SPARSE_FILL_MIN_N = 256  # from this many devices the greedy bounds its fill rows without building them


class _Raised:
    """The single increments L0 + steps e_k (k in ks) without building them all: `rows(i)` builds rows on demand
    (an index: one row; an index array or slice: rows), np.asarray(...) all of them."""

    def __init__(self, L0, ks, steps=1):
        self.L0, self.ks, self.steps = np.asarray(L0), np.asarray(ks), np.broadcast_to(steps, np.shape(ks))
        self.shape = (self.ks.size, self.L0.size)

    def rows(self, i):
        """Row i (an integer) or the rows i (an index array, mask or slice)."""
        if np.ndim(i) == 0 and not isinstance(i, slice):
            row = self.L0.copy()
            row[self.ks[i]] += self.steps[i]
            return row
        idx = np.arange(self.ks.size)[i]
        out = np.repeat(self.L0[None], idx.size, axis=0)
        out[np.arange(idx.size), self.ks[idx]] += self.steps[idx]
        return out

    __getitem__ = rows

    def __array__(self, dtype=None, copy=None):
        out = self.rows(slice(None))
        return out if dtype is None else out.astype(dtype)


class _PrefixModes:
    """The modes of `Scorer.prefix_neighbors`' rows without their (C, N) array (`compact=True`): row c is UL where
    the base row's sorted position pos0 < best[c], except device ks[c] (UL iff k_ul[c]) and, where up[c] >= 0,
    device up[c] (UL: the base's device at position best[c], moved one down when k moved past it). A greedy step
    over thousands of devices then builds no (C, N) array (`_mode_pattern`); np.asarray(...) gives them all."""

    def __init__(self, pos0, best, ks, k_ul, up):
        self.pos0, self.best, self.ks, self.k_ul, self.up = pos0, best, ks, k_ul, up
        self.shape = (best.size, pos0.size)

    def rows(self, i):
        """The dense rows i (an index array, mask or slice)."""
        idx = np.arange(self.best.size)[i]
        out = self.pos0[None, :] < self.best[idx][:, None]
        q = np.arange(idx.size)
        out[q, self.ks[idx]] = self.k_ul[idx]
        moved = self.up[idx] >= 0
        out[q[moved], self.up[idx][moved]] = True
        return out

    __getitem__ = rows

    def __array__(self, dtype=None, copy=None):
        out = self.rows(slice(None))
        return out if dtype is None else out.astype(dtype)

    def at(self, r, j):
        """The modes of the (row, device) pairs (r, j)."""
        val = self.pos0[j] < self.best[r]
        val = np.where(j == self.ks[r], self.k_ul[r], val)
        return val | (j == self.up[r])

    def pattern(self):
        """Each device's most common mode over the rows (UL on a tie), as `2 * rows.sum(0) >= C`."""
        C = self.best.size
        count = C - np.searchsorted(np.sort(self.best), self.pos0, side="right")  # rows with pos0 < best
        np.add.at(count, self.ks, self.k_ul.astype(int) - (self.pos0[self.ks] < self.best))
        np.add.at(count, self.up[self.up >= 0], 1)  # never k itself, whose position is below best there
        return 2 * count >= self.best.size

    def differ(self, pattern, limit: int):
        """The (row, device) pairs whose mode differs from `pattern`, sorted by row (as np.nonzero of
        rows != pattern); None where the base rows differ in more than `limit` (the caller then builds the rows)."""
        by_pos = np.empty_like(self.pos0)
        by_pos[self.pos0] = np.arange(self.pos0.size)  # device at each sorted position
        pat = pattern[by_pos]
        f_pos, t_pos = np.flatnonzero(~pat), np.flatnonzero(pat)
        nf = np.searchsorted(f_pos, self.best)  # DL in the pattern, UL in the base row: positions < best
        st = np.searchsorted(t_pos, self.best)  # UL in the pattern, DL in the base row: positions >= best
        cnt = nf + (t_pos.size - st)
        if cnt.sum() > limit:
            return None
        r = np.repeat(np.arange(self.best.size), cnt)
        k = np.arange(r.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)  # index within the row's pairs
        nf_r = nf[r]
        f_pos, t_pos = np.append(f_pos, 0), np.append(t_pos, 0)  # padded: either may be empty
        pos = np.where(k < nf_r, f_pos[np.minimum(k, f_pos.size - 1)],
                       t_pos[np.clip(st[r] + k - nf_r, 0, t_pos.size - 1)])
        rows = np.arange(self.best.size)
        moved = self.up >= 0
        r = np.concatenate([r, rows, rows[moved]])
        j = np.concatenate([by_pos[pos], self.ks, self.up[moved]])
        keys = np.unique(r * self.pos0.size + j)
        r, j = keys // self.pos0.size, keys % self.pos0.size
        keep = self.at(r, j) != pattern[j]
        return r[keep], j[keep]


def _mode_pattern(ul, limit: int):
    """Each device's most common mode over the rows of ul ((C, N) bool, a broadcast row or `_PrefixModes`), the
    (row, device) pairs that differ from it, and their modes: (pattern, r, j, ul[r, j])."""
    none = np.empty(0, int)
    if isinstance(ul, _PrefixModes):
        pattern = ul.pattern()
        pairs = ul.differ(pattern, limit)
        if pairs is not None:
            return pattern, *pairs, ul.at(*pairs)
        ul = np.asarray(ul)
    elif ul.strides[0] == 0:  # fixed modes: one row broadcast to all
        return ul[0], none, none, np.empty(0, bool)
    else:
        pattern = 2 * ul.sum(axis=0) >= ul.shape[0]
    r, j = np.nonzero(ul != pattern[None, :])
    return pattern, r, j, ul[r, j]


def _level_sweep(L, tab, thr, tables, tab_order=None):
    """For every threshold in thr, with lev_j = #{l : tab[j, l-1] <= thr} (the fill level) and f_j = max(L_j,
    lev_j): sum_j V_j(f_j) for each table V in `tables` ((N, L_max), column l-1), the count sum_j (f_j - L_j),
    and the longest f_j above L with its device (0 and -1 where none). One sorted sweep of the events "device j
    reaches length l > L_j at tab[j, l-1]" and a search per threshold. tab_order: the stable argsort of
    tab.ravel() (`_sweep_order`: kept between greedy steps, no sort per step); its entries above L are in the
    order a stable sort of those alone gives (ties by flat index either way)."""
    n, lmax = tab.shape
    lens = np.broadcast_to(np.arange(1, lmax + 1), tab.shape)
    above = lens > L[:, None]
    if tab_order is None:
        tab_order = np.argsort(tab.ravel(), kind="stable")
    sel = tab_order[above.ravel()[tab_order]]  # flat entries above L, in time order
    times = tab.ravel()[sel]
    at = np.searchsorted(times, thr, side="right")
    # Only the events up to the last threshold are counted: the gains V(l) - V(l - 1) of those alone (the
    # cumulative sums of a prefix are the prefix of the cumulative sums), every table in one array
    used = sel[:at.max(initial=0)]
    flat = [V.ravel() for V in tables]
    gain = np.array([f[used] for f in flat]).reshape(len(flat), used.size)
    gain[:, used % lmax > 0] -= np.array([f[used - 1] for f in flat]).reshape(gain.shape)[:, used % lmax > 0]
    cum = np.zeros((len(flat), used.size + 1))
    np.cumsum(gain, axis=1, out=cum[:, 1:])
    at_L = np.arange(n) * lmax + L - 1
    sums = list(np.array([f[at_L] for f in flat]).reshape(len(flat), n).sum(axis=1)[:, None] + cum[:, at])
    level, dev = sel % lmax + 1, sel // lmax
    top = np.zeros(times.size + 1, int)
    top_dev = np.full(at.shape, -1)
    if times.size:
        top[1:] = np.maximum.accumulate(level)
        # the device of the running maximum: the last event that set it (levels of one device only grow), at
        # each threshold's count of events alone
        sets = np.flatnonzero(level == top[1:])
        some = at > 0
        top_dev[some] = dev[sets[np.searchsorted(sets, at[some] - 1, side="right") - 1]]
    return sums, at, top[at], top_dev


def _sweep_order(scorer: Scorer, pattern, tab):
    """The stable argsort of tab.ravel() for `_level_sweep`, kept per mode pattern on the scorer (the greedy's
    pattern rarely changes between steps, and the tables never do): a few patterns at most."""
    cache = scorer.sweep_orders
    key = pattern.tobytes()
    if key not in cache:
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = np.argsort(tab.ravel(), kind="stable")
    return cache[key]


def _dl_phase_lower(scorer: Scorer, ul, weighted_bits):
    """A lower bound of the optimal-power FDMA DL phase of the DL set ~ul whose sum_j S_j / g_j is weighted_bits
    (per row): channel inversion with the 1/g-weighted mean payload (Jensen; as `Scorer.fixed` with a floor)."""
    wts = np.where(ul, 0.0, scorer.inv_g)
    wsum = wts.sum()
    w = float(scorer._bandwidth(int((~ul).sum())))
    R = scorer.sc.downlink_power_w / (scorer.n0 * w)
    return weighted_bits / wsum / (w * log1p_ratio(R, wsum) / LN2)


def _bound_tables(scorer: Scorer, score) -> list:
    """Tables (N, L_max) whose sums over a fill row bound its round time beyond T_ver (`_round_time_lower`): for
    fixed modes with optimal DL power the DL-mode devices' S_j / g_j; on a shared uplink the band demands and
    slopes at `_SharedBase`'s deadlines and where a demand is infinite (as 2 B: no band is enough); else none."""
    sc, tb, n = scorer.sc, scorer.tb, scorer.n
    if isinstance(score, FixedModes) and not score.equal_power and sc.dl_access != "tdma" and (~score.ul).any():
        return [np.where(score.ul, 0.0, scorer.inv_g)[:, None] * tb.dl_bits]
    base = score.base if isinstance(score, SharedModes) else None
    if base is None:
        return []
    cap = 2.0 * sc.ul_total_bandwidth_hz()
    return ([np.minimum(t, cap).reshape(n, scorer.lmax) for t in base.demand]
            + [t.reshape(n, scorer.lmax) for t in base.slope]
            + [np.isinf(t).astype(float).reshape(n, scorer.lmax) for t in base.demand])


def _round_time_lower(scorer: Scorer, score, sums, bottleneck, t_ver):
    """A lower bound of each fill row's round time from the sums of `_bound_tables` over it: fixed modes, the
    bottleneck (its uplink phase) + T_ver + channel inversion with the mean DL payload (`_dl_phase_lower`) + t_0;
    a shared uplink, the split's uplink phase from below (`_SharedBase`) + T_ver + the base's later phases + t_0."""
    if isinstance(score, FixedModes):
        return (bottleneck + t_ver + _dl_phase_lower(scorer, score.ul, sums[0]) + scorer.t_over) / (1 + REL_TOL)
    base = score.base
    m = base.U.size
    U = base._uplink_lower(sums[:m] - scorer.sc.ul_total_bandwidth_hz(), sums[m:2 * m], sums[2 * m:] > 0.5)
    return (U + t_ver + base.after + scorer.t_over) * (1 - REL_TOL)


def _fill_rows_sparse(scorer: Scorer, score, neighbors, L, ks, ul, bottleneck, T, floor: float):
    """The fill rows of the single increments L + e_k (k in ks) as the dense path scores them (`greedy`:
    Lf = max(Lc, `_fill_levels`), changed rows only, `_score_bounded`), without building every row: (Lf, G) of
    the first best row in candidate order, what argmax over all of them picks (every row left unscored provably
    stays below the step's best), or empty arrays.

    `_score_bounded`'s upper bound of a row's goodput, E(Lf) / (T_c + T_ver(Lf) - T_ver(Lc)), needs only sums
    and maxima over devices. With every device in its most common mode over the rows (the pattern) they come from
    one sorted sweep (`_level_sweep`) and a search per row; each row then corrects the few devices where it
    differs from the pattern (device k, raised, and the devices whose mode is not the pattern's: usually one)."""
    sc, tb = scorer.sc, scorer.tb
    n, C = scorer.n, ks.size
    thr = bottleneck * (1 + 1e-12)  # as `_fill_levels`
    # the (row, device) pairs that differ from the pattern's sweep, and their modes
    pattern, r, j, ul_rj = _mode_pattern(ul, 8 * (C + n))
    tab_pat = np.where(pattern[:, None], tb.up_ul, tb.up_dl)
    extra = _bound_tables(scorer, score)
    (tokens, *weighted), count, top, top_dev = _level_sweep(L, tab_pat, thr, [tb.expected_tokens] + extra,
                                                            _sweep_order(scorer, pattern, tab_pat))
    raised = count.copy()  # sum_j (f_j - L_j) over the pattern's levels
    keys, first = np.unique(np.concatenate([r * n + j, np.arange(C) * n + ks]), return_index=True)
    ul_rj = np.concatenate([ul_rj, pattern[ks]])[first]  # device k in row c: its pattern mode if not in (r, j)
    r, j = keys // n, keys % n
    L_row = L[j] + (j == ks[r])
    tab_act = np.where(ul_rj[:, None], tb.up_ul[j], tb.up_dl[j])
    lev_act = (tab_act <= thr[r][:, None]).sum(-1)
    lev_pat = (tab_pat[j] <= thr[r][:, None]).sum(-1)
    f_act, f_pat = np.maximum(L_row, lev_act), np.maximum(L[j], lev_pat)
    E = tb.expected_tokens
    tokens = tokens + np.bincount(r, E[j, f_act - 1] - E[j, f_pat - 1], minlength=C)
    count = count + np.bincount(r, np.maximum(lev_act - L_row, 0) - np.maximum(lev_pat - L[j], 0), minlength=C)
    changed = np.flatnonzero(count > 0.5)  # some device's level above its length in Lc
    if sc.verify_batch == "ragged":
        pos = L.sum() + n + raised + np.bincount(r, f_act - f_pat, minlength=C)  # (k's +1 is in f_act)
        t_f = model.verify_time_of(sc, pos, None, n)
    else:  # the sweep's longest counts only where its device is not a corrected one (a lower bound elsewhere)
        longest = np.full(C, L.max())
        np.maximum.at(longest, r, f_act)
        top_ok = ~np.isin(np.arange(C) * n + top_dev, keys) & (top_dev >= 0)
        longest = np.maximum(longest, np.where(top_ok, top, 0))
        t_f = model.verify_time_of(sc, None, longest, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = tokens / (T + t_f - scorer._verify_raised(L, ks)) * (1 + REL_TOL)  # the margin covers rounding
        if extra:
            sums = np.array([w + np.bincount(r, t[j, f_act - 1] - t[j, f_pat - 1], minlength=C)
                             for w, t in zip(weighted, extra)])
            bound = np.minimum(bound, tokens / _round_time_lower(scorer, score, sums, bottleneck, t_f))
    bound = np.where(np.isnan(bound), np.inf, bound)
    pool = changed[bound[changed] >= floor]
    if pool.size == 0:
        return np.empty((0, n), int), np.empty(0)
    if np.unique(raised[pool]).size <= _FILL_GROUPS_MAX:
        return _score_fill_groups(scorer, score, neighbors, L, ks, pool, thr, raised, tab_pat,
                                  (r, j, f_act - f_pat))
    return _score_fill_chunks(scorer, score, L, ks, ul, bottleneck, changed, bound, floor)


_FILL_GROUPS_MAX = 64  # at most this many distinct fill patterns: fill rows scored as increments of one row each


def _score_fill_chunks(scorer: Scorer, score, L, ks, ul, bottleneck, changed, bound, floor: float):
    """Score the fill rows `changed` as `_score_bounded` does, highest bound first in growing chunks, each chunk
    built only when reached: (Lf, G) of the first best row (`_first_best`)."""
    n, C = scorer.n, ks.size
    G = np.full(C, -np.inf)
    scored = {}
    order = changed[np.argsort(-bound[changed], kind="stable")]
    start, size = 0, 4
    while start < order.size:
        chunk = order[start:start + size]
        chunk = chunk[bound[chunk] >= floor]
        if chunk.size == 0:
            break  # sorted: no later row can reach the floor either
        Lf, inv = _distinct_fill_rows(scorer, L, ks[chunk], np.asarray(ul[chunk]), bottleneck[chunk])
        G[chunk] = score(Lf, floor=floor)[0][inv]  # rows provably below the floor come back as -inf
        scored.update(zip(chunk.tolist(), (Lf[i] for i in inv)))
        floor = max(floor, float(G[chunk].max()))
        start, size = start + size, size * 4
    return _first_best(scored, G, n)


def _distinct_fill_rows(scorer: Scorer, L, ks, ul, bottleneck):
    """The fill rows max(L + e_k, `_fill_levels`) of the increments ks, each distinct row once: (rows, inv), row c
    is rows[inv[c]]. With every row in the same modes a row is set by its bottleneck and, unless the fill already
    lifts device k past L_k + 1, by k: rows are built per distinct (bottleneck, k) only (often one for hundreds)."""
    n = scorer.n
    if not np.all(ul == ul[:1]):
        Lc = np.repeat(L[None], ks.size, axis=0)
        Lc[np.arange(ks.size), ks] += 1
        return np.maximum(Lc, _fill_levels(scorer, ul, bottleneck)), np.arange(ks.size)
    thr, level_of = np.unique(bottleneck, return_inverse=True)
    levels = _fill_levels(scorer, np.broadcast_to(ul[0], (thr.size, n)), thr)
    lifted = L[ks] + 1 <= levels[level_of, ks]  # the fill alone gives device k at least L_k + 1
    _, first, inv = np.unique(level_of * (n + 1) + np.where(lifted, n, ks), return_index=True, return_inverse=True)
    rows = np.maximum(levels[level_of[first]], L[None])
    k = ks[first]
    rows[np.arange(first.size), k] = np.maximum(rows[np.arange(first.size), k], L[k] + 1)
    return rows, inv.ravel()


def _score_fill_groups(scorer: Scorer, score, neighbors, L, ks, pool, thr, group, tab_pat, diffs):
    """Score the fill rows `pool` in groups of the same pattern levels (`group`: the count of the sweep's events
    under each row's threshold, thr). Within a group every row is M = max(L, the pattern levels) but for the few
    devices `diffs` ((row, device, Lf - M) for the pairs `_fill_rows_sparse` corrects):
    a row equal to M is scored once, a row M + e_j among M's single increments (`neighbors`: exact for every row
    that can be the best), any other row in full. Returns (Lf, G) in candidate order."""
    n = scorer.n
    r, j, d = diffs
    nz = d != 0
    r, j, d = r[nz], j[nz], d[nz]
    in_pool = np.zeros(ks.size, bool)
    in_pool[pool] = True
    keep = in_pool[r]
    r, j, d = r[keep], j[keep], d[keep]
    nnz = np.bincount(r, minlength=ks.size)
    up = d == 1 if neighbors != scorer.prefix_neighbors else d > 0  # only the prefix scorer takes steps > 1
    one_up = np.zeros(ks.size, bool)
    one_up[r[up]] = True
    one_up &= nnz == 1
    inc_dev = np.full(ks.size, -1)
    inc_dev[r[up]] = j[up]
    inc_step = np.ones(ks.size, int)
    inc_step[r[up]] = d[up]
    G = np.full(ks.size, -np.inf)
    Lf_of = {}
    for v in np.unique(group[pool]):
        rows = pool[group[pool] == v]
        M = np.maximum(L, (tab_pat <= thr[rows[0]]).sum(-1))
        same = rows[nnz[rows] == 0]
        if same.size:
            G[same] = score(M[None])[0][0]
            Lf_of.update((c, M) for c in same.tolist())
        inc = rows[one_up[rows]]
        if inc.size:
            moves, where = np.unique(inc_dev[inc] * (scorer.lmax + 1) + inc_step[inc], return_inverse=True)
            devs, steps = moves // (scorer.lmax + 1), moves % (scorer.lmax + 1)
            raised = _Raised(M, devs, steps)
            if neighbors != scorer.prefix_neighbors:
                G[inc] = neighbors(M, devs, raised)[0][where]
            else:  # G only: the modes stay compact
                G[inc] = scorer.prefix_neighbors(M, devs, raised, steps=steps, compact=True)[0][where]
            Lf_of.update((c, (raised, w)) for c, w in zip(inc.tolist(), where.tolist()))  # built if chosen
        other = rows[(nnz[rows] > 0) & ~one_up[rows]]
        if other.size:
            Lo = np.repeat(M[None], other.size, axis=0)
            sel = np.isin(r, other)
            Lo[np.searchsorted(other, r[sel]), j[sel]] += d[sel]
            G[other] = score(Lo)[0]
            Lf_of.update(zip(other.tolist(), Lo))
    return _first_best(Lf_of, G, n)


def _first_best(rows: dict, G, n: int):
    """Of the scored fill rows (candidate index -> Lf, or (_Raised, its row)), the first best in candidate order
    (what argmax over all of them picks), as (Lf (1, N), G (1,)); none: empty arrays."""
    if not rows:
        return np.empty((0, n), int), np.empty(0)
    done = np.array(sorted(rows))
    i = int(done[np.argmax(G[done])])
    row = rows[i]
    return np.asarray(row[0].rows(int(row[1])) if isinstance(row, tuple) else row)[None], G[i:i + 1]


def greedy(scorer: Scorer, score, fill: bool, start=None, batch: int | None = None):
    """Greedy draft lengths: take the best single increment (and, with fill, the best increment with
    every other device raised to the new bottleneck) until nothing gains. score(L) -> (G, T, ul).

    The single increments are scored incrementally from the current schedule when the scorer can
    (`Scorer.prefix` and `FixedModes`); fill rows that provably cannot be the step's best are skipped.
    Both give the same steps as scoring every row in full.

    batch (default: `_BATCH_START` on a shared uplink from `_BATCH_MIN_N` devices, else 0): each step also
    scores the best `batch` increments raised together (`_batch_step`) and takes that row where it beats the
    step's best; 0 or 1: single steps only (the search before batching)."""
    n, lmax = scorer.n, scorer.sc.max_draft_len
    f = scorer.flat
    if score == scorer.prefix:
        neighbors, bounded = scorer.prefix_neighbors, scorer.prefix_exact
    else:
        neighbors = getattr(score, "neighbors", None)
        bounded = neighbors is not None and scorer.incremental
    if n < _INCREMENTAL_MIN_N:
        neighbors = None
    L = np.ones(n, int) if start is None else np.asarray(start, int).copy()
    g_cur = score(L[None])[0][0]
    if batch is None:
        batch = _BATCH_START if scorer.shared and n >= _BATCH_MIN_N else 0
    while True:
        cand = np.flatnonzero(L < lmax)
        if cand.size == 0:
            break
        sparse = neighbors is not None and bounded and n >= _SPARSE_FILL_MIN_N
        Lc = _Raised(L, cand) if sparse else _Raised(L, cand).rows(slice(None))
        # neighbors also give each row's uplink phase (None: computed here)
        compact = {"compact": True} if sparse and neighbors == scorer.prefix_neighbors else {}  # no (C, N) modes
        G, T, ul, bottleneck = neighbors(L, cand, Lc, **compact) if neighbors is not None else (*score(Lc), None)
        rows = [(Lc, G)]
        if fill:
            if bottleneck is None:
                idx = scorer._index(Lc)
                bottleneck = np.where(ul, f["up_u"][idx], f["up_d"][idx]).max(-1)
            if sparse:
                rows.append(_fill_rows_sparse(scorer, score, neighbors, L, cand, ul, bottleneck, T,
                                              max(float(G.max()), g_cur * (1 + _REL_GAIN))))
            else:
                Lf = np.maximum(Lc, _fill_levels(scorer, ul, bottleneck))
                changed = np.flatnonzero(np.any(Lf != Lc, axis=1))
                if changed.size:
                    Lf = Lf[changed]
                    if bounded and Lf.shape[0] >= _BOUNDED_MIN_ROWS:
                        Gf = _score_bounded(scorer, score, Lf, Lc[changed], T[changed],
                                            max(float(G.max()), g_cur * (1 + _REL_GAIN)))
                    else:
                        Gf = score(Lf)[0]
                    rows.append((Lf, Gf))
        # the first best row over the single increments, then the fill rows (argmax of both, concatenated)
        L_best, g_best = None, -np.inf
        for Ls, Gs in rows:
            if Gs.size == 0:
                continue
            i = int(np.argmax(Gs))
            if Gs[i] > g_best:
                L_best, g_best = (Ls.rows(i) if isinstance(Ls, _Raised) else Ls[i]), Gs[i]
        if not g_best > g_cur * (1 + _REL_GAIN):
            break
        if batch > 1:  # the best increments together, where that beats the best single row
            L_b, g_b = _batch_step(score, L, cand, G, g_cur, batch)
            if g_b > g_best:
                L_best, g_best, batch = L_b, g_b, batch * 2
            else:
                batch //= 4  # below 2: single steps from here on
        L, g_cur = L_best.copy(), g_best
    return L


# Batched steps (`greedy` on a shared uplink): on bands split for one schedule the devices' uplink phases line up,
# fill rows add nothing and the greedy climbed one device at a time (1,013 steps at N = 4,096).
_BATCH_START = 8    # first batch size, doubled while batches win, quartered when one loses (0: single steps only)
_BATCH_RATIO = 0.5  # a batch holds the increments whose gain is at least this share of the best one's
_BATCH_MIN_N = 8    # fewer devices: single steps (the exhaustive checks' sizes)


def _batch_step(score, L, cand, G, g_cur: float, size: int):
    """Every device of the `size` best single increments whose gain is within `_BATCH_RATIO` of the best one's,
    raised together and scored: (L, G) of that row (G = -inf: fewer than two such devices)."""
    gain = np.asarray(G, float) - g_cur
    order = np.argsort(-gain, kind="stable")[:size]
    order = order[gain[order] >= _BATCH_RATIO * gain[order[0]]]
    if order.size < 2 or not gain[order[0]] > 0:  # (the step's best is a fill row: no increment gains)
        return L, -np.inf
    L_b = L.copy()
    L_b[cand[order]] += 1
    return L_b, float(score(L_b[None])[0][0])


# ---------------------------------------------------------------- plans

@dataclass(frozen=True)
class DevicePlan:
    """One device's entry of a plan: its schedule (mode, draft length, powers) and the model's prediction."""

    name: str
    mode: str
    draft_len: int
    ul_power_w: float
    dl_power_w: float
    expected_tokens: float
    goodput_tps: float
    uplink_s: float         # drafting + first uplink (tau_up)
    downlink_s: float
    draft_s: float
    tx_s: float             # the first uplink's air time
    ul_rate_bps: float
    dl_rate_bps: float
    ul_bits: float
    dl_bits: float
    ul_bandwidth_hz: float  # the device's UL band: its own, or its share of a shared uplink (ul_access)


@dataclass
class Plan:
    """One planned round: the policy, the scenario it was planned on, the model's evaluation of the chosen schedule,
    and policy extras (`info`: seed, fixed length, evaluation count)."""

    policy: str
    scenario: Scenario
    evaluation: model.Evaluation
    info: dict = field(default_factory=dict)

    @property
    def modes(self):
        """Per-device modes, 'UL' or 'DL', in device order."""
        return self.evaluation.modes

    @property
    def draft_lens(self):
        """Per-device draft lengths L_k (int array, tokens), in device order."""
        return self.evaluation.draft_lens

    @property
    def goodput_tps(self):
        """Predicted sum goodput G, tokens/s."""
        return self.evaluation.goodput_tps

    def device_plans(self) -> list[DevicePlan]:
        """The per-device entries, in device order, as plain Python numbers."""
        ev = self.evaluation
        return [DevicePlan(
            name=name, mode=ev.modes[k], draft_len=int(ev.draft_lens[k]),
            ul_power_w=float(ev.ul_power_w[k]), dl_power_w=float(ev.dl_power_w[k]),
            expected_tokens=float(ev.expected_tokens[k]), goodput_tps=float(ev.goodput[k]),
            uplink_s=float(ev.uplink_s[k]), downlink_s=float(ev.downlink_s[k]),
            draft_s=float(ev.draft_s[k]), tx_s=float(ev.tx_s[k]),
            ul_rate_bps=float(ev.ul_rate_bps[k]), dl_rate_bps=float(ev.dl_rate_bps[k]),
            ul_bits=float(ev.ul_bits[k]), dl_bits=float(ev.dl_bits[k]),
            ul_bandwidth_hz=float(ev.ul_bandwidth_hz[k]),
        ) for k, name in enumerate(ev.names)]

    def to_dict(self) -> dict:
        """The plan as JSON-ready numbers (powers in W, rates in bit/s, payloads in bits, times in s): what
        `multispin plan --json` prints and the controller records."""
        ev = self.evaluation
        return {
            "policy": self.policy, "goodput_tps": ev.goodput_tps, "round_time_s": ev.round_time_s,
            "phases_s": dict(ev.phases), "num_ul_devices": ev.num_ul_devices,
            "dl_bandwidth_per_device_hz": ev.dl_bandwidth_per_device_hz,
            # Shallow: a DevicePlan holds plain numbers (asdict deep-copies, a third of a 256-device plan).
            "devices": [{k: getattr(d, k) for k in _DEVICE_PLAN_KEYS} for d in self.device_plans()], **self.info,
        }


_DEVICE_PLAN_KEYS = tuple(f.name for f in dataclasses.fields(DevicePlan))


def exhaustive_modes(sc: Scenario, draft_lens, scorer: Scorer | None = None):
    """Best mode vector for fixed lengths by trying all 2^N (the check on the prefix search)."""
    s = scorer or Scorer(sc)
    n = sc.num_devices
    if 2 ** n > EXHAUSTIVE_LIMIT:
        raise OptimizerError(f"exhaustive mode search over 2^{n} vectors exceeds {EXHAUSTIVE_LIMIT:.0e}")
    ul = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)
    L = np.repeat(np.asarray(draft_lens, int)[None], ul.shape[0], axis=0)
    G = s.exact(L, ul)[0]
    i = int(np.argmax(G))
    return ul[i], float(G[i])


def _exhaustive(sc: Scenario, s: Scorer, limit: int):
    n, lmax = sc.num_devices, sc.max_draft_len
    total = (2 ** n) * (lmax ** n)
    if total > limit:
        raise OptimizerError(
            f"exhaustive search needs 2^{n} x {lmax}^{n} = {total:.3g} evaluations, more than the limit "
            f"{limit:.0e}; use fewer devices or a smaller max_draft_len (e.g. N <= 4 with L_max <= 12)")
    ul_all = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)
    best = (-np.inf, None, None)
    lens = np.array(list(itertools.product(range(1, lmax + 1), repeat=n)), int)
    chunk = max(1, 200_000 // ul_all.shape[0])
    for start in range(0, lens.shape[0], chunk):
        Lb = lens[start:start + chunk]
        L = np.repeat(Lb, ul_all.shape[0], axis=0)
        ul = np.tile(ul_all, (Lb.shape[0], 1))
        G = s.exact(L, ul)[0]  # a shared uplink: the min-max split of every row
        i = int(np.argmax(G))
        if G[i] > best[0] or best[1] is None:
            best = (G[i], L[i].copy(), ul[i].copy())
    return best[1], best[2]


def _fixed_bound(s: Scorer, t_ones: float) -> float:
    """An upper bound of the goodput of any schedule under fixed modes whose round time at L = 1 is t_ones
    (synchronous rounds). Every phase grows with L (`Scorer.monotone`; else sum E(L_max) / t_ones), so a
    schedule of S more draft positions than L = 1 takes at least t_ones plus the verification those add, and
    its expected tokens are at most E(1) plus the S largest single-step gains of the table (or, padded, each
    device's E at the longest L)."""
    E = s.tb.expected_tokens
    if not s.monotone:
        return float(E[:, -1].sum() / t_ones)
    n, lmax = E.shape
    if s.sc.verify_batch == "ragged":
        gains = np.sort(np.diff(E, axis=1).ravel())[::-1]
        tokens = E[:, 0].sum() + np.concatenate([[0.0], np.cumsum(gains)])
        extra = model.verify_time_of(s.sc, np.arange(tokens.size) + 2.0 * n, None, n)
    else:
        tokens = E.sum(axis=0)  # the longest L is m: no device beyond E(m)
        extra = model.verify_time_of(s.sc, None, np.arange(1, lmax + 1), n)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = tokens / (t_ones + extra - extra[0]) * (1 + REL_TOL)  # the margin covers rounding
    return float(np.nanmax(bound))


def fixed_greedy(s: Scorer, ul) -> np.ndarray:
    """Greedy with fill under the fixed modes `ul` (`FixedModes`, optimal DL powers), once per scorer and mode
    vector: `proposed` on a shared uplink asks for the all-UL and all-DL points that `_multistart` may have
    computed on the same scorer already."""
    ul = np.asarray(ul, bool)
    key = ul.tobytes()
    if key not in s.greedy_fixed:
        s.greedy_fixed[key] = greedy(s, FixedModes(s, ul), fill=True)
    return s.greedy_fixed[key].copy()


def _multistart(s: Scorer, fixed_scorer=None) -> np.ndarray:
    """Greedy with fill is path dependent: from L = 1 the cheap short UL uploads look best, and the
    region of long drafts over a shared DL is not reached one device at a time. So start it from
    several points (all ones; the lengths all-DL and all-UL greedy reach; the best common length),
    score each start with the prefix mode search, and continue greedy with fill from the best. The
    result is never below the all-UL, all-DL, common-length or fixed-length baselines."""
    n, lmax = s.n, s.sc.max_draft_len
    common = np.repeat(np.arange(1, lmax + 1)[:, None], n, axis=1)
    first = greedy(s, s.prefix, fill=True)
    G = s.prefix(np.vstack([first[None], common]))[0]  # each start is scored once
    starts, scores = [first, common[int(np.argmax(G[1:]))]], [G[0], G[1:].max()]
    ul_starts = np.array([np.zeros(n, bool), np.ones(n, bool)])
    T_ones = s.fixed(np.ones((2, n), int), ul_starts)[1]
    for ul, t_ones in zip(ul_starts, T_ones):
        if s.sc.rounds == "synchronous" and _fixed_bound(s, t_ones) <= max(scores):
            continue  # a start that cannot beat what is already in hand
        L = fixed_greedy(s, ul) if fixed_scorer is None else greedy(s, fixed_scorer(ul), fill=True)
        starts.append(L)
        scores.append(s.prefix(L[None])[0][0])
    best = int(np.argmax(scores))
    if best == 0:  # the first start is where this same greedy stopped: continuing from it adds nothing
        return first
    return greedy(s, s.prefix, fill=True, start=starts[best])


class SharedModes:
    """A greedy scorer with fixed modes on a shared uplink: every row scored with its own min-max band split
    (`Scorer.exact`); on dedicated bands it is `FixedModes`. score(L) -> (G, T, ul)."""

    def __init__(self, scorer: Scorer, ul):
        self.scorer, self.ul = scorer, np.asarray(ul, bool)
        self.base = None  # the greedy's current schedule (`_SharedBase`), set by `neighbors`

    def __call__(self, L, floor: float | None = None):
        """Score draft-length vectors L (one per row) with the fixed modes, each row split anew: (G, T, ul).
        floor (the greedy's fill rows, all >= the schedule `neighbors` saw last): rows whose goodput provably
        stays below it are not split and get G = -inf and a lower bound of T."""
        L = np.asarray(L)
        ul = np.broadcast_to(self.ul, L.shape)
        base = self.base
        if floor is None or base is None or not np.all(L >= base.L0):
            G, T, _ = self.scorer.exact(L, ul)
            return G, T, ul
        T = base.round_time_lower(L)
        G = np.full(L.shape[0], -np.inf)
        keep = np.flatnonzero(self.scorer.flat["E"][self.scorer._index(L)].sum(-1) / T >= floor)
        if keep.size:
            G[keep], T[keep], _ = self.scorer.exact(L[keep], ul[keep], start_s=base.U_start)
        return G, T, ul

    def neighbors(self, L0, ks, Lc):
        """The single increments Lc = L0 + e_k; exact for every candidate that can be the best one, the others
        G = -inf and a lower bound of T. Synchronous rounds with monotone tables (`Scorer.incremental`) on a
        shared uplink; otherwise every row is scored in full."""
        s = self.scorer
        if not s.shared:
            return s.fixed_neighbors(L0, ks, Lc, self.ul, exact=False)
        ul_rows = np.broadcast_to(self.ul, Lc.shape)
        prev = self.base if self.base is not None and np.all(np.asarray(L0) >= self.base.L0) else None
        self.base = _SharedBase.of(s, self.ul, np.asarray(L0), prev) if s.incremental else None
        if self.base is None:
            G, T, _ = s.exact(Lc, ul_rows)
            return G, T, ul_rows, None
        T = self.base.raised_round_time_lower(np.asarray(ks))
        bound = s._raised_tokens(self.base.L0, np.asarray(ks) * s.lmax + self.base.L0[ks]) / T
        G = np.full(Lc.shape[0], -np.inf)
        order = np.argsort(-bound, kind="stable")
        best, start, size = -np.inf, 0, 4
        while start < order.size:  # highest bound first, in growing chunks, until no bound reaches the best
            chunk = order[start:start + size]
            chunk = chunk[bound[chunk] >= best]
            if chunk.size == 0:
                break  # sorted: no later candidate can reach the best either
            G[chunk], T[chunk], _ = s.exact(Lc[chunk], ul_rows[chunk], start_s=self.base.U_start)
            best = max(best, float(G[chunk].max()))
            start, size = start + size, size * 4
        return G, T, ul_rows, self._bottleneck(np.asarray(L0), np.asarray(ks))

    def _bottleneck(self, L0, ks):
        """Each increment's largest tabulated uplink phase in these modes (the greedy's fill bottleneck, as it
        computes it from the rows) from L0's maximum and second maximum: no (C, N) array."""
        s, f = self.scorer, self.scorer.flat
        idx0 = s.offset[0] + L0 - 1
        base = np.where(self.ul, f["up_u"][idx0], f["up_d"][idx0])
        new = ks * s.lmax + L0[ks]
        m1, m2 = (m[-1] for m in s._top2(base))
        others = np.where(base[ks] == m1, m2, m1)  # the largest without k
        return np.maximum(others, np.where(self.ul[ks], f["up_u"][new], f["up_d"][new]))


_GRID = np.array([0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0])  # `_SharedBase`: U_0 (1 + these)


@dataclass
class _SharedBase:
    """Lower bounds of the round time of schedules L >= L0 (fixed modes, shared uplink) from the split of L0.

    Raising any L_k only raises device k's bits and drafting time, so its band demand b_k(U) (`uplink.demand`)
    and with it the uplink phase: U(L) >= U_0 (L0's). F_L(U) = sum_k b_k(U) - B is convex and decreasing, so at
    any U with F_L(U) >= 0 (U_0 is one) the root lies right of U and right of U's Newton step. Demand tables at a
    few deadlines U_0 (1 + `_GRID`) (every device and length) give F_L and F_L' there as sums per row, no split:
    the bound is the Newton step from the last of them with F_L >= 0. Every later phase grows with L too
    (`Scorer.monotone`), so T(L) >= U(L) + T_ver(L) + (L0's phases after its uplink) + t_0."""

    scorer: Scorer
    L0: np.ndarray
    after: float
    U: np.ndarray        # (m,) the deadlines
    demand: np.ndarray   # (m, N L_max) b_k(U) per deadline and flat table entry; slope: db_k/dU there
    slope: np.ndarray
    alone: np.ndarray    # (N L_max,) each entry's uplink alone with all the band the others leave it
    inputs: tuple = ()   # (S, c, a) of every entry in these modes: the split's inputs (`Scorer.shared_inputs`)

    @classmethod
    def of(cls, s: Scorer, ul, L0, prev: _SharedBase | None = None):
        """The bounds around L0, or None where demands do not grow with L (the bound needs them to).

        prev: the bounds of an earlier schedule <= L0 in the same modes (the greedy's previous step). Its
        deadlines above U_0 are kept with their tables (any deadline up to U(L) is a valid start of the
        Newton step: F_L >= 0 there), and only U_0's table is new: one demand table a step instead of
        `_GRID`'s nine, while at least five deadlines remain (then all nine anew)."""
        sc, n, lmax = s.sc, s.n, s.lmax
        B, bmin = sc.ul_total_bandwidth_hz(), sc.ul_min_band_hz()
        if prev is not None:
            S, c, a = prev.inputs
        else:
            S, c = s.shared_inputs(np.arange(n * lmax), np.repeat(ul, lmax))
            if np.any(np.diff(S.reshape(n, lmax), axis=1) < 0) or np.any(np.diff(c.reshape(n, lmax), axis=1) < 0):
                return None
            a = np.repeat(s.tb.snr_hz, lmax)
        up0, _ = s.shared_up(L0[None], ul[None], None if prev is None else prev.U_start)
        T0 = s.fixed(L0[None], ul[None], up=up0)[1][0]
        U0 = float(up0.max())
        kept = np.flatnonzero(prev.U > U0) if prev is not None else np.empty(0, int)
        if kept.size >= 4:
            d0, s0 = uplink.demand(S, c, a, U0, bmin)
            U = np.concatenate([[U0], prev.U[kept]])
            demand = np.concatenate([d0[None], prev.demand[kept]])
            slope = np.concatenate([s0[None], prev.slope[kept]])
            alone = prev.alone
        else:
            U = U0 * (1.0 + _GRID)
            demand, slope = uplink.demand(S[None], c[None], a[None], U[:, None], bmin)
            with np.errstate(divide="ignore", invalid="ignore"):
                alone = c + np.where(S > 0, S / uplink.rate_bps(B - (n - 1) * bmin, a), 0.0)
        after = T0 - U0 - float(model.verify_time(sc, L0)) - s.t_over
        return cls(s, np.asarray(L0).copy(), after, U, demand, slope, alone, (S, c, a))

    @property
    def U_start(self) -> float:
        """A lower bound of the uplink phase of any schedule >= L0 in these modes, below L0's own by more than
        its rounding: the splits' warm start (`uplink.split`)."""
        return self.U[0] * (1.0 - 1e-12)

    def _uplink_lower(self, F, dF, blocked=None):
        """From F_L and F_L' at the deadlines ((m, C)): the Newton step from the last deadline with F_L >= 0
        (none where `blocked`: some demand there is infinite and F_L only a lower value)."""
        ok = F >= 0
        ok[0] = True  # F_L(U_0) >= 0 up to rounding (the margin of the round time covers it)
        last = self.U.size - 1 - np.argmax(ok[::-1], axis=0)
        cols = np.arange(F.shape[1])
        f, df, u = F[last, cols], dF[last, cols], self.U[last]
        ok_step = np.isfinite(f) & (f > 0) & (df < 0)
        if blocked is not None:
            ok_step &= ~blocked[last, cols]
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.where(ok_step, -f / df, 0.0)
        return u + np.nan_to_num(step, nan=0.0)

    def round_time_lower(self, L):
        """A lower bound of the round time of each row of L (all >= L0), with a margin for rounding."""
        s = self.scorer
        idx = s._index(L)
        B = s.sc.ul_total_bandwidth_hz()
        F = np.stack([d[idx].sum(-1) for d in self.demand]) - B
        dF = np.stack([d[idx].sum(-1) for d in self.slope])
        U = np.maximum(self._uplink_lower(F, dF), self.alone[idx].max(-1))
        return (U + model.verify_time(s.sc, L) + self.after + s.t_over) * (1 - REL_TOL)

    def raised_round_time_lower(self, ks):
        """`round_time_lower` of the single increments L0 + e_k, k in ks, in O(1) each (no (C, N) rows)."""
        s = self.scorer
        idx0 = s.offset[0] + self.L0 - 1
        new = ks * s.lmax + self.L0[ks]
        B = s.sc.ul_total_bandwidth_hz()
        F = self.demand[:, idx0].sum(-1)[:, None] - B + self.demand[:, new] - self.demand[:, new - 1]
        dF = self.slope[:, idx0].sum(-1)[:, None] + self.slope[:, new] - self.slope[:, new - 1]
        alone = self.alone[idx0]
        m1, m2 = (m[-1] for m in s._top2(alone))
        others = np.where(alone[ks] == m1, m2, m1)  # the largest without k
        U = np.maximum(self._uplink_lower(F, dF), np.maximum(others, self.alone[new]))
        return (U + s._verify_raised(self.L0, ks) + self.after + s.t_over) * (1 - REL_TOL)


_ALL_MODES_MAX_N = 8  # proposed on a shared uplink polishes with every mode vector per candidate up to this N


class SharedAllModes:
    """Greedy scorer on a shared uplink for small N: each row gets the best of all 2^N mode vectors, each
    scored with its own band split. score(L) -> (G, T, ul)."""

    def __init__(self, scorer: Scorer):
        n = scorer.n
        self.scorer = scorer
        self.modes = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)

    def __call__(self, L, floor: float | None = None):
        """Score draft-length vectors L (one per row), each with its best mode vector: (G, T, ul)."""
        L = np.asarray(L)
        C, m = L.shape[0], self.modes.shape[0]
        G, T, _ = self.scorer.exact(np.repeat(L, m, axis=0), np.tile(self.modes, (C, 1)))
        G, T = G.reshape(C, m), T.reshape(C, m)
        best = np.argmax(G, axis=1)
        rows = np.arange(C)
        return G[rows, best], T[rows, best], self.modes[best]


def _local_search(score, L, ul, g, lmax: int):
    """Steepest ascent over the moves L +- e_k (up to 6 devices: every L + d, d in {-1, 0, 1}^N), each row with
    `score`'s modes, until none gains."""
    n = L.size
    if 6 ** n <= 50_000:  # every move in {-1, 0, 1}^N (x 2^N mode vectors per row)
        moves = np.array(list(itertools.product((-1, 0, 1), repeat=n)), int)
        moves = moves[np.any(moves != 0, axis=1)]
    else:
        moves = np.vstack([np.eye(n, dtype=int), -np.eye(n, dtype=int)])
    while True:
        Lc = L[None] + moves
        Lc = Lc[np.all((Lc >= 1) & (Lc <= lmax), axis=1)]
        if Lc.shape[0] == 0:
            return L, ul
        G, _, uls = score(Lc)
        i = int(np.argmax(G))
        if not G[i] > g * (1 + _REL_GAIN):
            return L, ul
        L, ul, g = Lc[i], uls[i], G[i]


def _multispin_homogeneous(s: Scorer):
    """Every device UL with one common length: each L of 1..L_max scored with its band split, the best kept."""
    n, lmax = s.n, s.lmax
    Lc = np.repeat(np.arange(1, lmax + 1)[:, None], n, axis=1)
    G = s.exact(Lc, np.ones(Lc.shape, bool))[0]
    return Lc[int(np.argmax(G))], np.ones(n, bool)


def _multispin_heterogeneous(s: Scorer):
    """Every device UL, per-device lengths: greedy with fill, each candidate scored with its own band split."""
    ul = np.ones(s.n, bool)
    score = SharedModes(s, ul) if s.shared else FixedModes(s, ul)
    return greedy(s, score, fill=True), ul


def _proposed_shared(sc: Scenario, s_eq: Scorer, fixed_length: int):
    """`proposed` on a shared uplink: modes, lengths, DL powers and UL bands together.

    (1) Alternating: plan modes and lengths with the dedicated-band machinery (`_multistart`, prefix modes) on the
    current bands (first the equal share B/N), split the band optimally for that schedule, and plan again on those
    bands while the goodput with the split improves (at most 3 rounds). (2) The schedules of the baselines that
    plan on the equal share (all-UL, all-DL, every common length with prefix modes or all UL: common-length,
    fixed-length, multispin-homogeneous) and multispin-heterogeneous (at every N: until it was fast, only up to
    64 devices, and proposed fell below it above that). Every candidate is scored with its own split; the best is
    polished by greedy with fill on exact scoring (modes fixed to its own, up to `_POLISH_MAX_N` devices; then the
    prefix modes on its bands). Never below those baselines (each is a candidate)."""
    n, lmax = s_eq.n, s_eq.lmax
    cands: list[tuple[np.ndarray, np.ndarray]] = []
    s, best_g = s_eq, -np.inf
    for _ in range(3):
        L = _multistart(s)
        ul = s.prefix(L[None])[2][0]
        cands.append((L, ul))
        G, _, bands = s_eq.exact(L[None], ul[None])
        if not G[0] > best_g * (1 + _REL_GAIN):
            break
        best_g = G[0]
        s = Scorer(sc, ul_bandwidths=bands[0])
    Lc = np.repeat(np.arange(1, lmax + 1)[:, None], n, axis=1)
    ulc = s_eq.prefix(Lc)[2]
    cands += [(Lc[i], ulc[i]) for i in range(lmax)] + [(Lc[i], np.ones(n, bool)) for i in range(lmax)]
    cands.append(_multispin_heterogeneous(s_eq))
    Ls = np.array([c[0] for c in cands])
    uls = np.array([c[1] for c in cands])
    G = s_eq.exact(Ls, uls)[0]
    # All-UL and all-DL greedy (on the equal share; cached from `_multistart` on it). In synchronous rounds a
    # fixed mode vector whose round time at L = 1, band split, already bounds its goodput below the best
    # candidate in hand cannot be the best (`_fixed_bound`: every phase, the split uplink's too, grows with L)
    # and is not planned. They go first among the candidates, as before: argmax keeps the first of equals.
    modes = np.array([np.ones(n, bool), np.zeros(n, bool)])
    t_ones = s_eq.exact(np.ones((2, n), int), modes)[1] if s_eq.sync else None
    fixed = [(fixed_greedy(s_eq, ul), ul) for m, ul in enumerate(modes)
             if t_ones is None or _fixed_bound(s_eq, float(t_ones[m])) > G.max()]
    if fixed:
        Lf = np.array([c[0] for c in fixed])
        ulf = np.array([c[1] for c in fixed])
        k = len(cands) - (2 * lmax + 1)  # the alternating plans come first
        Ls = np.concatenate([Ls[:k], Lf, Ls[k:]])
        uls = np.concatenate([uls[:k], ulf, uls[k:]])
        G = np.concatenate([G[:k], s_eq.exact(Lf, ulf)[0], G[k:]])
    i = int(np.argmax(G))
    L, ul, g = Ls[i], uls[i], G[i]
    if n <= _ALL_MODES_MAX_N:  # polish: every mode vector per row, greedy from ones and from the best, then +-1
        score = SharedAllModes(s_eq)
        for start in (None, L):
            L2 = greedy(s_eq, score, fill=True, start=start)
            G2, _, ul2 = score(L2[None])
            if G2[0] > g:
                L, ul, g = L2, ul2[0], G2[0]
        return _local_search(score, L, ul, g, lmax)
    # polish: greedy on exact scoring (O(N^2) a step: up to 64 devices), modes fixed; then modes by prefix on the
    # bands of the result
    L2 = greedy(s_eq, SharedModes(s_eq, ul), fill=True, start=L) if n <= _POLISH_MAX_N else L
    s_b = Scorer(sc, ul_bandwidths=s_eq.exact(L2[None], ul[None])[2][0])
    ul2 = s_b.prefix(L2[None])[2][0]
    G2 = s_eq.exact(np.array([L2, L2]), np.array([ul, ul2]))[0]
    j = int(np.argmax(G2))
    if G2[j] > g:
        L, ul = L2, (ul, ul2)[j]
    return L, ul


class BuiltinPolicy:
    """A built-in policy (`POLICIES`) as an implementation of the `Policy` protocol (testbed.core.policy)."""

    def __init__(self, name: str, *, exhaustive_limit: int = EXHAUSTIVE_LIMIT):
        if name not in POLICIES:
            raise OptimizerError(f"unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
        self.name, self.description, self.exhaustive_limit = name, POLICIES[name], exhaustive_limit

    def __repr__(self) -> str:
        return f"BuiltinPolicy({self.name!r})"

    def decide(self, sc: Scenario, context: RoundContext) -> Decision:
        """The policy's schedule; `context.seed` seeds random-modes, `context.fixed_length` is fixed-length's L."""
        policy, fixed_length, seed = self.name, context.fixed_length, context.seed
        s = Scorer(sc)
        n, lmax = sc.num_devices, sc.max_draft_len
        dl_powers = None
        info: dict = {}

        def fixed_scorer(ul_vec, equal=False):
            return FixedModes(s, ul_vec, equal)

        if policy == "proposed" and s.shared:
            L, ul = _proposed_shared(sc, s, fixed_length)
        elif policy == "multispin-homogeneous":
            L, ul = _multispin_homogeneous(s)
        elif policy == "multispin-heterogeneous":
            L, ul = _multispin_heterogeneous(s)
        elif policy in ("proposed", "proposed-basic"):
            if policy == "proposed":
                L = _multistart(s)
            else:
                L = greedy(s, s.prefix, fill=False)
            ul = s.prefix(L[None])[2][0]
        elif policy == "all-ul":
            ul = np.ones(n, bool)
            L = greedy(s, fixed_scorer(ul), fill=True)
        elif policy in ("all-dl", "all-dl-equal-power"):
            ul = np.zeros(n, bool)
            equal = policy == "all-dl-equal-power"
            L = greedy(s, fixed_scorer(ul, equal), fill=True)
            if equal and sc.dl_access != "tdma":
                dl_powers = np.full(n, sc.downlink_power_w / n)
        elif policy == "random-modes":
            ul = np.random.default_rng(seed).random(n) < 0.5
            L = greedy(s, fixed_scorer(ul), fill=True)
            info["seed"] = seed
        elif policy in ("common-length", "fixed-length"):
            if policy == "fixed-length":
                if not (isinstance(fixed_length, (int, np.integer)) and fixed_length >= 1):
                    raise OptimizerError(f"fixed_length: {fixed_length!r} is not allowed: must be an integer >= 1")
                lengths = [min(int(fixed_length), lmax)]
                info["fixed_length"] = lengths[0]
            else:
                lengths = list(range(1, lmax + 1))
            Lc = np.repeat(np.array(lengths)[:, None], n, axis=1)
            G, _, ulc = s.prefix(Lc)
            i = int(np.argmax(G))
            L, ul = Lc[i], ulc[i]
        else:  # exhaustive
            L, ul = _exhaustive(sc, s, self.exhaustive_limit)
        info["evaluations"] = s.evaluations
        return Decision(modes=ul, draft_lens=L, dl_powers_w=dl_powers, info=info)


def plan(sc: Scenario, policy: str | Policy = "proposed", *, fixed_length: int = 4, seed: int = 0,
         exhaustive_limit: int = EXHAUSTIVE_LIMIT, round_index: int = 0,
         previous: RoundOutcome | None = None, acceptance_by_option=None) -> Plan:
    """Modes, draft lengths and powers for one round under `policy`: a name in POLICIES or any object of
    the `Policy` protocol (a plug-in). The decision is checked (`check_decision`: a PolicyError names the
    field) and evaluated with the model; no finite round time raises InfeasiblePlanError.

    With `topk_choices` (or a top-k format with a prior ratio or estimates) the upload format is part of the
    plan: the policy plans each option and the best is kept (`testbed.core.payload.best_plan`; its
    `acceptance_by_option`: k -> {device: alpha under k})."""
    if not payload.is_plain(sc, acceptance_by_option):
        def one(option_sc: Scenario) -> Plan:
            return plan(option_sc, policy, fixed_length=fixed_length, seed=seed, exhaustive_limit=exhaustive_limit,
                        round_index=round_index, previous=previous)
        return payload.best_plan(sc, one, acceptance_by_option, infeasible=InfeasiblePlanError)
    pol = BuiltinPolicy(policy, exhaustive_limit=exhaustive_limit) if isinstance(policy, str) else policy
    name = policy_name(pol)
    if not callable(getattr(pol, "decide", None)):
        raise PolicyError(f"policy {name}: has no decide(scenario, context) method (the Policy interface)")
    ctx = RoundContext(round=round_index, seed=seed, fixed_length=fixed_length, previous=previous)
    if isinstance(pol, BuiltinPolicy):
        decision = pol.decide(sc, ctx)
    else:
        try:
            decision = pol.decide(sc, ctx)
        except OptimizerError:
            raise
        except Exception as exc:  # a plug-in's bug must cost one round (the caller falls back), not the run
            raise PolicyError(f"policy {name}: decide() raised {type(exc).__name__}: {exc}") from exc
    ul, L, ul_powers, dl_powers = check_decision(sc, decision, name)
    ul_bands = checked_ul_bandwidths(sc, decision, name)
    ev = model.evaluate(sc, ul, L, ul_powers=ul_powers, dl_powers=dl_powers, ul_bandwidths=ul_bands)
    if not (np.isfinite(ev.round_time_s) and np.isfinite(ev.goodput_tps) and ev.goodput_tps > 0):
        raise InfeasiblePlanError(_infeasible_message(sc, name, ev))
    return Plan(policy=name, scenario=sc, evaluation=ev, info=dict(decision.info))


def _infeasible_message(sc: Scenario, policy: str, ev: model.Evaluation) -> str:
    """Why a plan has no finite round time, device by device."""
    g = sc.gains_linear()
    budgets = sc.energy_budgets_j()
    lines = [f"policy {policy!r}: no feasible schedule (the best has round time {ev.round_time_s} s)"]
    for k, d in enumerate(sc.devices):
        if np.isfinite(ev.uplink_s[k]) and np.isfinite(ev.downlink_s[k]):
            continue
        why = ""
        if np.isfinite(budgets[k]):
            # energy p S / r(p) falls to S N0 ln2 / g as p -> 0: the least energy of an upload of S bits
            least = {m: float((model.ul_first_bits(sc, m == UL, 1)
                               + model.lazy_post_bits(sc, d.acceptance, 1) * (m == UL))
                              * sc.noise_psd_w_hz * np.log(2.0) / g[k]) for m in MODES}
            why = (f": energy_budget_j {budgets[k]:.3g} J is below the least energy of one upload at L = 1 "
                   f"({least[UL]:.3g} J in UL mode, {least[DL]:.3g} J in DL mode)")
        lines.append(f"device {d.name} ({ev.modes[k]} mode, L = {int(ev.draft_lens[k])}) cannot complete its "
                     f"round{why}")
    return "\n  ".join(lines)
