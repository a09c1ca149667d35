"""Every prediction says what it rests on (issue 29, item 3): summary.json's `prediction_basis` (rates, timings,
acceptance) derived from the round records, and no predicted goodput, no measured / predicted ratio, where
the model had no basis (a passthrough link the edge did not measure). Old run directories still report.

Records are real round records (edge_node.controller.round_record) of a controller in the state each case
needs, not a live run."""

from __future__ import annotations

from support import SCEN, synth_records

from edge_node.controller import Controller, DeviceOutcome, round_record
from testbed.analysis import phases, report
from testbed.run.scenario_file import load_scenario


def _records(n: int, *, channel_mode: str = "real", measured_links: bool = False, learn_from: int | None = None,
             slow: float = 1.5) -> list[dict]:
    """n rounds of two devices a, b. passthrough: no emulator annotation (the edge's own byte counts);
    `measured_links`: the edge measured both links of both devices (`channel.measure_links`); `learn_from`:
    from that round on the controller observes drafting times and acceptance (its estimates move)."""
    c = Controller(load_scenario({**SCEN, "vocab_size": 1000}))
    if measured_links:
        for name in ("a", "b"):
            c.measured_rates[name] = {"ul": 5e6, "dl": 2e7}
            c.measured_sources[name] = {"ul": "probe", "dl": "rounds"}
    recs = []
    for r in range(n):
        if learn_from is not None and r >= learn_from:
            for name in ("a", "b"):
                c.observe_draft_time(name, 0.05, 2)
                c.observe_acceptance(name, 1, 2)
        rp = c.plan_round(r, ["a", "b"])
        outcomes = {}
        for name in ("a", "b"):
            d = rp.per_device[name]
            emulated = channel_mode != "passthrough"
            outcomes[name] = DeviceOutcome(
                n_accepted=1, tokens=2, dl_payload="p", ul_bytes=10, dl_bytes=10, up_phase_s=d.uplink_s * 1.1,
                t_verdict=0.0, timings={"draft_s": d.draft_s * 1.1},
                ul_channel={"mode": "real", "held_s": d.tx_s, "bytes": 10} if emulated else None,
                dl_channel={"mode": "real", "held_s": d.downlink_s, "bytes": 10} if emulated else None)
        recs.append(round_record(rp, policy="proposed", outcomes=outcomes, verify_s=rp.plan["phases_s"]["verify"],
                                 round_s=rp.plan["round_time_s"] * slow, t_start_s=float(r),
                                 extra={"channel_mode": channel_mode}))
    return recs


def test_passthrough_without_link_measurement_has_no_predicted_goodput_and_says_why():
    s = report.summarize(_records(4, channel_mode="passthrough"))
    basis = s["prediction_basis"]
    assert basis["rates"] == "none" and basis["rounds"]["rates"] == {"none": 4}
    assert basis["no_prediction"] == "passthrough link not measured; set channel.measure_links: true"
    assert s["goodput_run_tps"]["predicted"] is None and s["goodput_mean_round_tps"]["predicted"] is None
    assert s["goodput_predicted_tps"] is None and s["mean_round_goodput_predicted_tps"] is None
    assert s["goodput_run_tps"]["measured"] > 0
    # The phases with air time in their prediction are not compared; drafting and verification still are.
    for phase in phases.RATE_PHASES:
        assert s["phase_errors"][phase] is None, phase
    assert s["phase_errors"]["verify_s"]["n"] == 4 and s["phase_errors"]["draft_s"]["n"] == 8
    text = report.format_summary(s)
    assert "no prediction: passthrough link not measured; set channel.measure_links: true" in text
    assert "ratio" not in text.splitlines()[1]
    assert "prediction basis: rates none;" in text


def test_measured_link_is_a_basis():
    s = report.summarize(_records(3, channel_mode="passthrough", measured_links=True))
    assert s["prediction_basis"]["rates"] == "measured link"
    assert "no_prediction" not in s["prediction_basis"]
    assert s["goodput_run_tps"]["predicted"] > 0
    assert s["phase_errors"]["round_s"]["n"] == 3
    # A device whose DL-mode link direction is still the model's ("model": no estimate yet) has no basis.
    recs = _records(2, channel_mode="passthrough", measured_links=True)
    for d in recs[0]["devices"].values():
        d["mode"], d["link_rate_source"] = "DL", {"ul": "probe", "dl": "model"}
    s = report.summarize(recs)
    assert s["prediction_basis"]["rounds"]["rates"] == {"none": 1, "measured link": 1}
    assert s["goodput_run_tps"]["predicted"] is not None  # one round had a basis
    assert s["phase_errors"]["round_s"]["n"] == 1
    assert "1 round(s) planned a passthrough link the edge had not yet measured" in report.format_summary(s)


def test_emulated_rates_are_the_model_and_a_rate_trace_is_a_trace():
    s = report.summarize(_records(3))
    assert s["prediction_basis"]["rates"] == "model"
    recs = _records(3)
    recs[1]["devices"]["a"]["trace_rate_bps"] = {"ul": 1e6, "dl": None}
    s = report.summarize(recs)
    assert s["prediction_basis"]["rounds"]["rates"] == {"model": 2, "trace": 1}
    assert s["prediction_basis"]["rates"] == "model"  # the basis of most rounds


def test_timings_and_acceptance_prior_until_the_controller_learns():
    s = report.summarize(_records(4))
    b = s["prediction_basis"]
    assert (b["timings"], b["acceptance"]) == ("prior", "prior")
    assert b["rounds"]["timings"] == {"prior": 4} and b["rounds"]["acceptance"] == {"prior": 4}
    # The controller skips a device's first timed draft (prefill), so the drafting time moves a round after
    # alpha does.
    b = report.summarize(_records(5, learn_from=1))["prediction_basis"]
    assert b["rounds"]["acceptance"] == {"prior": 1, "estimated": 4}
    assert b["rounds"]["timings"] == {"prior": 2, "measured": 3}
    assert (b["timings"], b["acceptance"]) == ("measured", "estimated")
    text = report.format_summary(report.summarize(_records(5, learn_from=1)))
    assert "timings measured (rounds: 3 measured, 2 prior)" in text


def test_old_records_without_channel_mode_or_estimates_still_report():
    recs = synth_records(3)  # no channel_mode, as in records of earlier releases
    for r in recs:
        r.pop("channel_mode", None)
        for d in r["devices"].values():
            d.pop("estimate", None)
    s = report.summarize(recs)
    assert s["prediction_basis"]["rates"] == "model" and s["prediction_basis"]["acceptance"] is None
    assert s["goodput_run_tps"]["predicted"] > 0
    text = report.format_summary(s)
    assert "acceptance unknown" in text and "ratio" in text


def test_asynchronous_passthrough_without_measurement_has_no_predicted_goodput():
    recs = _records(2, channel_mode="passthrough")
    for r in recs:
        r.update(rounds="asynchronous", device="a")
    s = report.summarize(recs)
    assert s["asynchronous"]["goodput_sum_tps"]["predicted"] is None
    assert s["asynchronous"]["devices"]["a"]["goodput_tps"]["predicted"] is None
    assert s["goodput_run_tps"]["predicted"] is None
    assert "no prediction" in report.format_summary(s)
