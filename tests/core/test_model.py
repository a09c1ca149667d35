"""The analytic model: closed forms, DL power allocation, and one test per Option on its direction."""

import math

import numpy as np
import pytest

from testbed.core import model, power, radio
from testbed.core.scenario import Scenario

N0 = radio.noise_psd_w_per_hz(-174, 9)


def scenario(n=4, seed=0, **kw):
    rng = np.random.default_rng(seed)
    devs = [dict(name=f"d{i}", distance_m=float(rng.uniform(50, 500)), draft_time_s=float(rng.uniform(0.015, 0.06)),
                 acceptance=float(rng.uniform(0.6, 0.85))) for i in range(n)]
    return Scenario.from_dict(dict(devices=devs, **kw))


def test_bit_sizes():
    assert model.bits_per_id(151936) == 18
    assert list(model.bits_index([1, 2, 3, 4, 7, 8, 12])) == [1, 2, 2, 3, 3, 4, 4]
    sc = scenario()
    assert model.distribution_bits(sc) == 151936 * 16  # 2.43 Mbit, spec section 3
    topk = sc.with_updates(payload_format="topk", topk_k=1024)
    assert model.distribution_bits(topk) == 1024 * (18 + 16)


@pytest.mark.parametrize("a", [0.3, 0.7, 0.95])
@pytest.mark.parametrize("L", [1, 4, 12])
def test_expected_tokens_matches_the_acceptance_law(a, L):
    # P(A = i) = a^i (1 - a) for i < L, P(A = L) = a^L; tokens = A + 1.
    probs = [a ** i * (1 - a) for i in range(L)] + [a ** L]
    assert sum(probs) == pytest.approx(1.0)
    direct = sum(p * (i + 1) for i, p in enumerate(probs))
    assert model.expected_tokens(a, L) == pytest.approx(direct, rel=1e-12)
    assert model.expected_tokens(1.0, L) == L + 1  # the a = 1 limit


def test_spec_magnitudes_of_the_uplink():
    # Spec section 3: at 1 MHz, 23 dBm, 200 m the UL is about 8.7 Mbit/s and a distribution ~0.28 s.
    sc = Scenario.from_dict(dict(devices=[dict(name="a", distance_m=200, max_power_w=0.2, draft_time_s=0.03,
                                               acceptance=0.7)]))
    ev = model.evaluate(sc, ["UL"], [4])
    assert ev.ul_rate_bps[0] == pytest.approx(8.7e6, rel=0.01)
    per_dist = 151936 * 16 / ev.ul_rate_bps[0]
    assert per_dist == pytest.approx(0.28, abs=0.005)
    assert ev.uplink_s[0] == pytest.approx(4 * 0.03 + 4 * (18 + 151936 * 16) / ev.ul_rate_bps[0])
    assert ev.draft_s[0] == pytest.approx(0.12) and ev.tx_s[0] == pytest.approx(ev.uplink_s[0] - 0.12)


def test_channel_inversion_equals_bisection_for_equal_payloads():
    rng = np.random.default_rng(1)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        g = radio.db_to_linear(rng.uniform(-130, -80, n))
        w, S, P = rng.uniform(1e5, 1e7), rng.uniform(1e4, 5e6), rng.uniform(0.5, 20)
        p_ci, tau_ci = power.dl_power_channel_inversion(S, g, w, P, N0)
        p_b, tau_b = power.dl_power_bisection(np.full(n, S), g, w, P, N0)
        assert tau_ci == pytest.approx(tau_b, rel=1e-9)
        assert np.allclose(p_ci, p_b, rtol=1e-6)
        assert p_ci.sum() == pytest.approx(P)


def test_newton_solver_equals_bisection_for_unequal_payloads():
    rng = np.random.default_rng(2)
    for _ in range(30):
        n = int(rng.integers(1, 10))
        g = radio.db_to_linear(rng.uniform(-130, -80, n))
        S = rng.uniform(1e3, 5e6, n)  # payloads three orders of magnitude apart
        w, P = rng.uniform(1e5, 1e7), rng.uniform(0.5, 20)
        p_n, tau_n = power.optimal_dl_powers(S, g, w, P, N0)
        p_b, tau_b = power.dl_power_bisection(S, g, w, P, N0)
        assert tau_n == pytest.approx(tau_b, rel=1e-7)
        assert p_n.sum() == pytest.approx(P)
        lat = S / radio.shannon_rate_bps(w, p_n, g, N0)
        assert np.allclose(lat, tau_n, rtol=1e-6)  # all DL latencies equal at the optimum


