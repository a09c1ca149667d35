"""The optimizer (spec sections 6-9): modes, draft lengths and powers that maximise goodput.

Inner problem (fixed L): the prefix search over K (the K devices with the cheapest UL mode go UL, the rest
DL) with the optimal DL power for each candidate DL set. Outer problem: greedy draft lengths, basic or with
fill (the proposed policy runs greedy with fill from several starts and keeps the best). Baselines:
all-UL, all-DL (optimal or equal DL power), random modes, one common length, a fixed length, and
exhaustive search. `plan()` is the entry point; scoring is batched over many candidate schedules at once
(numpy), and the chosen schedule is re-evaluated with `model.evaluate` so a plan's numbers are exactly
the model's.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np

from testbed.core import model, radio
from testbed.core.power import solve_x
from testbed.core.scenario import Scenario

POLICIES = {
    "proposed": "greedy draft lengths with fill (multi-start) + prefix mode search + optimal DL power",
    "proposed-basic": "basic greedy draft lengths (no fill) + prefix mode search + optimal DL power",
    "all-ul": "every device in UL mode (existing designs), greedy lengths with fill",
    "all-dl": "every device in DL mode (DSSD-style), optimal DL power, greedy lengths with fill",
    "all-dl-equal-power": "every device in DL mode, DL power split equally, greedy lengths with fill",
    "random-modes": "modes drawn at random (seeded), greedy lengths with fill, optimal DL power",
    "common-length": "one draft length for all (best of 1..L_max), prefix modes, optimal DL power",
    "fixed-length": "one fixed draft length (default 4), prefix modes, optimal DL power",
    "exhaustive": "all 2^N mode vectors x all L_max^N lengths (tiny N only): the optimality check",
}
EXHAUSTIVE_LIMIT = 2_000_000
_REL_GAIN = 1e-12  # a greedy step must improve goodput by more than this (relative) to be taken


class OptimizerError(ValueError):
    """A request the optimizer refuses (unknown policy, problem too big for exhaustive search)."""


# ---------------------------------------------------------------- batched scoring

class Scorer:
    """Scores many schedules of one scenario at once. L arrays are (C, N) integers in 1..L_max."""

    def __init__(self, sc: Scenario):
        self.sc = sc
        self.tb = model.device_tables(sc)
        self.n = sc.num_devices
        self.inv_g = 1.0 / self.tb.gains
        self.n0 = sc.noise_psd_w_hz
        if sc.dl_access == "tdma":
            self.tdma_rate = radio.shannon_rate_bps(sc.downlink_bandwidth_hz, sc.downlink_power_w,
                                                    self.tb.gains, self.n0)
        self.evaluations = 0

    def _parts(self, L):
        tb = self.tb
        rows = np.arange(self.n)[None, :]
        idx = L - 1
        return dict(E=tb.expected_tokens[rows, idx], up_u=tb.up_ul[rows, idx], up_d=tb.up_dl[rows, idx],
                    post_u=tb.post_ul[rows, idx], S=tb.dl_bits[rows, idx],
                    t_ver=model.verify_time(self.sc, L))

    def _bandwidth(self, num_dl):
        return model.dl_bandwidth_split(self.sc.dl_access, self.sc.downlink_bandwidth_hz, num_dl, self.n)

    def _goodput(self, E, up_k, post_k, t_ver, T_sync):
        """Sync: sum E / T. Async: sum_k E_k / T_k with T_k the device's own cycle."""
        sc = self.sc
        if sc.rounds == "synchronous":
            return E.sum(-1) / T_sync
        Tk = up_k + t_ver[..., None] + post_k + sc.round_overhead_s
        return (E / Tk).sum(-1)

    # -- fixed modes
    def fixed(self, L, ul, equal_power: bool = False):
        """Goodput for given modes ul (C, N) bool; returns (G, T)."""
        sc, p = self.sc, self._parts(L)
        self.evaluations += L.shape[0]
        dl = ~ul
        nd = dl.sum(-1)
        up_k = np.where(ul, p["up_u"], p["up_d"])
        w = self._bandwidth(nd)
        if sc.dl_access == "tdma":
            tau = (np.where(dl, p["S"] / self.tdma_rate, 0.0)).sum(-1)
        elif equal_power:
            pw = sc.downlink_power_w / np.maximum(nd, 1)
            r = radio.shannon_rate_bps(w[:, None], pw[:, None], self.tb.gains[None, :], self.n0)
            own = np.where(dl, p["S"] / r, 0.0)  # unequal latencies: each device has its own
            tau = own.max(-1)
        else:
            wts = np.where(dl, self.inv_g, 0.0)
            values = np.unique(p["S"])
            if values.size <= 16:  # group the DL set by payload value: (C, nv) instead of (C, N)
                x = solve_x(np.einsum("cn,cnv->cv", wts, p["S"][..., None] == values), values,
                            sc.downlink_power_w / (self.n0 * w))
            else:
                x = solve_x(wts, p["S"], sc.downlink_power_w / (self.n0 * w))
            tau = np.where(nd > 0, 1.0 / (w * x), 0.0)
        post_k = np.where(ul, p["post_u"], own if equal_power and sc.dl_access != "tdma" else tau[:, None])
        T = up_k.max(-1) + p["t_ver"] + post_k.max(-1) + sc.round_overhead_s
        return self._goodput(p["E"], up_k, post_k, p["t_ver"], T), T

    # -- the prefix search (spec section 7)
    def prefix(self, L):
        """Best prefix K per row. Returns (G, T, ul mask) for the best K of each row."""
        sc, p = self.sc, self._parts(L)
        C, n = L.shape
        self.evaluations += C
        # The cost a device's UL mode adds: its uplink (eager), or the second uplink after verification
        # (lazy; its first uplink is no longer than in DL mode). Some optimal UL set is a prefix of it.
        key = p["up_u"] if sc.ul_protocol == "eager" else p["post_u"]
        order = np.argsort(key, axis=1, kind="stable")
        srt = {k: np.take_along_axis(v, order, axis=1) for k, v in p.items() if k != "t_ver"}
        zero = np.zeros((C, 1))
        pre_up_u = np.concatenate([zero, np.maximum.accumulate(srt["up_u"], axis=1)], axis=1)
        pre_post_u = np.concatenate([zero, np.maximum.accumulate(srt["post_u"], axis=1)], axis=1)
        suf_up_d = np.concatenate([np.maximum.accumulate(srt["up_d"][:, ::-1], axis=1)[:, ::-1], zero], 1)
        K = np.arange(n + 1)
        nd = n - K
        inv_g = self.inv_g[order]
        up = np.maximum(pre_up_u, suf_up_d)
        base_T = up + p["t_ver"][:, None] + sc.round_overhead_s  # (C, n+1) without the DL phase
        if sc.dl_access == "tdma":
            t = srt["S"] / self.tdma_rate[order]
            tau = np.concatenate([np.cumsum(t[:, ::-1], axis=1)[:, ::-1], zero], axis=1)
        else:
            w = self._bandwidth(nd)  # (n+1,)
            R = sc.downlink_power_w / (self.n0 * w)
            if sc.rounds == "synchronous":
                tau = self._tau_bracketed(srt["S"], inv_g, w, R, base_T, pre_post_u)
            else:
                tau = self._tau_all(srt["S"], inv_g, w, R)
        T = base_T + np.maximum(pre_post_u, tau)  # (C, n+1)
        if sc.rounds == "synchronous":
            G = p["E"].sum(-1)[:, None] / T
        else:
            is_ul = np.arange(n)[None, :] < K[:, None]  # (n+1, n) in sorted order
            up_k = np.where(is_ul[None], srt["up_u"][:, None, :], srt["up_d"][:, None, :])
            post_k = np.where(is_ul[None], srt["post_u"][:, None, :], tau[..., None])
            Tk = up_k + p["t_ver"][:, None, None] + post_k + sc.round_overhead_s
            G = (srt["E"][:, None, :] / Tk).sum(-1)
        best = np.argmax(G, axis=1)
        rows = np.arange(C)
        ul_sorted = np.arange(n)[None, :] < best[:, None]
        ul = np.zeros((C, n), bool)
        np.put_along_axis(ul, order, ul_sorted, axis=1)
        return G[rows, best], T[rows, best], ul


    def _tau_all(self, S, inv_g, w, R):
        """Exact optimal-power DL phase for every suffix DL set (rows: candidates, columns: K)."""
        C, n = S.shape
        nd = n - np.arange(n + 1)
        values = np.unique(S)
        R = np.broadcast_to(R, (C, n + 1))
        if values.size <= 16:  # few distinct payloads: suffix sums per payload value, O(C N nv)
            onehot = (S[..., None] == values) * inv_g[..., None]  # (C, n, nv)
            wts = np.concatenate([np.cumsum(onehot[:, ::-1], axis=1)[:, ::-1],
                                  np.zeros((C, 1, values.size))], axis=1)
            x = solve_x(wts, values, R)
        else:  # general: one masked row per K, O(C N^2)
            mask = np.arange(n)[None, :] >= np.arange(n + 1)[:, None]  # device j is DL when j >= K
            wts = np.where(mask[None], inv_g[:, None, :], 0.0)
            x = solve_x(wts, np.broadcast_to(S[:, None, :], wts.shape), R)
        with np.errstate(divide="ignore"):
            return np.where(nd[None, :] > 0, 1.0 / (w[None, :] * x), 0.0)

    def _tau_bracketed(self, S, inv_g, w, R, base_T, pre_post):
        """The DL phase where it decides the best K (synchronous rounds), exactly; elsewhere a bound.

        With payloads in [S_min, S_max] over a DL set, channel inversion with S_min (S_max) bounds tau
        from below (above). Only the K whose lower-bound round time beats the best upper bound can be
        optimal; the exact solver runs on those alone. With equal payloads the bounds coincide."""
        C, n = S.shape
        nd = n - np.arange(n + 1)
        inf = np.full((C, 1), np.inf)
        suf_inv = np.concatenate([np.cumsum(inv_g[:, ::-1], axis=1)[:, ::-1], np.zeros((C, 1))], axis=1)
        s_min = np.concatenate([np.minimum.accumulate(S[:, ::-1], axis=1)[:, ::-1], inf], axis=1)
        s_max = np.concatenate([np.maximum.accumulate(S[:, ::-1], axis=1)[:, ::-1], -inf], axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rate_per_bit = w[None, :] * np.log2(1.0 + R[None, :] / suf_inv)  # W log2(1 + R / sum 1/g)
            lo = np.where(nd[None, :] > 0, s_min / rate_per_bit, 0.0)
            hi = np.where(nd[None, :] > 0, s_max / rate_per_bit, 0.0)
        T_lo = base_T + np.maximum(pre_post, lo)
        T_hi = base_T + np.maximum(pre_post, hi)
        need = (T_lo <= T_hi.min(axis=1, keepdims=True)) & (hi > lo) & (nd[None, :] > 0)
        tau = lo.copy()
        tau[~need] = hi[~need]  # exact where lo == hi; a valid upper bound elsewhere
        rows, ks = np.nonzero(need)
        if rows.size:
            mask = np.arange(n)[None, :] >= ks[:, None]
            x = solve_x(np.where(mask, inv_g[rows], 0.0), S[rows], R[ks])
            tau[rows, ks] = 1.0 / (w[ks] * x)
        return tau


# ---------------------------------------------------------------- draft lengths (spec section 8)

def _uplink_tables(scorer: Scorer, ul):
    """Per-device uplink-phase tables (C, N, L_max) in the given modes."""
    tb = scorer.tb
    return np.where(ul[..., None], tb.up_ul[None], tb.up_dl[None])


def greedy(scorer: Scorer, score, fill: bool, start=None):
    """Greedy draft lengths: take the best single increment (and, with fill, the best increment with
    every other device raised to the new bottleneck) until nothing gains. score(L) -> (G, T, ul)."""
    n, lmax = scorer.n, scorer.sc.max_draft_len
    L = np.ones(n, int) if start is None else np.asarray(start, int).copy()
    g_cur = score(L[None])[0][0]
    while True:
        cand = np.flatnonzero(L < lmax)
        if cand.size == 0:
            break
        Lc = np.repeat(L[None], cand.size, axis=0)
        Lc[np.arange(cand.size), cand] += 1
        G, T, ul = score(Lc)
        allL, allG = [Lc], [G]
        if fill:
            # Uplink tables are increasing in L, so the fill level is a count of the levels that fit.
            same = bool(np.all(ul == ul[:1]))  # fixed-mode scorers: one table for every candidate
            up_tab = _uplink_tables(scorer, ul[:1] if same else ul)  # (C or 1, N, lmax)
            bottleneck = np.take_along_axis(up_tab, (Lc - 1)[..., None], axis=2)[..., 0].max(-1)
            l_fill = (up_tab <= bottleneck[:, None, None] * (1 + 1e-12)).sum(-1)
            Lf = np.maximum(Lc, l_fill)
            changed = np.any(Lf != Lc, axis=1)
            if changed.any():
                Gf, _, _ = score(Lf[changed])
                allL.append(Lf[changed])
                allG.append(Gf)
        allL, allG = np.concatenate(allL), np.concatenate(allG)
        i = int(np.argmax(allG))
        if not allG[i] > g_cur * (1 + _REL_GAIN):
            break
        L, g_cur = allL[i].copy(), allG[i]
    return L


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
        ) for k, name in enumerate(ev.names)]

    def to_dict(self) -> dict:
        """The plan as JSON-ready numbers (powers in W, rates in bit/s, payloads in bits, times in s): what
        `multispin plan --json` prints and the controller records."""
        ev = self.evaluation
        return {
            "policy": self.policy, "goodput_tps": ev.goodput_tps, "round_time_s": ev.round_time_s,
            "phases_s": dict(ev.phases), "num_ul_devices": ev.num_ul_devices,
            "dl_bandwidth_per_device_hz": ev.dl_bandwidth_per_device_hz,
            "devices": [dataclasses.asdict(d) for d in self.device_plans()], **self.info,
        }


