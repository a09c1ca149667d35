"""The optimizer: prefix search = exhaustive mode search, greedy quality vs brute force, baselines."""

import numpy as np
import pytest

from testbed.core import model
from testbed.core.optimizer import POLICIES, OptimizerError, Scorer, exhaustive_modes, greedy, plan
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
    assert fill.mean() >= 0.99 and proposed.mean() >= 0.99
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