def test_verify_time_from_its_statistics_is_the_same_number():
    # The optimizer's incremental scoring computes T_ver from sum (L + 1) and max L only.
    rng = np.random.default_rng(5)
    for batch in ("ragged", "padded"):
        sc = scenario(6, verify_batch=batch, verify_t1_s=1.3e-4)
        L = rng.integers(1, 13, size=(50, 6))
        direct = model.verify_time(sc, L)
        stats = model.verify_time_of(sc, (L + 1).sum(-1), L.max(-1), 6)
        assert np.array_equal(direct, stats)


def test_removing_a_dl_device_never_increases_tau():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(2, 10))
        g = radio.db_to_linear(rng.uniform(-130, -80, n))
        S = rng.uniform(1e5, 3e6, n)
        B, P = 2e7, 10.0
        _, tau = power.optimal_dl_powers(S, g, B / n, P, N0)
        _, tau_less = power.optimal_dl_powers(S[1:], g[1:], B / (n - 1), P, N0)
        assert tau_less <= tau * (1 + 1e-9)


def test_evaluate_round_time_and_goodput_definitions():
    sc = scenario(5, verify_t0_s=0.02, verify_t1_s=1e-3, round_overhead_s=0.005)
    modes, L = ["UL", "DL", "DL", "UL", "DL"], [1, 3, 2, 1, 4]
    ev = model.evaluate(sc, modes, L)
    assert ev.phases["verify"] == pytest.approx(0.02 + 1e-3 * sum(l + 1 for l in L))
    assert ev.phases["uplink"] == pytest.approx(ev.uplink_s.max())
    assert ev.round_time_s == pytest.approx(sum(ev.phases.values()) + 0.005)
    assert ev.goodput_tps == pytest.approx(ev.expected_tokens.sum() / ev.round_time_s)
    dl = np.array(modes) == "DL"
    assert ev.dl_power_w[dl].sum() == pytest.approx(sc.downlink_power_w)
    assert np.all(ev.dl_power_w[~dl] == 0)
    assert ev.dl_bandwidth_per_device_hz == pytest.approx(2e7 / 3)
    assert np.allclose(ev.downlink_s[~dl], sc.ul_reply_s)
    # DL-mode uplink is drafting plus a few hundred bits
    assert np.allclose(ev.uplink_s[dl], ev.draft_s[dl], rtol=1e-3)


def test_evaluate_rejects_bad_schedules():
    sc = scenario(2)
    with pytest.raises(ValueError, match=r"modes\[1\]: 'XL' is not allowed"):
        model.evaluate(sc, ["UL", "XL"], [1, 1])
    with pytest.raises(ValueError, match=r"draft_lens\[0\]: 13 is not allowed: must be an integer in 1..12"):
        model.evaluate(sc, ["UL", "DL"], [13, 1])
    with pytest.raises(ValueError, match=r"ul_powers\[0\]"):
        model.evaluate(sc, ["UL", "DL"], [1, 1], ul_powers=[1.0, 0.1])


def test_accepted_count_draws_follow_the_law():
    # mean tokens per round over 20000 rounds within 4.5 standard errors (false alarm < 1e-5)
    rng = np.random.default_rng(4)
    a, L, n = np.array([0.6, 0.8]), np.array([3, 6]), 20000
    draws = np.array([model.draw_accepted(rng, a, L) for _ in range(n)])
    mean = model.expected_tokens(a, L) - 1
    se = draws.std(axis=0) / math.sqrt(n)
    assert np.all(np.abs(draws.mean(axis=0) - mean) < 4.5 * se)
    assert draws.max(axis=0).tolist() == L.tolist() and draws.min() == 0


