"""The optimizer: prefix search = exhaustive mode search, greedy quality vs brute force, baselines."""

import numpy as np
import pytest

from testbed.core import model, optimizer
from testbed.core.optimizer import (
    POLICIES,
    FixedModes,
    InfeasiblePlanError,
    OptimizerError,
    Scorer,
    exhaustive_modes,
    greedy,
    plan,
)
from testbed.core.scenario import Scenario


def drop(n, seed, **kw):
    rng = np.random.default_rng(seed)
    devs = [dict(name=f"d{i}", distance_m=float(rng.uniform(50, 500)), draft_time_s=float(rng.uniform(0.015, 0.06)),
                 acceptance=float(rng.uniform(0.6, 0.85))) for i in range(n)]
    return Scenario.from_dict(dict(devices=devs, **kw))


def mixed_drop(n, seed, **kw):
    """A drop whose DL is scarce enough that both modes appear (DL band 0.5..8 MHz)."""
    rng = np.random.default_rng(1000 + seed)
    kw.setdefault("downlink_bandwidth_hz", float(rng.uniform(5e5, 8e6)))
    kw.setdefault("downlink_power_w", float(rng.uniform(1.0, 10.0)))
    return drop(n, seed, **kw)


@pytest.mark.parametrize("options", [{}, {"dl_provisioning": "expected"}, {"ul_protocol": "lazy"},
                                     {"dl_access": "tdma"}, {"dl_access": "fdma_fixed_split"}])
def test_prefix_search_equals_exhaustive_mode_search(options):
    rng = np.random.default_rng(5)
    mixed = 0
    for trial in range(24):
        n = int(rng.integers(1, 11))
        sc = mixed_drop(n, trial, **options)
        s = Scorer(sc)
        L = rng.integers(1, sc.max_draft_len + 1, size=n)
        G_prefix, _, ul = s.prefix(L[None])
        ul_best, G_best = exhaustive_modes(sc, L, s)
        assert G_prefix[0] == pytest.approx(G_best, rel=1e-9), (trial, n, L)
        mixed += 0 < ul[0].sum() < n
    assert mixed >= 5  # the instances do exercise mixed mode vectors


@pytest.mark.parametrize("options", [{}, {"rounds": "asynchronous"}, {"dl_access": "tdma"},
                                     {"ul_protocol": "lazy"}, {"dl_provisioning": "expected"}])
def test_plan_numbers_are_the_models_numbers(options):
    sc = mixed_drop(6, 1, **options)
    s = Scorer(sc)
    for policy in POLICIES:
        p = plan(sc, policy) if policy != "exhaustive" else None
        if p is None:
            continue
        equal = policy == "all-dl-equal-power" and sc.dl_access != "tdma"  # TDMA: full power per slot
        ev = model.evaluate(sc, p.modes, p.draft_lens,
                            dl_powers=np.full(6, sc.downlink_power_w / 6) if equal else None)
        assert p.goodput_tps == pytest.approx(ev.goodput_tps, rel=1e-12)
        ul = np.array([m == "UL" for m in p.modes])
        G, _ = s.fixed(np.asarray(p.draft_lens)[None], ul[None], equal_power=policy == "all-dl-equal-power")
        assert G[0] == pytest.approx(p.goodput_tps, rel=1e-7), policy  # batched scorer = evaluate()
        d = p.to_dict()
        if d["num_ul_devices"] < 6 and sc.dl_access != "tdma":
            assert sum(x["dl_power_w"] for x in d["devices"]) == pytest.approx(sc.downlink_power_w)