def exhaustive_modes(sc: Scenario, draft_lens, scorer: Scorer | None = None):
    """Best mode vector for fixed lengths by trying all 2^N (the check on the prefix search)."""
    s = scorer or Scorer(sc)
    n = sc.num_devices
    if 2 ** n > EXHAUSTIVE_LIMIT:
        raise OptimizerError(f"exhaustive mode search over 2^{n} vectors exceeds {EXHAUSTIVE_LIMIT:.0e}")
    ul = ((np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1).astype(bool)
    L = np.repeat(np.asarray(draft_lens, int)[None], ul.shape[0], axis=0)
    G, T, = s.fixed(L, ul)
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
        G, _ = s.fixed(L, ul)
        i = int(np.argmax(G))
        if G[i] > best[0]:
            best = (G[i], L[i].copy(), ul[i].copy())
    return best[1], best[2]


def _multistart(s: Scorer, fixed_scorer) -> np.ndarray:
    """Greedy with fill is path dependent: from L = 1 the cheap short UL uploads look best, and the
    region of long drafts over a shared DL is not reached one device at a time. So start it from
    several points (all ones; the lengths all-DL and all-UL greedy reach; the best common length),
    score each start with the prefix mode search, and continue greedy with fill from the best. The
    result is never below the all-UL, all-DL, common-length or fixed-length baselines."""
    n, lmax = s.n, s.sc.max_draft_len
    common = np.repeat(np.arange(1, lmax + 1)[:, None], n, axis=1)
    starts = [greedy(s, s.prefix, fill=True), common[int(np.argmax(s.prefix(common)[0]))]]
    best = s.prefix(np.array(starts))[0].max()
    ones = np.ones((1, n), int)
    e_max = s.tb.expected_tokens[:, -1].sum()
    for ul in (np.zeros(n, bool), np.ones(n, bool)):
        # Every phase grows with L, so sum E(L_max) / T(L = 1) bounds what this start can reach
        # (synchronous rounds); skip a start that cannot beat what is already in hand.
        if s.sc.rounds == "synchronous" and e_max / s.fixed(ones, ul[None])[1][0] <= best:
            continue
        L = greedy(s, fixed_scorer(ul), fill=True)
        starts.append(L)
        best = max(best, s.prefix(L[None])[0][0])
    G, _, _ = s.prefix(np.array(starts))
    return greedy(s, s.prefix, fill=True, start=starts[int(np.argmax(G))])


def plan(sc: Scenario, policy: str = "proposed", *, fixed_length: int = 4, seed: int = 0,
         exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> Plan:
    """Modes, draft lengths and powers for one round under `policy` (see POLICIES)."""
    if policy not in POLICIES:
        raise OptimizerError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
    s = Scorer(sc)
    n, lmax = sc.num_devices, sc.max_draft_len
    dl_powers = None
    info: dict = {}

    def fixed_scorer(ul_vec, equal=False):
        def score(L):
            ul = np.broadcast_to(ul_vec, L.shape)
            G, T = s.fixed(L, ul, equal_power=equal)
            return G, T, ul
        return score

    if policy in ("proposed", "proposed-basic"):
        if policy == "proposed":
            L = _multistart(s, fixed_scorer)
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
        L, ul = _exhaustive(sc, s, exhaustive_limit)
    ev = model.evaluate(sc, ul, L, dl_powers=dl_powers)
    info["evaluations"] = s.evaluations
    return Plan(policy=policy, scenario=sc, evaluation=ev, info=info)