def test_realized_round_worst_case_and_realized_provisioning():
    sc = scenario(4)
    L = [3, 3, 3, 3]
    ev = model.evaluate(sc, ["DL"] * 4, L)
    all_rejected = model.realized_round(sc, ev, [0, 1, 2, 0])
    assert all_rejected["round_time_s"] == pytest.approx(ev.round_time_s, rel=1e-9)
    one = model.realized_round(sc, ev, [3, 3, 3, 1])  # only d3 rejected
    assert one["round_time_s"] == pytest.approx(ev.round_time_s, rel=1e-9)  # planned rate for d3
    rz = sc.with_updates(dl_provisioning="realized")
    ev_rz = model.evaluate(rz, ["DL"] * 4, L)
    one_rz = model.realized_round(rz, ev_rz, [3, 3, 3, 1])
    assert one_rz["phases"]["downlink"] < one["phases"]["downlink"]  # the whole DL to the one rejecter
    assert list(one_rz["tokens"]) == [4, 4, 4, 2]


# ---------------------------------------------------------------- one test per Option

def test_option_ul_protocol_lazy_moves_the_distribution_after_verification():
    sc = scenario(3)
    eager = model.evaluate(sc, ["UL"] * 3, [4] * 3)
    lazy = model.evaluate(sc.with_updates(ul_protocol="lazy"), ["UL"] * 3, [4] * 3)
    assert np.all(lazy.uplink_s < eager.uplink_s)
    assert np.all(lazy.downlink_s > eager.downlink_s)  # one distribution + handshake after verification
    assert lazy.round_time_s < eager.round_time_s  # one distribution instead of L = 4


def test_option_dl_protocol_all_positions_downloads_L_plus_1():
    sc = scenario(3)
    rej = model.evaluate(sc, ["DL"] * 3, [4] * 3)
    allp = model.evaluate(sc.with_updates(dl_protocol="all_positions"), ["DL"] * 3, [4] * 3)
    assert np.allclose(allp.dl_bits, 5 * model.distribution_bits(sc))
    assert allp.phases["downlink"] > 4 * rej.phases["downlink"]
    assert np.all(allp.ul_bits < rej.ul_bits)  # no q(x) scalars: the device verifies itself


def test_option_dl_provisioning_expected_is_smaller():
    sc = scenario(3)
    wc = model.evaluate(sc, ["DL"] * 3, [2] * 3)
    ex = model.evaluate(sc.with_updates(dl_provisioning="expected"), ["DL"] * 3, [2] * 3)
    a = sc.device_array("acceptance")
    assert np.allclose(ex.dl_bits - model.bits_index(2), (1 - a ** 2) * model.distribution_bits(sc)
                       + a ** 2 * 18)
    assert ex.phases["downlink"] < wc.phases["downlink"]


def test_option_payload_format_topk_shrinks_the_uplink():
    sc = scenario(3)
    dense = model.evaluate(sc, ["UL"] * 3, [3] * 3)
    topk = model.evaluate(sc.with_updates(payload_format="topk", topk_k=1024), ["UL"] * 3, [3] * 3)
    assert np.allclose(topk.ul_bits, 3 * (18 + 1024 * 34))
    assert np.all(topk.uplink_s < dense.uplink_s)


def test_option_verify_batch_padded_costs_the_longest_draft():
    sc = scenario(3, verify_t1_s=1e-3)
    rag = model.evaluate(sc, ["DL"] * 3, [1, 2, 6])
    pad = model.evaluate(sc.with_updates(verify_batch="padded"), ["DL"] * 3, [1, 2, 6])
    assert pad.phases["verify"] == pytest.approx(0.02 + 1e-3 * 3 * 7)
    assert pad.phases["verify"] > rag.phases["verify"]
    same = model.evaluate(sc.with_updates(verify_batch="padded"), ["DL"] * 3, [4] * 3)
    assert same.phases["verify"] == pytest.approx(model.evaluate(sc, ["DL"] * 3, [4] * 3).phases["verify"])