def test_greedy_with_fill_reaches_99_percent_of_exhaustive():
    rng = np.random.default_rng(6)
    fill, basic, proposed = [], [], []
    for trial in range(40):
        n = int(rng.integers(2, 5))
        lmax = int(rng.integers(3, 7))
        sc = mixed_drop(n, 100 + trial, max_draft_len=lmax)
        best = plan(sc, "exhaustive").goodput_tps
        s = Scorer(sc)
        fill.append(s.prefix(greedy(s, s.prefix, fill=True)[None])[0][0] / best)  # single start
        proposed.append(plan(sc, "proposed").goodput_tps / best)  # multi-start greedy with fill
        basic.append(plan(sc, "proposed-basic").goodput_tps / best)
    fill, basic, proposed = np.array(fill), np.array(basic), np.array(proposed)
    print(f"\ngreedy with fill: mean {fill.mean():.4f} worst {fill.min():.4f}; proposed (multi-start): "
          f"mean {proposed.mean():.4f} worst {proposed.min():.4f}; basic greedy: mean {basic.mean():.4f} "
          f"worst {basic.min():.4f} ({len(fill)} instances, N<=4, L_max<=6)")
    assert np.all(fill <= 1 + 1e-9) and np.all(basic <= 1 + 1e-9)  # nothing beats brute force
    assert fill.mean() >= 0.99 and proposed.mean() >= 0.995
    assert np.all(proposed >= fill - 1e-9)
    assert fill.mean() >= basic.mean()


def test_ul_devices_grow_as_dl_bandwidth_shrinks():
    bands = [4e7, 2e7, 1e7, 5e6, 2.5e6, 1.25e6]
    ks = np.zeros((8, len(bands)))
    for seed in range(8):
        for j, b in enumerate(bands):
            ks[seed, j] = plan(drop(20, seed, downlink_bandwidth_hz=b), "proposed").evaluation.num_ul_devices
    mean = ks.mean(axis=0)
    assert np.all(np.diff(mean) >= 0), mean
    assert mean[0] < mean[-1]


def test_few_devices_all_dl_many_devices_some_ul():
    # Spec section 9: with few devices all-DL is optimal; as N grows the fastest uplinks switch to UL.
    for seed in range(3):
        assert plan(drop(5, seed), "proposed").evaluation.num_ul_devices == 0
        assert plan(drop(60, seed), "proposed").evaluation.num_ul_devices > 0


def test_baselines_do_what_they_say():
    sc = mixed_drop(6, 3)
    assert all(m == "UL" for m in plan(sc, "all-ul").modes)
    assert all(m == "DL" for m in plan(sc, "all-dl").modes)
    eq = plan(sc, "all-dl-equal-power").to_dict()
    assert {round(x["dl_power_w"], 9) for x in eq["devices"]} == {round(sc.downlink_power_w / 6, 9)}
    assert eq["goodput_tps"] <= plan(sc, "all-dl").goodput_tps * (1 + 1e-9)
    assert set(plan(sc, "fixed-length").draft_lens) == {4}
    assert set(plan(sc, "fixed-length", fixed_length=7).draft_lens) == {7}
    assert len(set(plan(sc, "common-length").draft_lens)) == 1
    r1, r2 = plan(sc, "random-modes", seed=3), plan(sc, "random-modes", seed=3)
    assert r1.modes == r2.modes and list(r1.draft_lens) == list(r2.draft_lens)
    prop = plan(sc, "proposed").goodput_tps
    # proposed searches a superset of the common-length and fixed-length schedules' neighbourhoods
    for p in ("all-ul", "all-dl", "common-length", "fixed-length"):
        assert prop >= 0.99 * plan(sc, p).goodput_tps, p


def test_refusals_are_clear():
    with pytest.raises(OptimizerError, match="unknown policy 'best'; allowed: proposed"):
        plan(drop(2, 0), "best")
    with pytest.raises(OptimizerError, match=r"2\^8 x 12\^8 .* more than the limit"):
        plan(drop(8, 0), "exhaustive")
    with pytest.raises(OptimizerError, match="fixed_length"):
        plan(drop(2, 0), "fixed-length", fixed_length=0)


def test_async_and_options_plan_without_error():
    for opts in ({"rounds": "asynchronous"}, {"dl_provisioning": "realized"}, {"verify_batch": "padded"},
                 {"payload_format": "topk", "topk_k": 256}, {"dl_protocol": "all_positions"}):
        sc = mixed_drop(5, 2, **opts)
        p = plan(sc, "proposed")
        assert p.goodput_tps > 0
        assert p.goodput_tps >= 0.97 * plan(sc, "fixed-length").goodput_tps


# ---------------------------------------------------------------- issue 12: NaN plans, incremental scoring

