"""The acceptance under each top-k option (`edge_node.topk_estimate`, pure) and its calibration before round 0
on a real draft model and target (`edge_node.topk_calibration`, the micro pair)."""

from __future__ import annotations

import numpy as np
import pytest

from device_node.drafter import OnnxDrafter
from edge_node.controller import Controller, DeviceEstimate
from edge_node.topk_calibration import SESSION_PREFIX, calibrate_topk_acceptance
from edge_node.topk_estimate import alpha_under, dense_alpha
from edge_node.verifier import BatchedVerifier, load_target
from testbed.core import payload
from testbed.core.sampling import SamplingParams
from testbed.core.scenario import Scenario

SC = {"vocab_size": 4096, "max_draft_len": 6, "payload_format": "topk", "topk_choices": [16, 64],
      "devices": [{"name": "a", "distance_m": 100, "draft_time_s": 0.002, "acceptance": 0.7}]}


def test_a_k_rounds_count_as_dense_evidence_through_its_ratio():
    def ratio(k):
        return {16: 0.5, 64: 0.8}[k]
    # 10 of 20 trials under k = 16 (ratio 0.5) say what 20 dense successes in 20 trials would say
    assert dense_alpha(DeviceEstimate(0.7, 0.0, 0.002), {("a", 16): [10, 20]}, "a", ratio) == pytest.approx(1 - 1e-3)
    seen = {("a", 16): [6, 20], ("a", 64): [8, 10], ("b", 16): [0, 50]}
    assert dense_alpha(DeviceEstimate(0.7, 10, 0.002), seen, "a", ratio, skip=64) == pytest.approx((7 + 12) / 30)
    dense = DeviceEstimate(0.7, 10, 0.002, successes=3, trials=5)  # its dense rounds count as they are
    assert dense_alpha(dense, seen, "a", ratio) == pytest.approx((7 + 3 + 12 + 10) / (10 + 5 + 20 + 10))
    assert dense_alpha(DeviceEstimate(0.7, 10, 0.002), seen, "c", ratio) == 0.7
    # alpha under k: its own rounds around ratio x dense
    assert alpha_under(64, 0.6, 8, None, ratio) == pytest.approx(0.48)
    assert alpha_under(64, 0.6, 8, (2, 12), ratio) == pytest.approx((0.48 * 8 + 2) / 20)


def test_the_controller_plans_each_k_on_the_calibrated_ratio():
    ctl = Controller(Scenario.from_dict(SC), calibrate=True)
    assert ctl.alpha_topk("a", 16) == pytest.approx(0.7)  # no ratio given: no loss assumed
    assert ctl.calibrate_topk({"ratio": {"16": 0.5, "64": 0.8}, "acceptance": {}, "positions": 10})
    assert ctl.alpha_topk("a", 16) == pytest.approx(0.35) and ctl.alpha_topk("a", 64) == pytest.approx(0.56)
    rp = ctl.plan_round(0, ["a"])
    assert rp.estimates["a"]["alpha_topk"] == {"16": pytest.approx(0.35), "64": pytest.approx(0.56)}
    if rp.topk is not None:  # the chosen option is planned on its calibrated alpha
        assert rp.scenario.device_array("acceptance")[0] == pytest.approx(ctl.alpha_topk("a", rp.topk))
    # rounds under k = 16 that accept as the ratio says leave k = 64's prior where the ratio puts it
    for _ in range(50):
        ctl.observe_acceptance("a", 1, 2, topk=16)  # 1 success of 2 trials: alpha_16 = 0.5 -> dense 1.0 (clip)
    assert ctl.alpha_dense("a") > 0.9 and ctl.alpha_topk("a", 64) > 0.75
    off = Controller(Scenario.from_dict(SC), calibrate=False)
    assert not off.calibrate_topk({"ratio": {"16": 0.5}}) and off.alpha_topk("a", 16) == pytest.approx(0.7)


def test_calibration_measures_the_pairs_top_k_acceptance_and_closes_its_sessions(micro_pair):
    verifier = BatchedVerifier(load_target(micro_pair.target_dir), device="cpu", threads=1)
    drafter = OnnxDrafter(micro_pair.draft_onnx)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(1.0, 0, 1.0)
    out = calibrate_topk_acceptance(drafter, verifier, prompts, [1, 8, 10**6], params, draft_len=4, rounds=3,
                                    seed=1)
    assert out["positions"] == 2 * 3 * 4 and not any(n.startswith(SESSION_PREFIX) for n in verifier.sessions)
    acc, ratio = out["acceptance"], out["ratio"]
    assert 0 < acc["1"] <= acc["8"] + 1e-9 and acc["1000000"] == acc["dense"]  # k >= V: the dense q
    assert ratio[10**6] == 1.0 and ratio[1] == pytest.approx(acc["1"] / acc["dense"])
    again = calibrate_topk_acceptance(OnnxDrafter(micro_pair.draft_onnx), verifier, prompts, [1, 8, 10**6],
                                      params, draft_len=4, rounds=3, seed=1)
    assert again["acceptance"] == acc  # seeded: the same drafts, the same verdicts


def test_top_k_acceptance_is_sum_min_p_q_k_row_by_row():
    q = np.array([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p = np.array([[0.2, 0.2, 0.2, 0.4], [0.7, 0.1, 0.1, 0.1]])
    got = payload.topk_acceptance(p, q, [1, 2, 4])
    # row 0: q_1 = (1,0,0,0) -> 0.2; q_2 = (.625,.375,0,0) -> 0.4; dense: .2+.2+.2 = .6
    # row 1: q_1 = (1,0,0,0) (ties: the lower index) -> 0.7; q_2 = (.5,.5,0,0) -> 0.6; dense: .25+.1*3 = .55
    assert got[None] == pytest.approx((0.6 + 0.55) / 2) and got[4] == got[None]
    assert got[1] == pytest.approx((0.2 + 0.7) / 2) and got[2] == pytest.approx((0.4 + 0.6) / 2)
    assert payload.ratios(got)[1] == pytest.approx(0.45 / 0.575)
    rng = np.random.default_rng(0)  # the same as truncating with `sampling.truncate_top_k` and summing
    from testbed.core.sampling import truncate_top_k
    p, q = rng.dirichlet(np.ones(50), 6), rng.dirichlet(np.full(50, 0.3), 6)
    assert payload.topk_acceptance(p, q, [7])[7] == pytest.approx(np.minimum(p, truncate_top_k(q, 7)).sum(1).mean())
    with pytest.raises(ValueError, match="same shape"):
        payload.topk_acceptance(p, q[:, :10], [1])
