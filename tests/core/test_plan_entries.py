"""One definition each: the DL bandwidth split (model, optimizer, channel emulator) and a plan's device entries
(optimizer plans and the controller's pinned schedules)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edge_node.controller import Controller
from testbed.core import model
from testbed.core.optimizer import DevicePlan, Scorer, plan
from testbed.core.scenario import Scenario

DEVICES = [{"name": f"d{i}", "distance_m": 100.0 + 120 * i, "draft_time_s": 0.02, "acceptance": 0.7}
           for i in range(3)]


@pytest.mark.parametrize("access, expected", [
    ("fdma_equal_split", [20e6, 20e6, 10e6, 20e6 / 3]),  # B / |D|; an empty set counts as one
    ("fdma_fixed_split", [20e6 / 3] * 4),                # B / N whatever the DL set
    ("tdma", [20e6] * 4),                                # the whole band, one device at a time
])
def test_dl_bandwidth_split_golden(access, expected):
    w = model.dl_bandwidth_split(access, 20e6, np.array([0, 1, 2, 3]), 3)
    assert w.tolist() == expected
    assert float(model.dl_bandwidth_split(access, 20e6, 2, 3)) == expected[2]  # scalars too
    sc = Scenario.from_dict({"devices": DEVICES, "dl_access": access, "downlink_bandwidth_hz": 20e6})
    assert model.dl_bandwidth_per_device(sc, 2) == expected[2] and model.dl_bandwidth_per_device(sc, 0) == 0.0
    assert Scorer(sc)._bandwidth(np.array([0, 1, 2, 3])).tolist() == expected
    with pytest.raises(ValueError, match="dl_access"):
        model.dl_bandwidth_split("ofdma", 20e6, 1, 3)


def test_pinned_and_planned_entries_are_the_same_devices_entries():
    sc = Scenario.from_dict({"devices": DEVICES})
    planned = plan(sc)
    entries = planned.device_plans()
    assert [d.name for d in entries] == ["d0", "d1", "d2"]
    assert planned.to_dict()["devices"] == [dataclasses.asdict(d) for d in entries]
    # A pinned schedule goes through the same entries: same keys, the model's numbers for it.
    rp = Controller(sc, pin_mode="UL", pin_draft_len=3).plan_round(0, ["d0", "d1", "d2"])
    assert rp.plan["policy"] == "pinned"
    assert list(rp.plan["devices"][0]) == [f.name for f in dataclasses.fields(DevicePlan)]
    ev = model.evaluate(rp.scenario, ["UL"] * 3, [3] * 3)
    assert all(isinstance(d, DevicePlan) and d.mode == "UL" and d.draft_len == 3 for d in rp.per_device.values())
    assert [rp.per_device[n].goodput_tps for n in ("d0", "d1", "d2")] == ev.goodput.tolist()
    assert rp.plan["round_time_s"] == ev.round_time_s
    # Only the mode pinned: the optimizer's lengths, capped at the profile's L_max.
    half = Controller(sc, pin_mode="DL").plan_round(0, ["d0", "d1", "d2"])
    assert half.plan["policy"] == "proposed+pinned" and {d.mode for d in half.per_device.values()} == {"DL"}


def test_an_infeasible_policy_falls_back_for_the_round(caplog):
    """A budget that only a DL-mode upload fits: all-ul finds nothing feasible, the controller plans the round
    with the fallback policy and says why; a budget nothing fits stops the run with a clear error."""
    from edge_node.controller import FALLBACK_POLICY, Controller
    from testbed.runtime.errors import TestbedError

    devs = [dict(name="a", distance_m=300, draft_time_s=0.02, acceptance=0.7, energy_budget_j=1e-6),
            dict(name="b", distance_m=100, draft_time_s=0.02, acceptance=0.7)]
    ctl = Controller(Scenario.from_dict(dict(devices=devs)), policy="all-ul")
    with caplog.at_level("WARNING", logger="multispin.controller"):
        rp = ctl.plan_round(0, ["a", "b"])
    assert rp.plan["policy"] == FALLBACK_POLICY and rp.per_device["a"].mode == "DL"
    assert "planning this round with all-dl" in caplog.text
    devs[0]["energy_budget_j"] = 1e-12
    ctl = Controller(Scenario.from_dict(dict(devices=devs)), policy="all-ul")
    with pytest.raises(TestbedError, match="no feasible schedule"):
        ctl.plan_round(0, ["a", "b"])