OPTIONS = [{}, {"dl_provisioning": "expected"}, {"ul_protocol": "lazy"}, {"dl_access": "tdma"},
           {"dl_access": "fdma_fixed_split"}, {"verify_batch": "padded"}, {"rounds": "asynchronous"},
           {"payload_format": "topk", "topk_k": 256}, {"dl_protocol": "all_positions"},
           {"ul_protocol": "lazy", "dl_provisioning": "expected"},
           {"round_overhead_s": 0.01, "header_bits": 3000.0}]


def two_device_expected():
    """Issue 12: acceptances 0.999 and 0.6 with expected provisioning put DL payloads ~400x apart at L = 1;
    the landed solver returned NaN there and `proposed` planned L = [1, 1] with NaN goodput. Gains
    -90.5 and -115.06 dB (the issue's 10^-9.05 and 10^-11.506), drafting 2 ms per token, defaults otherwise."""
    return Scenario.from_dict(dict(dl_provisioning="expected", devices=[
        dict(name="a", channel_gain_db=-90.5, draft_time_s=0.002, acceptance=0.999),
        dict(name="b", channel_gain_db=-115.06, draft_time_s=0.002, acceptance=0.6)]))


def test_two_device_expected_provisioning_plans_the_optimum():
    sc = two_device_expected()
    best = plan(sc, "exhaustive")
    assert best.goodput_tps == pytest.approx(241.3, abs=0.05)
    assert best.modes == ["DL", "DL"] and list(best.draft_lens) == [12, 1]
    p = plan(sc, "proposed")
    assert np.isfinite(p.goodput_tps)
    assert p.goodput_tps >= 0.995 * best.goodput_tps
    assert p.modes == ["DL", "DL"] and list(p.draft_lens) == [12, 1]
    for policy in POLICIES:
        assert np.isfinite(plan(sc, policy).goodput_tps), policy


