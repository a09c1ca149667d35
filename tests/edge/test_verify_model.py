"""The edge's verification model on real rounds: batch sizes too close to tell a slope keep the calibrated
slope and move only the intercept; a round that prefills new sessions' prompts is predicted with them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_node.controller import Controller, round_record
from edge_node.verifier import BatchedVerifier, load_target
from testbed.run.scenario_file import load_scenario

SCEN = {"bits_per_prob": 16, "max_draft_len": 6, "vocab_size": 1000, "verify_t0_s": 2.0, "verify_t1_s": 0.13,
        "devices": [{"name": "a", "distance_m": 100, "acceptance": 0.7, "draft_time_s": 0.3},
                    {"name": "b", "distance_m": 200, "acceptance": 0.7, "draft_time_s": 0.3}]}


def test_close_batch_sizes_move_the_intercept_and_keep_the_calibrated_slope():
    """Rounds of 5 and 6 positions (less than 1.5x apart) with +-0.4 s of host noise: a least-squares line
    through them is noise (on the Qwen pair it once came out t1 = 1.13 s/position, t0 = 0)."""
    c = Controller(load_scenario(SCEN), fit_verify_after=5)
    c.calibrate, _ = True, c.calibrate_verify({"verify_t0_s": 2.13, "verify_t1_s": 0.13})
    rng = np.random.default_rng(0)
    for _ in range(12):
        n = int(rng.integers(5, 7))
        c.observe_verify(n, 3.5 + 0.13 * n + float(rng.normal(0, 0.4)))
    assert c.verify_from == "intercept" and c.t1 == 0.13
    assert c.t0 == pytest.approx(3.5, abs=0.4)


def test_two_batch_sizes_apart_fit_the_local_slope_after_three_rounds():
    """The Qwen pair on a CPU: calibrated t1 = 0.045 s/position, the rounds' own 4 and 6 positions cost 0.93 and
    1.33 s (0.2 s a position there). Three rounds on, the line goes through them, not along the calibrated
    slope: a round of 6 positions is then predicted 1.33 s, not 1.03 s."""
    c = Controller(load_scenario(SCEN))
    c.calibrate, _ = True, c.calibrate_verify({"verify_t0_s": 0.488, "verify_t1_s": 0.045})
    for n, v in ((4, 0.93), (4, 0.93), (6, 1.33)):
        c.observe_verify(n, v)
    assert c.verify_from == "fit"
    assert c.t0 + c.t1 * 6 == pytest.approx(1.33) and c.t1 == pytest.approx(0.2)


def test_a_wide_spread_of_batch_sizes_fits_both_terms():
    c = Controller(load_scenario(SCEN), fit_verify_after=3)
    for n in (2, 6, 12, 12):
        c.observe_verify(n, 0.5 + 0.2 * n)
    assert c.verify_from == "fit" and (c.t0, c.t1) == (pytest.approx(0.5), pytest.approx(0.2))


def test_a_round_that_prefills_prompts_is_predicted_with_them_and_records_the_models_t0():
    c = Controller(load_scenario(SCEN), pin_mode="DL", pin_draft_len=2)
    plain = c.plan_round(1, ["a", "b"])
    c.prefill_positions = 13
    joining = c.plan_round(0, ["a", "b"])
    extra = joining.plan["phases_s"]["verify"] - plain.plan["phases_s"]["verify"]
    assert extra == pytest.approx(0.13 * 13)
    rec = round_record(joining, policy="pinned", outcomes={}, verify_s=None, round_s=1.0,
                       t_start_s=0.0)
    assert rec["verify_model"] == {"t0_s": pytest.approx(2.0), "t1_s": 0.13, "prefill_positions": 13}


def test_a_round_that_prefilled_prompts_is_left_out_of_the_fit():
    c = Controller(load_scenario(SCEN), fit_verify_after=3)
    c.observe_verify(6, 1.29, prefill_positions=13)  # cheap prompt positions: 19 in all, faster than 9 drafts
    for n in (4, 8, 12):
        c.observe_verify(n, 0.4 + 0.12 * n)
    assert c.verify_from == "fit" and (c.t0, c.t1) == (pytest.approx(0.4), pytest.approx(0.12))


def test_the_verifier_counts_a_new_sessions_prompt_until_its_first_verify(micro_pair):
    torch.set_num_threads(1)
    v = BatchedVerifier(load_target(micro_pair.target_dir, device="cpu"), "cpu")
    v.open("s", [5, 6, 7, 8, 9])
    assert v.extra_positions("s") == 4 and v.extra_positions("unknown") == 0
    v.verify([("s", [], [10, 11])])
    v.commit("s", 1)
    assert v.extra_positions("s") == 0  # between rounds only the last committed token waits for the cache
