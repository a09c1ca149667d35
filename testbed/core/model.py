"""The analytic system model (spec sections 2-5): payload sizes, rates, per-phase latencies, goodput.

Pure functions of a `Scenario` and a schedule (modes, draft lengths, powers): no I/O, no clocks.
`evaluate()` is the single entry point; `device_tables()` tabulates the per-device quantities for every
draft length 1..L_max so the optimizer can score many schedules without recomputing them; both are built
from the same per-device formulas below, so they agree.

Conventions: modes are booleans per device, True = UL mode (correction at the edge). The "downlink" phase
is everything after verification: the shared DL of the DL-mode devices, the UL-mode replies (charged
`ul_reply_s` each), and with `ul_protocol: lazy` the second uplink of one distribution after a rejection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from testbed.core import power as dlpower
from testbed.core import radio, uplink
from testbed.core.scenario import Scenario
from testbed.core.vocabulary import DL, MODES, REL_TOL, UL

# ---------------------------------------------------------------- sizes (spec sections 1 and 3)

def bits_per_id(vocab_size: int) -> int:
    """b_id = ceil(log2 V)."""
    return int(math.ceil(math.log2(vocab_size)))


def bits_index(draft_len):
    """b_j(L) = ceil(log2(L + 1)): the first-rejection index / accepted count."""
    return np.ceil(np.log2(np.asarray(draft_len, dtype=float) + 1.0))


def distribution_bits(sc: Scenario) -> float:
    """One uploaded draft distribution: V b_p dense, or k (b_id + b_p) as top-k (index + value) pairs."""
    if sc.payload_format == "topk" and sc.topk_k < sc.vocab_size:
        return float(sc.topk_k * (bits_per_id(sc.vocab_size) + sc.bits_per_prob))
    return target_distribution_bits(sc)


def target_distribution_bits(sc: Scenario) -> float:
    """One downloaded target distribution p_j: always dense, V b_p (a truncated p would no longer be the
    target's: the output would not be lossless)."""
    return float(sc.vocab_size * sc.bits_per_prob)


def expected_tokens(acceptance, draft_len):
    """E(L) = (1 - a^(L+1)) / (1 - a), output tokens per round (accepted + correction or bonus)."""
    a = np.asarray(acceptance, dtype=float)
    L = np.asarray(draft_len, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = (1.0 - a ** (L + 1.0)) / (1.0 - a)
    return np.where(np.isclose(a, 1.0), L + 1.0, e)


def reject_probability(acceptance, draft_len):
    """P(a round has a rejection) = 1 - a^L."""
    return 1.0 - np.asarray(acceptance, float) ** np.asarray(draft_len, float)


def ul_first_bits(sc: Scenario, ul_mode, draft_len):
    """Bits a device sends before verification.
    UL eager: L (b_id + D); UL lazy: L (b_id + b_p); DL rejected_only: L (b_id + b_p) + b_id (the
    previous correction token); DL all_positions: L b_id + b_id (the device verifies itself)."""
    bid, bp, L = bits_per_id(sc.vocab_size), sc.bits_per_prob, np.asarray(draft_len, float)
    if sc.ul_protocol == "eager":
        ul = L * (bid + distribution_bits(sc))
    else:
        ul = L * (bid + bp)
    if sc.dl_protocol == "rejected_only":
        dl = L * (bid + bp) + bid
    else:
        dl = L * bid + bid
    return np.where(ul_mode, ul, dl) + sc.header_bits


def lazy_post_bits(sc: Scenario, acceptance, draft_len, provisioned: bool = True):
    """UL lazy: the distribution uploaded after a rejection is signalled (0 for eager).
    Provisioned per `dl_provisioning`: worst_case a full one, expected/realized (1 - a^L) of one."""
    if sc.ul_protocol != "lazy":
        return np.zeros(np.broadcast(np.asarray(acceptance), np.asarray(draft_len)).shape)
    d = distribution_bits(sc)
    full = np.full(np.broadcast(np.asarray(acceptance), np.asarray(draft_len)).shape, d)
    if not provisioned or sc.dl_provisioning == "worst_case":
        return full
    return reject_probability(acceptance, draft_len) * d


def dl_bits_dl_mode(sc: Scenario, acceptance, draft_len):
    """DL bits a DL-mode device is provisioned for (spec section 3, Option dl_provisioning).
    rejected_only: worst_case b_j + D; expected/realized b_j + (1 - a^L) D + a^L b_id.
    all_positions: (L + 1) D always (no dependence on the outcome). D here is the target's, always dense."""
    L = np.asarray(draft_len, float)
    a = np.asarray(acceptance, float)
    d, bid, bj = target_distribution_bits(sc), bits_per_id(sc.vocab_size), bits_index(L)
    if sc.dl_protocol == "all_positions":
        return (L + 1.0) * d + 0.0 * a + sc.header_bits
    if sc.dl_provisioning == "worst_case":
        return bj + d + 0.0 * a + sc.header_bits
    pr = reject_probability(a, L)
    return bj + pr * d + (1.0 - pr) * bid + sc.header_bits


def dl_bits_realized(sc: Scenario, draft_len, rejected):
    """DL bits a DL-mode device actually receives: b_j + D after a rejection, else b_j + b_id (D dense)."""
    L = np.asarray(draft_len, float)
    d, bid, bj = target_distribution_bits(sc), bits_per_id(sc.vocab_size), bits_index(L)
    if sc.dl_protocol == "all_positions":
        return (L + 1.0) * d + sc.header_bits
    return bj + np.where(rejected, d, bid) + sc.header_bits


def reply_bits_ul_mode(sc: Scenario, draft_len):
    """UL-mode DL reply: accepted count and output token, b_j + b_id (lazy adds a b_j rejection signal)."""
    bj = bits_index(draft_len)
    return bj + bits_per_id(sc.vocab_size) + (bj if sc.ul_protocol == "lazy" else 0.0)


def verify_time(sc: Scenario, draft_lens):
    """T_ver = t0 + t1 sum_k (L_k + 1) (ragged) or t0 + t1 N (max_k L_k + 1) (padded); last axis = devices."""
    L = np.asarray(draft_lens, dtype=float)
    if sc.verify_batch == "ragged":
        return verify_time_of(sc, (L + 1.0).sum(axis=-1), None, L.shape[-1])
    return verify_time_of(sc, None, L.max(axis=-1), L.shape[-1])


def verify_time_of(sc: Scenario, positions, longest, num_devices: int):
    """`verify_time` from its two statistics: positions = sum_k (L_k + 1) (ragged) or longest = max_k L_k
    (padded); the same arithmetic, so the same numbers."""
    if sc.verify_batch == "ragged":
        return sc.verify_t0_s + sc.verify_t1_s * np.asarray(positions, dtype=float)
    return sc.verify_t0_s + sc.verify_t1_s * num_devices * (np.asarray(longest, dtype=float) + 1.0)


# ---------------------------------------------------------------- radio

def ul_power_for_energy(bits, bandwidth_hz, gain, noise_psd_w_hz, max_power_w, energy_j, iters: int = 60):
    """Largest p <= P^max with p * bits / r(p) <= E (spec section 5, Option energy budget).
    Energy p S / r(p) increases with p, so bisect; an infinite budget gives P^max. Vectorised."""
    bits, b, g, pmax, e = np.broadcast_arrays(*(np.asarray(v, float) for v in
                                                (bits, bandwidth_hz, gain, max_power_w, energy_j)))
    if np.all(np.isinf(e)):  # no budget anywhere: P^max (the common case; skip the bisection)
        return pmax.copy()
    energy = lambda p: p * bits / np.maximum(radio.shannon_rate_bps(b, p, g, noise_psd_w_hz), 1e-300)
    ok_max = energy(pmax) <= e
    lo, hi = np.zeros_like(pmax), pmax.copy()
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        fits = energy(mid) <= e
        lo = np.where(fits, mid, lo)
        hi = np.where(fits, hi, mid)
    return np.where(ok_max, pmax, lo)


# ---------------------------------------------------------------- per-device tables

@dataclass
class DeviceTables:
    """Per-device quantities for every draft length 1..L_max (arrays shaped (N, L_max), column l-1)."""

    gains: np.ndarray
    dl_gains: np.ndarray    # the optimizer's DL gain: a fixed DL rate's equivalent (see equivalent_dl_gains)
    acceptance: np.ndarray
    expected_tokens: np.ndarray
    draft_s: np.ndarray
    up_ul: np.ndarray       # tau_up in UL mode: drafting + first uplink
    up_dl: np.ndarray       # tau_up in DL mode
    post_ul: np.ndarray     # UL mode after verification: reply (+ lazy second uplink)
    dl_bits: np.ndarray     # provisioned DL payload in DL mode
    p_ul_ul: np.ndarray     # UL power in UL mode / DL mode
    p_ul_dl: np.ndarray
    t_ver_per_pos: float
    constants: dict = field(default_factory=dict)
    # the shared uplink's inputs (ul_access fdma_shared): first-upload bits per mode, a_k = P^max_k g_k / N_0,
    # and the fixed UL rates (NaN: none)
    bits_ul: np.ndarray | None = None
    bits_dl: np.ndarray | None = None
    snr_hz: np.ndarray | None = None
    fixed_ul: np.ndarray | None = None


def _ul_phase(sc, ul_mode, L, acc, gains, bws, pmax, budgets, t, ul_powers=None, provisioned=True, fixed=None):
    """Per-device (power, rate, first bits, post bits, tau_up, post time) in one mode. `fixed`: per-device
    fixed UL rates (NaN: the Shannon rate), sent at P^max since power does not change them."""
    first = ul_first_bits(sc, ul_mode, L)
    post = np.where(ul_mode, lazy_post_bits(sc, acc, L, provisioned), 0.0)
    is_fixed = np.isfinite(fixed) if fixed is not None else False
    if ul_powers is None:
        p = np.where(is_fixed, pmax, ul_power_for_energy(first + post, bws, gains, sc.noise_psd_w_hz, pmax, budgets))
    else:
        p = np.asarray(ul_powers, float) * np.ones_like(first)
    r = np.where(is_fixed, fixed, radio.shannon_rate_bps(bws, p, gains, sc.noise_psd_w_hz))
    with np.errstate(divide="ignore", invalid="ignore"):  # r = 0: no power within an energy budget
        tx = np.where(first > 0, first / r, 0.0)
        post_tx = np.where(post > 0, post / r, 0.0)
    lazy = sc.ul_protocol == "lazy"
    post_time = np.where(ul_mode, sc.ul_reply_s * (2.0 if lazy else 1.0) + post_tx, 0.0)
    return p, r, first, post, L * t + tx, post_time, tx


def device_tables(sc: Scenario, ul_bandwidths=None) -> DeviceTables:
    """Per-device quantities for every L in 1..L_max (arrays (N, L_max)), from the same formulas as `evaluate`: the
    optimizer's lookup tables. `ul_bandwidths`: each device's UL band (default `Scenario.ul_bandwidths_hz`; on a
    shared uplink the equal share, or a split the caller plans with)."""
    n, lmax = sc.num_devices, sc.max_draft_len
    L = np.broadcast_to(np.arange(1, lmax + 1, dtype=float), (n, lmax))
    col = lambda v: np.asarray(v, float)[:, None]
    acc, g = col(sc.device_array("acceptance")), col(sc.gains_linear())
    t, pmax = col(sc.device_array("draft_time_s")), col(sc.device_array("max_power_w"))
    bws = col(sc.ul_bandwidths_hz() if ul_bandwidths is None else ul_bandwidths)
    budgets, fixed = col(sc.energy_budgets_j()), col(sc.fixed_rates_bps("ul"))
    p_u, _, _, _, up_u, post_u, _ = _ul_phase(sc, True, L, acc, g, bws, pmax, budgets, t, fixed=fixed)
    p_d, _, _, _, up_d, _, _ = _ul_phase(sc, False, L, acc, g, bws, pmax, budgets, t, fixed=fixed)
    return DeviceTables(
        gains=g[:, 0], dl_gains=equivalent_dl_gains(sc, g[:, 0]), acceptance=acc[:, 0],
        expected_tokens=expected_tokens(acc, L), draft_s=L * t,
        up_ul=up_u, up_dl=up_d, post_ul=post_u, dl_bits=dl_bits_dl_mode(sc, acc, L) * np.ones_like(L),
        p_ul_ul=p_u, p_ul_dl=p_d, t_ver_per_pos=sc.verify_t1_s,
        constants=dict(noise=sc.noise_psd_w_hz, bd=sc.downlink_bandwidth_hz, ps=sc.downlink_power_w),
        bits_ul=ul_first_bits(sc, True, L), bits_dl=ul_first_bits(sc, False, L),
        snr_hz=pmax[:, 0] * g[:, 0] / sc.noise_psd_w_hz, fixed_ul=fixed[:, 0],
    )


# ---------------------------------------------------------------- the shared uplink (ul_access fdma_shared)

def shared_ul_split(sc: Scenario, bits, draft_s, snr_hz, fixed_ul=None):
    """The min-max split of the shared uplink (`testbed.core.uplink.split`) for first-upload bits and drafting
    times (..., N): (bands, uplink phase U). A device with a fixed UL rate keeps b_min; its air time is S / r."""
    bits = np.asarray(bits, float)
    before = np.asarray(draft_s, float)
    if fixed_ul is not None and np.isfinite(fixed_ul).any():
        is_fixed = np.isfinite(fixed_ul)
        with np.errstate(invalid="ignore"):
            before = before + np.where(is_fixed, bits / np.where(is_fixed, fixed_ul, 1.0), 0.0)
        bits = np.where(is_fixed, 0.0, bits)
    return uplink.split(bits, before, snr_hz, sc.ul_total_bandwidth_hz(), sc.ul_min_band_hz())


# ---------------------------------------------------------------- the downlink phase

def equivalent_dl_gains(sc: Scenario, gains) -> np.ndarray:
    """The gains the optimizer's DL search uses: a device's own, or for a fixed DL rate the gain that gives
    that rate at an equal share (every device in DL mode: B^D / N and P_s / N; tdma: B^D and P_s). The
    search ranks schedules with these; `evaluate` then puts the fixed rate itself in the plan."""
    fixed = sc.fixed_rates_bps("dl")
    g = np.array(gains, float)
    if not np.isfinite(fixed).any():
        return g
    n = sc.num_devices
    w, p = ((sc.downlink_bandwidth_hz, sc.downlink_power_w) if sc.dl_access == "tdma"
            else (sc.downlink_bandwidth_hz / n, sc.downlink_power_w / n))
    i = np.isfinite(fixed)
    with np.errstate(over="ignore"):
        g[i] = np.clip(radio.power_for_rate_w(w, fixed[i], 1.0, sc.noise_psd_w_hz) / p, 1e-300, 1e300)
    return g


def dl_bandwidth_split(dl_access: str, total_hz: float, num_dl, num_devices: int):
    """W, the DL band of one DL-mode device: B^D / |D| (fdma_equal_split), B^D / N (fdma_fixed_split), B^D
    (tdma: one at a time). Vectorised over `num_dl`; an empty DL set gets the band of a set of one, so
    callers can divide by W and mask the empty sets afterwards."""
    if dl_access == "fdma_equal_split":
        return total_hz / np.maximum(np.asarray(num_dl, float), 1.0)
    if dl_access == "fdma_fixed_split":
        return np.full(np.shape(num_dl), total_hz / max(num_devices, 1))
    if dl_access == "tdma":
        return np.full(np.shape(num_dl), float(total_hz))
    raise ValueError(f"dl_access={dl_access!r} is invalid; allowed: fdma_equal_split, fdma_fixed_split, tdma")


def dl_bandwidth_per_device(sc: Scenario, num_dl: int) -> float:
    """W: B^D / |D| (fdma_equal_split), B^D / N (fdma_fixed_split), B^D (tdma, one at a time)."""
    if num_dl == 0:
        return 0.0
    return float(dl_bandwidth_split(sc.dl_access, sc.downlink_bandwidth_hz, num_dl, sc.num_devices))


def dl_schedule(sc: Scenario, payload_bits, gains, dl_powers=None, fixed=None):
    """(powers, rates, per-device DL times, DL phase) for one DL set with the given payloads.
    FDMA: optimal power (equal latencies) unless powers are given; TDMA: full band and power each,
    one after another (the phase is the sum). `fixed`: per-device fixed DL rates (NaN: the Shannon rate);
    such a device keeps its band share but takes no power (FDMA: the others share P_s)."""
    s = np.asarray(payload_bits, float)
    g = np.asarray(gains, float)
    n = s.size
    if n == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0), 0.0
    is_fixed = np.isfinite(fixed) if fixed is not None else np.zeros(n, bool)
    w = dl_bandwidth_per_device(sc, n)
    n0 = sc.noise_psd_w_hz
    if sc.dl_access == "tdma":
        p = np.full(n, sc.downlink_power_w) if dl_powers is None else np.asarray(dl_powers, float)
        r = np.where(is_fixed, fixed, radio.shannon_rate_bps(w, p, g, n0) * np.ones(n))
        times = s / r
        return p, r, times, float(times.sum())
    if dl_powers is None:
        p = np.zeros(n)
        free = ~is_fixed
        if free.any():
            p[free], _ = dlpower.optimal_dl_powers(s[free], g[free], w, sc.downlink_power_w, n0)
    else:
        p = np.asarray(dl_powers, float)
    r = np.where(is_fixed, fixed, radio.shannon_rate_bps(w, p, g, n0) * np.ones(n))
    with np.errstate(divide="ignore"):
        times = np.where(s > 0, s / r, 0.0)
    return p, r, times, float(times.max())


# ---------------------------------------------------------------- evaluate

@dataclass
class Evaluation:
    """Everything the model predicts for one schedule. Per-device arrays are in device order."""

    names: list
    modes: list
    draft_lens: np.ndarray
    ul_power_w: np.ndarray
    dl_power_w: np.ndarray
    draft_s: np.ndarray
    tx_s: np.ndarray
    uplink_s: np.ndarray
    downlink_s: np.ndarray
    ul_rate_bps: np.ndarray
    dl_rate_bps: np.ndarray
    ul_bits: np.ndarray
    dl_bits: np.ndarray
    expected_tokens: np.ndarray
    device_round_s: np.ndarray
    goodput: np.ndarray
    phases: dict
    round_time_s: float
    goodput_tps: float
    dl_bandwidth_per_device_hz: float
    ul_bandwidth_hz: np.ndarray | None = None  # each device's UL band: its own, or its share of a shared uplink

    @property
    def num_ul_devices(self) -> int:
        """K, the number of devices in UL mode."""
        return sum(m == UL for m in self.modes)


def parse_modes(modes, n: int) -> np.ndarray:
    """Modes as a boolean array (True = UL) from 'UL'/'DL' strings or booleans; clear errors."""
    arr = list(modes)
    if len(arr) != n:
        raise ValueError(f"modes: got {len(arr)} entries for {n} devices")
    out = []
    for i, m in enumerate(arr):
        if isinstance(m, (bool, np.bool_)):
            out.append(bool(m))
        elif isinstance(m, str) and m.upper() in MODES:
            out.append(m.upper() == UL)
        else:
            raise ValueError(f"modes[{i}]: {m!r} is not allowed: must be 'UL' or 'DL'")
    return np.array(out, dtype=bool)


def _check_lengths(sc: Scenario, draft_lens) -> np.ndarray:
    L = np.asarray(draft_lens)
    if L.shape != (sc.num_devices,):
        raise ValueError(f"draft_lens: got shape {L.shape} for {sc.num_devices} devices")
    for i, l in enumerate(L):
        if not (float(l).is_integer() and 1 <= l <= sc.max_draft_len):
            raise ValueError(f"draft_lens[{i}]: {l.item()!r} is not allowed: "
                             f"must be an integer in 1..{sc.max_draft_len}")
    return L.astype(float)


def evaluate(sc: Scenario, modes, draft_lens, ul_powers=None, dl_powers=None, ul_bandwidths=None) -> Evaluation:
    """Predict one round for a schedule. ul_powers default: P^max (or the energy-budget power);
    dl_powers (one per device, only DL-mode entries used) default: the optimal split for the DL set;
    ul_bandwidths (ul_access fdma_shared only) default: the min-max split of the shared uplink."""
    n = sc.num_devices
    ul_mode = parse_modes(modes, n)
    L = _check_lengths(sc, draft_lens)
    acc, g, t = sc.device_array("acceptance"), sc.gains_linear(), sc.device_array("draft_time_s")
    pmax, bws, budgets = sc.device_array("max_power_w"), sc.ul_bandwidths_hz(), sc.energy_budgets_j()
    if ul_powers is not None:
        ul_powers = np.asarray(ul_powers, float)
        bad = np.flatnonzero((ul_powers < 0) | (ul_powers > pmax * (1 + REL_TOL)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"ul_powers[{i}]: {ul_powers[i]} is not allowed: must be in [0, {pmax[i]}] W")
    if sc.ul_access == "fdma_shared":
        bws = _shared_bands(sc, ul_mode, L, t, g, pmax, ul_powers, ul_bandwidths)
    elif ul_bandwidths is not None:
        raise ValueError("ul_bandwidths: only with ul_access 'fdma_shared' (a dedicated band is the device's own)")
    p_ul, r_ul, first, post, up, post_time, tx = _ul_phase(
        sc, ul_mode, L, acc, g, bws, pmax, budgets, t, ul_powers, fixed=sc.fixed_rates_bps("ul"))
    dl_idx = np.flatnonzero(~ul_mode)
    s_dl = dl_bits_dl_mode(sc, acc[dl_idx], L[dl_idx])
    given = None
    if dl_powers is not None:
        given = np.asarray(dl_powers, float)[dl_idx]
        if given.sum() > sc.downlink_power_w * (1 + REL_TOL) and sc.dl_access != "tdma":
            raise ValueError(f"dl_powers: the DL devices' powers sum to {given.sum():.4g} W, "
                             f"more than downlink_power_w = {sc.downlink_power_w} W")
    p_d, r_d, times_d, tau_dl = dl_schedule(sc, s_dl, g[dl_idx], given, fixed=sc.fixed_rates_bps("dl")[dl_idx])
    dl_power = np.zeros(n)
    dl_rate = np.zeros(n)
    downlink = post_time.copy()
    dl_bits = np.where(ul_mode, reply_bits_ul_mode(sc, L), 0.0)
    dl_power[dl_idx], dl_rate[dl_idx], dl_bits[dl_idx] = p_d, r_d, s_dl
    downlink[dl_idx] = tau_dl if sc.dl_access == "tdma" else times_d
    e = expected_tokens(acc, L)
    t_ver = float(verify_time(sc, L))
    up_phase = float(up.max())
    down_phase = float(max(downlink.max(initial=0.0), tau_dl))
    T = up_phase + t_ver + down_phase + sc.round_overhead_s
    device_T = up + t_ver + downlink + sc.round_overhead_s
    if sc.rounds == "synchronous":
        per = e / T
    else:
        per = e / device_T
    return Evaluation(
        names=[d.name for d in sc.devices], modes=[UL if m else DL for m in ul_mode], draft_lens=L.astype(int),
        ul_power_w=p_ul, dl_power_w=dl_power, draft_s=L * t, tx_s=tx, uplink_s=up, downlink_s=downlink,
        ul_rate_bps=r_ul, dl_rate_bps=dl_rate, ul_bits=first + post, dl_bits=dl_bits, expected_tokens=e,
        device_round_s=device_T if sc.rounds == "asynchronous" else np.full(n, T), goodput=per,
        phases={"uplink": up_phase, "verify": t_ver, "downlink": down_phase},
        round_time_s=T if sc.rounds == "synchronous" else float(device_T.max()),
        goodput_tps=float(per.sum()), dl_bandwidth_per_device_hz=dl_bandwidth_per_device(sc, dl_idx.size),
        ul_bandwidth_hz=np.asarray(bws, float),
    )


def _shared_bands(sc: Scenario, ul_mode, L, t, g, pmax, ul_powers, given):
    """The UL bands of one schedule on a shared uplink: the given ones (checked: each >= b_min, sum <= B^U), else
    the min-max split."""
    total, least = sc.ul_total_bandwidth_hz(), sc.ul_min_band_hz()
    if given is not None:
        b = np.asarray(given, float)
        if b.shape != (sc.num_devices,) or not np.all(np.isfinite(b)):
            raise ValueError(f"ul_bandwidths: {b.size} values for {sc.num_devices} devices, each finite")
        if np.any(b < least * (1 - REL_TOL)) or b.sum() > total * (1 + REL_TOL):
            raise ValueError(f"ul_bandwidths: each must be >= {least:.6g} Hz (ul_min_share) and they must sum to at "
                             f"most uplink_total_bandwidth_hz = {total:.6g} Hz (got min {b.min():.6g}, "
                             f"sum {b.sum():.6g})")
        return b
    p = pmax if ul_powers is None else ul_powers
    bits = ul_first_bits(sc, ul_mode, L)
    return shared_ul_split(sc, bits, L * t, p * g / sc.noise_psd_w_hz, sc.fixed_rates_bps("ul"))[0]


# ---------------------------------------------------------------- one realized round (Monte Carlo)

def draw_accepted(rng: np.random.Generator, acceptance, draft_lens):
    """Accepted counts A in 0..L per device with P(A >= i) = a^i (i.i.d. per-token acceptance)."""
    a = np.asarray(acceptance, float)
    L = np.asarray(draft_lens, int)
    u = rng.random((a.size, int(L.max())))
    accepted_prefix = np.cumprod(u < a[:, None], axis=1)
    mask = np.arange(L.max())[None, :] < L[:, None]
    return (accepted_prefix * mask).sum(axis=1)


def realized_round(sc: Scenario, ev: Evaluation, accepted) -> dict:
    """Round time when the accepted counts are known (spec section 3 payloads, section 4 timing).

    The realized DL set is the DL-mode devices that rejected (the rest get a short b_j + b_id message).
    worst_case/expected: every device receives its actual payload at the rate it was planned for;
    realized: the DL bandwidth and power split is redone over the realized set. Lazy UL devices upload
    a distribution only after a rejection."""
    L = ev.draft_lens.astype(float)
    acc_n = np.asarray(accepted, float)
    rejected = acc_n < L
    ul_mode = np.array([m == UL for m in ev.modes])
    g = sc.gains_linear()
    tokens = acc_n + 1.0
    bits = dl_bits_realized(sc, L, rejected)
    down = np.zeros(sc.num_devices)
    # UL-mode devices: reply, plus the lazy second uplink only when they rejected.
    if sc.ul_protocol == "lazy":
        post_bits = np.where(rejected, distribution_bits(sc), 0.0)
        down[ul_mode] = (sc.ul_reply_s * (1 + rejected[ul_mode])
                         + post_bits[ul_mode] / ev.ul_rate_bps[ul_mode])
    else:
        down[ul_mode] = sc.ul_reply_s
    dl_idx = np.flatnonzero(~ul_mode)
    if dl_idx.size:
        if sc.dl_provisioning == "realized":
            big = dl_idx[rejected[dl_idx]] if sc.dl_protocol == "rejected_only" else dl_idx
            small = np.setdiff1d(dl_idx, big)
            down[small] = sc.ul_reply_s
            if big.size:
                _, _, times, tau = dl_schedule(sc, bits[big], g[big], fixed=sc.fixed_rates_bps("dl")[big])
                down[big] = tau if sc.dl_access == "tdma" else times
        else:
            times = bits[dl_idx] / ev.dl_rate_bps[dl_idx]
            down[dl_idx] = times.sum() if sc.dl_access == "tdma" else times
    t_ver = ev.phases["verify"]
    down_phase = float(down.max())
    T = float(ev.uplink_s.max()) + t_ver + down_phase + sc.round_overhead_s
    device_T = ev.uplink_s + t_ver + down + sc.round_overhead_s
    return dict(tokens=tokens, rejected=rejected, downlink_s=down, round_time_s=T,
                device_round_s=device_T if sc.rounds == "asynchronous" else np.full(sc.num_devices, T),
                phases={"uplink": float(ev.uplink_s.max()), "verify": t_ver, "downlink": down_phase})