def all_numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from all_numbers(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from all_numbers(v)
    elif isinstance(x, (int, float, np.number)) and not isinstance(x, bool):
        yield float(x)


def wild_drop(n, seed, **kw):
    """Gains over 80 dB, acceptances from 0.3 to 0.999 (expected-provisioning payloads ~10^3 apart),
    drafting times over a decade, scarce or ample DL."""
    rng = np.random.default_rng(seed)
    devs = [dict(name=f"d{i}", channel_gain_db=float(rng.uniform(-150, -70)),
                 draft_time_s=float(10 ** rng.uniform(-3, -1)), acceptance=float(rng.uniform(0.3, 0.999)),
                 max_power_w=float(rng.uniform(0.01, 0.5))) for i in range(n)]
    kw.setdefault("downlink_bandwidth_hz", float(10 ** rng.uniform(5, 8)))
    kw.setdefault("downlink_power_w", float(10 ** rng.uniform(-1, 1.5)))
    return Scenario.from_dict(dict(devices=devs, **kw))


@pytest.mark.parametrize("options", OPTIONS)
def test_plans_never_contain_nan_or_infinity(options):
    rng = np.random.default_rng(len(str(options)))
    for trial in range(8):
        n = int(rng.integers(1, 9))
        sc = wild_drop(n, trial, **options)
        for policy in POLICIES:
            if policy == "exhaustive" and n > 3:
                continue
            if policy == "exhaustive":
                sc = sc.with_updates(max_draft_len=6)
            d = plan(sc, policy).to_dict()
            assert d["goodput_tps"] > 0, (policy, trial)
            bad = [v for v in all_numbers(d) if not np.isfinite(v)]
            assert not bad, (policy, trial, bad)


def test_an_infeasible_plan_is_an_error_not_infinity():
    devs = [dict(name="a", distance_m=300, draft_time_s=0.02, acceptance=0.7, energy_budget_j=1e-12),
            dict(name="b", distance_m=100, draft_time_s=0.02, acceptance=0.7)]
    sc = Scenario.from_dict(dict(devices=devs))
    for policy in ("proposed", "all-dl", "all-ul", "common-length"):
        with pytest.raises(InfeasiblePlanError, match=r"(?s)device a .*energy_budget_j 1e-12 J is below"):
            plan(sc, policy)
    # A budget that allows the small DL-mode upload only: UL mode is infeasible for a, DL mode is not.
    devs[0]["energy_budget_j"] = 1e-6
    sc = Scenario.from_dict(dict(devices=devs))
    p = plan(sc, "proposed")
    assert p.modes[0] == "DL" and np.isfinite(p.goodput_tps)
    with pytest.raises(InfeasiblePlanError, match=r"(?s)'all-ul'.*device a \(UL mode"):
        plan(sc, "all-ul")


@pytest.mark.parametrize("options", OPTIONS)
def test_incremental_scoring_equals_full_scoring(options):
    """prefix_neighbors / fixed_neighbors (the greedy's single increments, scored from one base row) give
    the numbers and modes of scoring every candidate in full."""
    rng = np.random.default_rng(7 + len(options))
    for trial in range(16):
        n = int(rng.integers(1, 60))
        sc = (mixed_drop if trial % 2 else wild_drop)(n, trial, **options)  # wild: payloads far apart
        s = Scorer(sc)
        L0 = rng.integers(1, sc.max_draft_len + 1, n)
        if trial % 3 == 0:
            L0[:] = L0[0]  # ties of the key between devices at the same length
        ks = np.flatnonzero(L0 < sc.max_draft_len)
        if ks.size == 0:
            continue
        Lc = np.repeat(L0[None], ks.size, axis=0)
        Lc[np.arange(ks.size), ks] += 1
        G, T, ul = s.prefix(Lc)
        G2, T2, ul2, up2 = s.prefix_neighbors(L0, ks, Lc)
        np.testing.assert_allclose(G2, G, rtol=1e-12)
        np.testing.assert_allclose(T2, T, rtol=1e-12)
        assert np.array_equal(ul2, ul)
        idx = s._index(Lc)
        uplink = lambda modes, s=s, idx=idx: np.where(modes, s.flat["up_u"][idx], s.flat["up_d"][idx]).max(-1)
        if up2 is not None:  # the uplink phase of each row's modes (the greedy's bottleneck)
            np.testing.assert_array_equal(up2, uplink(ul))
        for modes in (np.zeros(n, bool), np.ones(n, bool), rng.random(n) < 0.5):
            for equal in (False, True):
                G, T = s.fixed(Lc, np.broadcast_to(modes, Lc.shape), equal_power=equal)
                G2, T2, _, up2 = s.fixed_neighbors(L0, ks, Lc, modes, equal)
                np.testing.assert_allclose(G2, G, rtol=1e-12)
                if up2 is not None:
                    np.testing.assert_array_equal(up2, uplink(np.broadcast_to(modes, Lc.shape)))


@pytest.mark.parametrize("options", [{}, {"dl_provisioning": "expected"}, {"ul_protocol": "lazy"},
                                     {"dl_access": "tdma"}, {"verify_batch": "padded"}])
def test_greedy_shortcuts_take_the_same_steps(monkeypatch, options):
    """Incremental candidates and bounded fill rows change the cost of a greedy step, not the step."""
    rng = np.random.default_rng(11)
    cases = [(n, trial, rng.random(n) < 0.5) for trial, n in enumerate(rng.integers(2, 40, size=6))]

    def plans(incremental: bool):
        monkeypatch.setattr(optimizer, "_INCREMENTAL_MIN_N", 0 if incremental else 10 ** 9)
        monkeypatch.setattr(optimizer, "_BOUNDED_MIN_ROWS", 0 if incremental else 10 ** 9)
        out = []
        for n, trial, modes in cases:
            sc = mixed_drop(n, 50 + trial, **options)
            for policy in ("proposed", "all-dl", "all-ul", "random-modes"):
                p = plan(sc, policy)
                out.append((policy, p.modes, list(p.draft_lens), p.goodput_tps))
            s = Scorer(sc)
            out.append(("fixed-modes greedy", list(greedy(s, FixedModes(s, modes), fill=True))))
        return out

    full, fast = plans(False), plans(True)
    for a, b in zip(full, fast):
        assert a[:3] == b[:3]
        if len(a) > 3:
            assert b[3] == pytest.approx(a[3], rel=1e-12)


@pytest.mark.parametrize("options", [{}, {"verify_batch": "padded"}, {"dl_provisioning": "expected"},
                                     {"ul_access": "fdma_shared"},
                                     {"ul_access": "fdma_shared", "verify_batch": "padded"},
                                     {"ul_access": "fdma_shared", "ul_min_share": 0.5}])
@pytest.mark.parametrize("groups", [0, 64])
def test_fast_fill_rows_and_shared_increments_match_the_previous_algorithm(monkeypatch, options, groups):
    """Issue 36's fast paths (fill rows bounded by one sorted sweep and scored as increments of one row per
    pattern, `_fill_rows_sparse`; a shared uplink's increments bounded by Newton steps on demand tables,
    `SharedModes.neighbors`) against the previous algorithm, every candidate and fill row scored in full:
    the same plan, the same goodput within 1e-9 relative. groups=0: every fill row by the chunked bound."""
    rng = np.random.default_rng(36 + len(options))
    cases = [(int(n), trial) for trial, n in enumerate(rng.integers(2, 70, size=5))]

    def plans(fast: bool):
        monkeypatch.setattr(optimizer, "_INCREMENTAL_MIN_N", 0 if fast else 10 ** 9)
        monkeypatch.setattr(optimizer, "_BOUNDED_MIN_ROWS", 0 if fast else 10 ** 9)
        monkeypatch.setattr(optimizer, "_SPARSE_FILL_MIN_N", 0 if fast else 10 ** 9)
        monkeypatch.setattr(optimizer, "_FILL_GROUPS_MAX", groups)
        out = []
        for n, trial in cases:
            sc = mixed_drop(n, 360 + trial, **options)
            for policy in ("proposed", "all-dl", "all-ul", "multispin-heterogeneous"):
                p = plan(sc, policy)
                out.append((policy, n, p.modes, list(p.draft_lens), p.goodput_tps))
        return out

    for a, b in zip(plans(False), plans(True)):
        assert a[:4] == b[:4]
        assert b[4] == pytest.approx(a[4], rel=1e-9)


@pytest.mark.parametrize("options", [{}, {"ul_protocol": "lazy"}, {"ul_access": "fdma_shared"}])
def test_compact_prefix_modes_are_the_dense_modes(options):
    """`prefix_neighbors(..., compact=True)` (the greedy's modes without a (C, N) array, issue 36): its rows, its
    modes at given pairs, its most common mode per device and the pairs that differ from it are exactly those of
    the dense array."""
    rng = np.random.default_rng(361)
    checked = 0
    for trial in range(12):
        n = int(rng.integers(2, 80))
        sc = mixed_drop(n, 700 + trial, **options)
        s = Scorer(sc)
        L0 = rng.integers(1, sc.max_draft_len + 1, n)
        ks = np.flatnonzero(L0 < sc.max_draft_len)
        if ks.size == 0 or not s.incremental:
            continue
        G, T, dense, up = s.prefix_neighbors(L0, ks)
        G2, T2, compact, up2 = s.prefix_neighbors(L0, ks, compact=True)
        assert np.array_equal(G2, G) and np.array_equal(T2, T) and np.array_equal(up2, up)
        assert isinstance(compact, optimizer._PrefixModes)
        assert np.array_equal(np.asarray(compact), dense)
        pick = rng.integers(0, ks.size, 5)
        assert np.array_equal(compact[pick], dense[pick])
        r, j = rng.integers(0, ks.size, 50), rng.integers(0, n, 50)
        assert np.array_equal(compact.at(r, j), dense[r, j])
        pattern = 2 * dense.sum(axis=0) >= ks.size
        assert np.array_equal(compact.pattern(), pattern)
        for mode_row in (pattern, rng.random(n) < 0.5):  # the majority, and any other pattern
            pr, pj = compact.differ(mode_row, limit=10 ** 9)
            dr, dj = np.nonzero(dense != mode_row[None, :])
            assert np.array_equal(pr, dr) and np.array_equal(pj, dj)
            assert compact.differ(mode_row, limit=-1) is None  # over the limit: the caller builds the rows
            assert compact.differ(mode_row, limit=dr.size + 2 * ks.size) is not None  # <= 2 corrections a row
        checked += 1
    assert checked >= 6


def test_shared_bounds_reusing_the_previous_steps_tables_plan_the_same(monkeypatch):
    """`_SharedBase.of(..., prev)` keeps the previous step's demand tables above U_0 (issue 36): its round time
    bounds stay below the exact round times, and the shared-band plans are those of fresh tables every step (the
    same lengths and modes, goodput within 1e-9 relative)."""
    rng = np.random.default_rng(362)
    sc = mixed_drop(40, 5, ul_access="fdma_shared")
    s = Scorer(sc)
    ul = rng.random(40) < 0.5
    L0 = np.ones(40, int)
    base = optimizer._SharedBase.of(s, ul, L0)
    for _ in range(6):  # a walk of raised schedules, as the greedy's steps
        L0 = np.minimum(L0 + (rng.random(40) < 0.2), sc.max_draft_len)
        base = optimizer._SharedBase.of(s, ul, L0, base)
        rows = np.minimum(L0[None] + rng.integers(0, 3, (30, 40)), sc.max_draft_len)
        T = s.exact(rows, np.broadcast_to(ul, rows.shape))[1]
        assert np.all(base.round_time_lower(rows) <= T)
    of = optimizer._SharedBase.of.__func__

    def plans(reuse: bool):
        monkeypatch.setattr(optimizer._SharedBase, "of",
                            classmethod(lambda cls, s, ul, L0, prev=None: of(cls, s, ul, L0, prev if reuse else None)))
        monkeypatch.setattr(optimizer, "_INCREMENTAL_MIN_N", 0)
        out = []
        for trial, n in enumerate((12, 30, 70)):
            sc = mixed_drop(n, 800 + trial, ul_access="fdma_shared")
            for policy in ("proposed", "multispin-heterogeneous"):
                p = plan(sc, policy)
                out.append((policy, n, p.modes, list(p.draft_lens), p.goodput_tps))
        return out

    for a, b in zip(plans(False), plans(True)):
        assert a[:4] == b[:4]
        assert b[4] == pytest.approx(a[4], rel=1e-9)


def sorted_sweep(L, tab, thr, tables):
    """`_level_sweep` as it was before issue 36's follow-up: the events above L sorted at every call, and the
    running maximum's device for every event count."""
    n, lmax = tab.shape
    lens = np.broadcast_to(np.arange(1, lmax + 1), tab.shape)
    above = lens > L[:, None]
    order = np.argsort(tab[above], kind="stable")
    times = tab[above][order]
    at = np.searchsorted(times, thr, side="right")
    sums = [V[np.arange(n), L - 1].sum()
            + np.concatenate([[0.0], np.cumsum(np.diff(V, axis=1, prepend=0.0)[above][order])])[at] for V in tables]
    level, dev = lens[above][order], np.broadcast_to(np.arange(n)[:, None], tab.shape)[above][order]
    top, top_dev = np.zeros(times.size + 1, int), np.full(times.size + 1, -1)
    if times.size:
        top[1:] = np.maximum.accumulate(level)
        sets = np.flatnonzero(level == top[1:])
        top_dev[1:] = dev[sets[np.searchsorted(sets, np.arange(times.size), side="right") - 1]]
    return sums, at, top[at], top_dev[at]


def test_level_sweep_with_a_kept_order_is_the_sorted_sweep():
    """`_level_sweep` with the stable order of the whole table (`_sweep_order`, kept between greedy steps) and the
    running maximum's device looked up at the thresholds alone gives exactly what the sweep that sorted the events
    above L at every step gave, ties included (a table of few distinct values)."""
    rng = np.random.default_rng(363)
    for _ in range(20):
        n, lmax = int(rng.integers(1, 50)), int(rng.integers(1, 9))
        tab = np.sort(rng.integers(0, 6, (n, lmax)), axis=1) * 0.01  # increasing in L, many ties
        L = rng.integers(1, lmax + 1, n)
        thr = np.sort(rng.uniform(-0.01, 0.06, 7))
        tables = [np.cumsum(rng.random((n, lmax)), axis=1) for _ in range(2)]
        ref = sorted_sweep(L, tab, thr, tables)
        for order in (None, np.argsort(tab.ravel(), kind="stable")):
            got = optimizer._level_sweep(L, tab, thr, tables, order)
            for x, y in zip(got[1:], ref[1:]):
                assert np.array_equal(x, y)
            for x, y in zip(got[0], ref[0]):
                assert np.array_equal(x, y)


def test_level_sweep_over_the_events_up_to_the_last_threshold_is_the_full_sweep():
    """`_level_sweep` gathers the gains of the events up to the last threshold only, every table in one array
    (a shared uplink's bound has 28 tables of N L_max entries): exactly the sums of the sweep over every event,
    one table at a time, at sizes where numpy's pairwise sums differ from sequential ones."""
    rng = np.random.default_rng(3664)
    for _ in range(20):
        n, lmax = int(rng.integers(1, 1500)), int(rng.integers(1, 17))
        tab = np.sort(rng.integers(0, 40, (n, lmax)), axis=1) * 0.01
        L = rng.integers(1, lmax + 1, n)
        thr = np.sort(rng.uniform(-0.01, 0.3, int(rng.integers(1, 40))))
        tables = [np.cumsum(rng.random((n, lmax)), axis=1) * 10 ** rng.uniform(-3, 9)
                  for _ in range(int(rng.integers(1, 30)))]
        ref = sorted_sweep(L, tab, thr, tables)
        got = optimizer._level_sweep(L, tab, thr, tables, np.argsort(tab.ravel(), kind="stable"))
        assert len(got[0]) == len(ref[0])
        for x, y in zip(got[0], ref[0]):
            assert np.array_equal(x, y)
        for x, y in zip(got[1:], ref[1:]):
            assert np.array_equal(x, y)


def test_first_min_per_row_is_the_lexsort_pick():
    """`_first_min_per_row` (prefix_neighbors' best K per row without a sort) picks what a lexsort by (row, T, K)
    picks: the smallest T, the smallest K among equal T, NaN after every number (a row of NaN: its first K)."""
    rng = np.random.default_rng(364)
    for _ in range(30):
        C = int(rng.integers(1, 20))
        counts = rng.integers(1, 6, C)
        rows = np.repeat(np.arange(C), counts)
        Ks = np.concatenate([np.sort(rng.choice(40, c, replace=False)) for c in counts])
        T = rng.integers(0, 4, rows.size).astype(float)  # many ties
        T[rng.random(rows.size) < 0.2] = np.nan
        T[rng.random(rows.size) < 0.1] = np.inf
        order = np.lexsort((Ks, T, rows))
        first = np.ones(order.size, bool)
        first[1:] = rows[order][1:] != rows[order][:-1]
        assert np.array_equal(optimizer._first_min_per_row(rows, T), order[first])


def test_distinct_fill_rows_are_the_dense_fill_rows():
    """`_distinct_fill_rows` (each distinct fill row built once) gives every row max(L + e_k, fill levels) exactly,
    with the rows in one mode vector (deduplicated) and in mixed modes (built densely), bottlenecks repeated."""
    rng = np.random.default_rng(11)
    for trial in range(20):
        n = int(rng.integers(3, 40))
        s = Scorer(mixed_drop(n, trial))
        L = rng.integers(1, s.lmax, n)
        ks = rng.choice(n, int(rng.integers(1, 3 * n)))
        tab = np.where(rng.random(n) < 0.5, s.tb.up_ul.T, s.tb.up_dl.T).T
        bottleneck = rng.choice(tab.ravel(), 4)[rng.integers(0, 4, ks.size)]  # few distinct levels, as in a step
        for ul in (np.broadcast_to(rng.random(n) < 0.5, (ks.size, n)), rng.random((ks.size, n)) < 0.5):
            rows, inv = optimizer._distinct_fill_rows(s, L, ks, ul, bottleneck)
            Lc = np.repeat(L[None], ks.size, axis=0)
            Lc[np.arange(ks.size), ks] += 1
            assert np.array_equal(rows[inv], np.maximum(Lc, optimizer._fill_levels(s, ul, bottleneck)))