def test_option_dl_access():
    sc = scenario(4)
    modes = ["UL", "DL", "DL", "UL"]
    eq = model.evaluate(sc, modes, [2] * 4)
    fixed = model.evaluate(sc.with_updates(dl_access="fdma_fixed_split"), modes, [2] * 4)
    assert fixed.dl_bandwidth_per_device_hz == pytest.approx(eq.dl_bandwidth_per_device_hz / 2)
    assert fixed.phases["downlink"] > eq.phases["downlink"]  # half the band for the same DL set
    tdma = model.evaluate(sc.with_updates(dl_access="tdma"), modes, [2] * 4)
    full = radio.shannon_rate_bps(2e7, 10.0, sc.gains_linear()[1:3], sc.noise_psd_w_hz)
    assert tdma.phases["downlink"] == pytest.approx((tdma.dl_bits[1:3] / full).sum())
    one = ["UL", "DL", "UL", "UL"]  # one DL device: TDMA and FDMA coincide
    assert model.evaluate(sc.with_updates(dl_access="tdma"), one, [2] * 4).phases["downlink"] == pytest.approx(
        model.evaluate(sc, one, [2] * 4).phases["downlink"])


def test_option_rounds_asynchronous_is_not_held_by_the_slowest():
    sc = scenario(4)
    modes, L = ["UL", "DL", "DL", "DL"], [2, 3, 3, 3]
    sync = model.evaluate(sc, modes, L)
    asyn = model.evaluate(sc.with_updates(rounds="asynchronous"), modes, L)
    assert np.all(asyn.device_round_s <= sync.round_time_s + 1e-12)
    assert asyn.goodput_tps > sync.goodput_tps
    assert asyn.goodput_tps == pytest.approx((asyn.expected_tokens / asyn.device_round_s).sum())


def test_option_energy_budget_lowers_ul_power_within_budget():
    sc = scenario(2)
    free = model.evaluate(sc, ["UL", "UL"], [3, 3])
    energy_free = free.ul_power_w * free.tx_s
    budget = float(energy_free[0] * 0.5)
    data = sc.model_dump(exclude_none=True)
    data["devices"][0]["energy_budget_j"] = budget
    tight = model.evaluate(Scenario.from_dict(data), ["UL", "UL"], [3, 3])
    assert tight.ul_power_w[0] < free.ul_power_w[0]
    assert tight.ul_power_w[0] * tight.tx_s[0] == pytest.approx(budget, rel=1e-6)
    assert tight.uplink_s[0] > free.uplink_s[0]
    assert tight.ul_power_w[1] == free.ul_power_w[1]


def test_round_overhead_and_reply_constant():
    sc = scenario(2)
    ev0 = model.evaluate(sc, ["UL", "UL"], [1, 1])
    ev1 = model.evaluate(sc.with_updates(round_overhead_s=0.05, ul_reply_s=0.004), ["UL", "UL"], [1, 1])
    assert ev0.phases["downlink"] == pytest.approx(sc.ul_reply_s)
    assert ev1.phases["downlink"] == pytest.approx(0.004)
    assert ev1.round_time_s == pytest.approx(ev0.round_time_s + 0.05 + 0.004 - sc.ul_reply_s)


def test_header_bits_are_charged_on_every_upload_and_dl_mode_verdict():
    base = scenario(n=3, seed=2)
    with_header = scenario(n=3, seed=2, header_bits=2800.0)
    modes, lens = ["UL", "DL", "DL"], [3, 2, 4]
    ev0, ev1 = model.evaluate(base, modes, lens), model.evaluate(with_header, modes, lens)
    np.testing.assert_allclose(ev1.ul_bits - ev0.ul_bits, 2800.0)
    np.testing.assert_allclose((ev1.dl_bits - ev0.dl_bits)[1:], 2800.0)
    # The DL-mode uplink grows by exactly header / rate.
    np.testing.assert_allclose(ev1.tx_s[1:] - ev0.tx_s[1:], 2800.0 / ev0.ul_rate_bps[1:], rtol=1e-9)


def test_controller_learns_the_header_from_charged_bytes():
    from edge_node.controller import Controller

    sc = scenario(n=2, seed=1)
    ctl = Controller(sc)
    planned = 1000.0
    for extra_bytes in (300, 310, 290, 5000):  # one outlier: the median ignores it
        ctl.observe_upload(int(planned / 8) + extra_bytes, planned, 0.0)
    assert ctl.header_bits == pytest.approx(8 * 305)
    assert ctl.scenario_for([d.name for d in sc.devices], ctl.static_gains).header_bits == pytest.approx(8 * 305)
