"""A shared uplink band (ul_access fdma_shared, issue 36): the min-max split against an independent reference,
the Multi-SPIN baselines, and the proposed policy against every baseline and the exhaustive optimum."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from testbed.core import model, optimizer, uplink
from testbed.core.optimizer import POLICIES, plan
from testbed.core.policy import Decision, PolicyError
from testbed.core.scenario import Scenario, ScenarioError


def shared_drop(n, seed, **kw):
    rng = np.random.default_rng(seed)
    devs = [dict(name=f"d{i}", distance_m=float(rng.uniform(50, 500)), draft_time_s=float(rng.uniform(0.015, 0.06)),
                 acceptance=float(rng.uniform(0.6, 0.85))) for i in range(n)]
    kw.setdefault("downlink_bandwidth_hz", float(rng.uniform(5e5, 8e6)))
    kw.setdefault("downlink_power_w", float(rng.uniform(1.0, 10.0)))
    kw.setdefault("uplink_total_bandwidth_hz", float(rng.uniform(0.3, 3.0)) * 1e6 * n)
    return Scenario.from_dict(dict(devices=devs, ul_access="fdma_shared", **kw))


# ---------------------------------------------------------------- the split against a reference

def reference_split(S, c, a, B, bmin):
    """Nested brentq, no Newton and no closed form: the band each device needs for a deadline U (root of
    c + S / (b log2(1 + a / b)) = U in b), and the U whose bands sum to B."""
    def need(k, U):
        f = lambda b: c[k] + S[k] / (b * np.log2(1 + a[k] / b)) - U
        if f(bmin) <= 0:
            return bmin
        hi = bmin
        while f(hi) > 0:
            hi *= 2
            if hi > 1e30:
                return np.inf
        return brentq(f, bmin, hi, xtol=1e-12 * hi, rtol=1e-14)

    tau = lambda b: c + S / (b * np.log2(1 + a / b))
    lo = tau(np.full(S.size, B - (S.size - 1) * bmin)).max() * (1 - 1e-12)
    hi = tau(np.full(S.size, B / S.size)).max() * (1 + 1e-12)
    total = lambda U: sum(need(k, U) for k in range(S.size)) - B
    if total(hi) >= 0:
        return hi
    U = brentq(lambda U: min(total(U), 1e300), lo, hi, xtol=1e-15 * hi, rtol=1e-14)
    return U


def test_band_for_rate_inverts_the_rate():
    rng = np.random.default_rng(1)
    a = 10 ** rng.uniform(3, 12, 2000)
    b = 10 ** rng.uniform(2, 9, 2000)
    r = uplink.rate_bps(b, a)
    np.testing.assert_allclose(uplink.band_for_rate_hz(r, a), b, rtol=1e-9)
    assert np.isinf(uplink.band_for_rate_hz(a / np.log(2.0) * 1.01, a)).all()  # beyond the infinite-band rate


def test_split_matches_an_independent_reference_within_one_percent_of_the_round():
    rng = np.random.default_rng(2)
    worst = 0.0
    for trial in range(25):
        n = int(rng.integers(1, 9))
        sc = shared_drop(n, trial, ul_min_share=float(rng.uniform(0.01, 1.0)))
        modes = rng.random(n) < 0.5
        L = rng.integers(1, sc.max_draft_len + 1, n)
        ev = model.evaluate(sc, modes, L)
        S = model.ul_first_bits(sc, modes, L)
        c = L * sc.device_array("draft_time_s")
        a = sc.device_array("max_power_w") * sc.gains_linear() / sc.noise_psd_w_hz
        U_ref = reference_split(S, c, a, sc.ul_total_bandwidth_hz(), sc.ul_min_band_hz())
        assert ev.ul_bandwidth_hz.sum() == pytest.approx(sc.ul_total_bandwidth_hz(), rel=1e-12)
        assert np.all(ev.ul_bandwidth_hz >= sc.ul_min_band_hz() * (1 - 1e-12))
        T_ref = ev.round_time_s - ev.phases["uplink"] + U_ref
        worst = max(worst, abs(ev.round_time_s - T_ref) / T_ref)
        assert ev.phases["uplink"] == pytest.approx(U_ref, rel=1e-6), trial
    assert worst < 0.01


def test_split_equalizes_completion_of_devices_above_the_minimum():
    sc = shared_drop(6, 3, ul_min_share=0.01)
    ev = model.evaluate(sc, ["UL"] * 6, [3] * 6)
    above = ev.ul_bandwidth_hz > sc.ul_min_band_hz() * 1.001
    assert above.sum() >= 2
    np.testing.assert_allclose(ev.uplink_s[above], ev.uplink_s.max(), rtol=1e-9)
    # weaker channels get more band (same length, same payload: the band follows the gain and the drafting)
    assert ev.ul_bandwidth_hz.sum() == pytest.approx(sc.ul_total_bandwidth_hz())


def test_min_share_one_is_the_equal_split_and_equal_share_equals_dedicated():
    sc = shared_drop(5, 4, ul_min_share=1.0)
    ev = model.evaluate(sc, ["UL", "DL", "UL", "DL", "DL"], [2, 3, 4, 5, 6])
    np.testing.assert_allclose(ev.ul_bandwidth_hz, sc.ul_total_bandwidth_hz() / 5, rtol=1e-12)
    ded = sc.with_updates(ul_access="dedicated", uplink_total_bandwidth_hz=None, ul_min_share=0.05,
                          uplink_bandwidth_hz=sc.ul_total_bandwidth_hz() / 5)
    ev2 = model.evaluate(ded, ["UL", "DL", "UL", "DL", "DL"], [2, 3, 4, 5, 6])
    assert ev.round_time_s == pytest.approx(ev2.round_time_s, rel=1e-12)


def test_scorer_exact_is_evaluate():
    from testbed.core.optimizer import Scorer
    rng = np.random.default_rng(5)
    sc = shared_drop(7, 5)
    s = Scorer(sc)
    L = rng.integers(1, 13, (6, 7))
    ul = rng.random((6, 7)) < 0.5
    G, T, bands = s.exact(L, ul)
    for i in range(6):
        ev = model.evaluate(sc, ul[i], L[i])
        assert G[i] == pytest.approx(ev.goodput_tps, rel=1e-9)
        np.testing.assert_allclose(bands[i], ev.ul_bandwidth_hz, rtol=1e-9)


# ---------------------------------------------------------------- scenario, decision, plan record

def test_the_scenario_refuses_what_a_shared_uplink_does_not_implement():
    dev = dict(name="a", distance_m=100, draft_time_s=0.02, acceptance=0.7)
    with pytest.raises(ScenarioError, match="uplink_total_bandwidth_hz.*dedicated"):
        Scenario.from_dict(dict(devices=[dev], uplink_total_bandwidth_hz=1e6))
    with pytest.raises(ScenarioError, match="lazy"):
        Scenario.from_dict(dict(devices=[dev], ul_access="fdma_shared", ul_protocol="lazy"))
    with pytest.raises(ScenarioError, match="energy_budget_j"):
        Scenario.from_dict(dict(devices=[{**dev, "energy_budget_j": 1.0}], ul_access="fdma_shared"))
    sc = Scenario.from_dict(dict(devices=[dev, {**dev, "name": "b"}], ul_access="fdma_shared"))
    assert sc.ul_total_bandwidth_hz() == 2e6 and sc.ul_min_band_hz() == pytest.approx(0.05e6)


def test_plan_records_each_share_and_a_policy_may_give_its_own():
    sc = shared_drop(4, 6)
    d = plan(sc, "proposed").to_dict()
    bands = [x["ul_bandwidth_hz"] for x in d["devices"]]
    assert sum(bands) == pytest.approx(sc.ul_total_bandwidth_hz())
    g = sc.gains_linear()
    for k, x in enumerate(d["devices"]):  # the rate the emulator gets (edge_node.controller.channel_links): the share's
        b = x["ul_bandwidth_hz"]
        assert x["ul_rate_bps"] == pytest.approx(b * np.log2(1 + x["ul_power_w"] * g[k] / (sc.noise_psd_w_hz * b)))
    B, n = sc.ul_total_bandwidth_hz(), 4

    class Even:
        name = "even"

        def __init__(self, bands):
            self.bands = bands

        def decide(self, scenario, context):
            return Decision(modes=["UL"] * n, draft_lens=[2] * n, ul_bandwidths_hz=self.bands)

    p = plan(sc, Even([B / n] * n))
    np.testing.assert_allclose(p.evaluation.ul_bandwidth_hz, B / n)
    assert p.goodput_tps <= plan(sc, Even(None)).goodput_tps * (1 + 1e-12)  # the split is min-max
    with pytest.raises(PolicyError, match="sum to"):
        plan(sc, Even([B / 2] * n))
    with pytest.raises(PolicyError, match="must be >="):
        plan(sc, Even([B - 3, 1, 1, 1]))
    ded = Scenario.from_dict(dict(devices=[dict(name="a", distance_m=100, draft_time_s=0.02, acceptance=0.7)]))
    with pytest.raises(PolicyError, match="only allowed with ul_access"):
        plan(ded, type("P", (), {"name": "p", "decide":
                                 lambda self, s, c: Decision(["UL"], [1], ul_bandwidths_hz=[1e6])})())


# ---------------------------------------------------------------- the policies

def test_multispin_baselines_do_what_they_say():
    sc = shared_drop(6, 7)
    hom = plan(sc, "multispin-homogeneous")
    assert hom.modes == ["UL"] * 6 and len(set(hom.draft_lens)) == 1
    het = plan(sc, "multispin-heterogeneous")
    assert het.modes == ["UL"] * 6
    assert het.goodput_tps >= hom.goodput_tps * (1 - 1e-9) or len(set(het.draft_lens)) > 1
    # the common length is the best one: every other common length scores no higher
    for L in range(1, sc.max_draft_len + 1):
        assert model.evaluate(sc, ["UL"] * 6, [L] * 6).goodput_tps <= hom.goodput_tps * (1 + 1e-12)
    assert "multispin-homogeneous" in POLICIES and "multispin-heterogeneous" in POLICIES


GUARANTEED = ("all-ul", "all-dl", "common-length", "fixed-length", "multispin-homogeneous",
              "multispin-heterogeneous")


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 6), seed=st.integers(0, 10_000), share=st.floats(0.01, 1.0),
       lmax=st.integers(2, 10), dl_scarce=st.booleans())
def test_proposed_is_never_below_a_baseline_on_a_shared_band(n, seed, share, lmax, dl_scarce):
    kw = dict(ul_min_share=share, max_draft_len=lmax)
    if dl_scarce:
        kw["downlink_bandwidth_hz"] = 3e5
    sc = shared_drop(n, seed, **kw)
    g = plan(sc, "proposed").goodput_tps
    for policy in GUARANTEED:
        assert g >= plan(sc, policy).goodput_tps * (1 - 1e-9), policy


def test_proposed_reaches_the_exhaustive_optimum_on_small_shared_problems():
    rng = np.random.default_rng(8)
    ratios = []
    for trial in range(20):
        n = int(rng.integers(2, 5))
        lmax = int(rng.integers(3, 6))
        sc = shared_drop(n, 200 + trial, max_draft_len=lmax, ul_min_share=float(rng.uniform(0.02, 0.5)))
        best = plan(sc, "exhaustive").goodput_tps
        ratios.append(plan(sc, "proposed").goodput_tps / best)
    ratios = np.array(ratios)
    print(f"\nproposed / exhaustive on a shared uplink: mean {ratios.mean():.5f} worst {ratios.min():.5f}")
    assert np.all(ratios <= 1 + 1e-9)
    assert ratios.mean() >= 0.995 and ratios.min() >= 0.9  # as the dedicated check: the mean (here 0.9964)


def test_every_policy_plans_a_shared_band_with_finite_numbers():
    sc = shared_drop(5, 9, rounds="asynchronous")
    for policy in POLICIES:
        if policy == "exhaustive":
            continue
        d = plan(sc, policy).to_dict()
        assert d["goodput_tps"] > 0 and np.isfinite(d["round_time_s"]), policy


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(65, 300), seed=st.integers(0, 10_000), share=st.floats(0.01, 1.0), dl_scarce=st.booleans())
def test_proposed_is_never_below_multispin_heterogeneous_beyond_64_devices(n, seed, share, dl_scarce):
    """Above 64 devices proposed used to leave multispin-heterogeneous out of its candidates (its greedy split
    every candidate row: too slow) and fell below it (295.40 against 296.26 tokens/s at N = 80); now it is a
    candidate at every N."""
    kw = dict(ul_min_share=share)
    if dl_scarce:
        kw["downlink_bandwidth_hz"] = 3e5
    sc = shared_drop(n, seed, **kw)
    assert plan(sc, "proposed").goodput_tps >= plan(sc, "multispin-heterogeneous").goodput_tps * (1 - 1e-9)


def test_demand_is_the_splits_band_and_its_slope():
    """uplink.demand (the greedy's Newton bounds) at the split's U gives the split's bands, summing to B, and its
    derivative matches a central difference."""
    rng = np.random.default_rng(4)
    n = 40
    S, c = rng.uniform(1e5, 5e6, n), rng.uniform(0.01, 0.3, n)
    a = 10 ** rng.uniform(6, 9, n)
    B, bmin = 40e6, 1e5
    bands, U = uplink.split(S, c, a, B, bmin)
    b, db = uplink.demand(S, c, a, U, bmin)
    assert b.sum() == pytest.approx(B, rel=1e-9)
    np.testing.assert_allclose(b[b > bmin * 1.01], bands[b > bmin * 1.01], rtol=1e-7)
    h = U * 1e-7
    num = (uplink.demand(S, c, a, U + h, bmin)[0] - uplink.demand(S, c, a, U - h, bmin)[0]) / (2 * h)
    active = b > bmin * 1.01
    np.testing.assert_allclose(db[active], num[active], rtol=1e-4)
    assert np.all(db <= 0) and np.isinf(uplink.demand(S[:1], c[:1], a[:1], c[0] * 0.5, bmin)[0]).all()


def test_a_warm_started_split_is_the_cold_split():
    """`uplink.split(..., start_s)` (the greedy's warm start: the uplink phase of a problem with fewer bits and
    earlier starts, just below it) reaches the split of a cold start: U within 1e-12 and every band within 1e-9
    of B, relative. Some rows start at their own U, some below, some at a start that does not help."""
    rng = np.random.default_rng(366)
    for _ in range(20):
        C, n = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        a = 10 ** rng.uniform(6, 9, (C, n))
        S = rng.uniform(1e3, 1e5, (C, n)) * (rng.random((C, n)) < 0.9)  # some devices with a given rate (S = 0)
        c = rng.uniform(0.01, 0.1, (C, n))
        B = float(rng.uniform(0.3, 3.0)) * 1e6 * n
        bmin = B / n * float(rng.choice([0.01, 0.05, 0.5, 1.0]))
        bands, U = uplink.split(S, c, a, B, bmin)
        shrink = rng.uniform(0.5, 1.0, (C, 1))
        _, U_low = uplink.split(S * shrink, c * shrink, a, B, bmin)
        for start in (U * (1 - 1e-12), U_low * (1 - 1e-12), np.zeros(C)):
            bands_w, U_w = uplink.split(S, c, a, B, bmin, start_s=start)
            np.testing.assert_allclose(U_w, U, rtol=1e-12)
            assert np.max(np.abs(bands_w - bands)) <= 1e-9 * B
            np.testing.assert_allclose(bands_w.sum(-1), B, rtol=1e-12)


def test_batched_greedy_steps_are_never_below_single_steps(monkeypatch):
    """The greedy takes batches of increments on a shared uplink (issue 36: 12.3 s to 0.7 s at N = 4,096); on
    random shared bands with N from 8 to 300 proposed is never below the search with single steps only
    (`_BATCH_START = 0`, the path before batching), and the batches were taken (a spy on the real step)."""
    taken = []
    real = optimizer._batch_step

    def spy(*args):
        L, g = real(*args)
        taken.append(g > -np.inf)
        return L, g

    monkeypatch.setattr(optimizer, "_batch_step", spy)
    batched = optimizer._BATCH_START
    rng = np.random.default_rng(36)
    gains = []
    for trial in range(16):
        n = int(rng.integers(8, 301))
        kw = dict(ul_min_share=float(rng.uniform(0.01, 1.0)))
        if rng.random() < 0.5:
            kw["downlink_bandwidth_hz"] = 3e5
        sc = shared_drop(n, 3600 + trial, **kw)
        monkeypatch.setattr(optimizer, "_BATCH_START", 0)
        single = plan(sc, "proposed").goodput_tps
        monkeypatch.setattr(optimizer, "_BATCH_START", batched)
        gains.append(plan(sc, "proposed").goodput_tps / single - 1)
    gains = np.array(gains)
    print(f"\nbatched / single steps - 1: min {gains.min():.2e} max {gains.max():.2e}, batches scored {sum(taken)}")
    assert gains.min() >= -1e-9
    assert sum(taken) > 0


# ---------------------------------------------------------------- the faster split (issue 36, the last step)

def previous_band_for_rate(rho, a):
    """`uplink.band_for_rate_hz` before the tabulated start: Newton from a point right of the root, every entry
    until all have converged."""
    c = rho * uplink.LN2 / a
    ok = (c > 0) & (c < 1)
    cc = np.where(ok, c, 0.5)
    x = np.minimum(1.0 / cc ** 2, (2.0 / cc) * np.log(2.0 / cc))
    near = 6.0 * (1.0 - cc)
    x = np.where(near <= 1.0, np.minimum(x, near), x)
    for _ in range(60):
        lg = np.log1p(x)
        h = lg - cc * x
        x_new = np.maximum(x - h / (1.0 / (1.0 + x) - cc), 0.5 * x)
        if np.all((np.abs(x_new - x) <= 4e-16 * x) | (np.abs(h) <= 1e-15 * (lg + cc * x))):
            x = x_new
            break
        x = x_new
    return np.where(ok, a / x, np.where(rho <= 0, 0.0, np.inf))


def previous_split(S, c, a, B, bmin):
    """`uplink.split` before V-Newton and the tangent start: Newton in U from the cold start (the slowest device
    with all the band the others leave it), each iterate's bands by `previous_band_for_rate`."""
    n, band = S.shape[-1], S > 0

    def tau(b):
        return c + np.where(band, S / uplink.rate_bps(b, a), 0.0)

    U = tau(np.full(S.shape, B - (n - 1) * bmin)).max(-1)
    U_hi = tau(np.full(S.shape, B / n)).max(-1)
    done = np.zeros(U.shape, bool)
    for _ in range(100):
        gap = U[..., None] - c
        rho = np.where(band, S / gap, 0.0)
        need = np.where(band, previous_band_for_rate(rho, a), 0.0)
        F = np.maximum(need, bmin).sum(-1) - B
        active = band & (need > bmin)
        x = a / np.where(active, need, 1.0)
        drho_db = np.log1p(x) / uplink.LN2 - x / ((1.0 + x) * uplink.LN2)
        dF = np.where(active, -(rho / gap) / drho_db, 0.0).sum(-1)
        U_new = np.minimum(U + np.maximum(np.where(dF < 0, -F / dF, 0.0), 0.0), np.maximum(U_hi, U))
        done |= (F <= 1e-13 * B) | (U_new - U <= 1e-15 * U)
        U = np.where(done, U, U_new)
        if done.all():
            break
    need = np.where(band, previous_band_for_rate(np.where(band, S / (U[..., None] - c), 0.0), a), 0.0)
    b = np.maximum(np.where(np.isfinite(need), need, B), bmin)
    extra = b - bmin
    tot = extra.sum(-1, keepdims=True)
    b = np.where(tot > 0, bmin + extra * ((B - n * bmin) / tot), B / n)
    return b, tau(b).max(-1)


def random_split_problems(rng, trials, n_max):
    for _ in range(trials):
        C, n = int(rng.integers(1, 6)), int(rng.integers(2, n_max))
        a = 10 ** rng.uniform(5, 10, n)
        S = rng.uniform(1e3, 5e6, (C, n)) * (rng.random((C, n)) < 0.95)  # some with a given rate (S = 0)
        c = rng.uniform(0.0, 0.12, (C, n))
        B = float(rng.uniform(0.05, 3.0)) * 1e6 * n
        bmin = B / n * float(rng.choice([0.01, 0.05, 0.5, 1.0]))
        yield S, c, a, B, bmin


def test_the_faster_split_is_the_previous_split():
    """The split with a tabulated start of each band solve (2 Newton steps instead of 6-8), Newton in V = 1 / U,
    a start at the V-tangent from the equal split and the last step's needs taken linearly (5 band solves
    instead of 11 at N = 1,024) reaches the split Newton in U reached from the cold start: U within 2e-11 and
    never more than 2e-12 above it (both stop within rounding of the root; the previous split at F <= 1e-13 B,
    which leaves U up to ~1e-11 high), every band within 1e-9 of B."""
    rng = np.random.default_rng(3661)
    for S, c, a, B, bmin in random_split_problems(rng, 40, 1100):
        bands, U = uplink.split(S, c, a, B, bmin)
        with np.errstate(divide="ignore", invalid="ignore"):
            bands_p, U_p = previous_split(S, c, a, B, bmin)
        np.testing.assert_allclose(U, U_p, rtol=2e-11)
        assert np.all(U <= U_p * (1 + 2e-12))
        assert np.max(np.abs(bands - bands_p)) <= 1e-9 * B
        np.testing.assert_allclose(bands.sum(-1), B, rtol=1e-12)


def test_each_row_of_a_split_is_the_row_split_alone():
    """A row's split does not depend on the rows split with it, bit for bit (each band solve stops per entry, and
    Newton per row): `Scorer`'s cache of cold splits relies on it."""
    rng = np.random.default_rng(3662)
    for S, c, a, B, bmin in random_split_problems(rng, 12, 1100):
        bands, U = uplink.split(S, c, a, B, bmin)
        for i in range(S.shape[0]):
            b_i, U_i = uplink.split(S[i], c[i], a, B, bmin)
            assert np.array_equal(b_i, bands[i]) and U_i == U[i]
        rho = S / np.maximum(U[:, None] - c, 1e-9)
        assert np.array_equal(uplink.band_for_rate_hz(rho[:, ::-1], a[::-1])[:, ::-1],
                              uplink.band_for_rate_hz(rho, a))


@pytest.mark.parametrize("rounds", ["synchronous", "asynchronous"])
def test_the_split_cache_plans_what_splitting_anew_plans(monkeypatch, rounds):
    """Cold splits kept per scorer and (L, modes) row (`Scorer._cached_shared_up`) give the plans and goodputs of
    splitting every row anew, bit for bit (random shared drops, four policies)."""
    rng = np.random.default_rng(3663)
    cases = [(int(rng.integers(2, 90)), float(rng.choice([0.01, 0.3, 1.0]))) for _ in range(4)]

    def plans(rows):
        monkeypatch.setattr(optimizer, "_SPLIT_CACHE_ROWS", rows)
        out = []
        for trial, (n, share) in enumerate(cases):
            sc = shared_drop(n, 3663 + trial, ul_min_share=share, rounds=rounds)
            for policy in ("proposed", "multispin-heterogeneous", "all-ul", "multispin-homogeneous"):
                p = plan(sc, policy)
                out.append((policy, n, p.modes, list(p.draft_lens), p.goodput_tps))
        return out

    assert plans(0) == plans(optimizer._SPLIT_CACHE_ROWS)
