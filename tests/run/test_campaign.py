"""Live campaigns (issue 11): `multispin campaign` runs the testbed once per sweep point x policy x repeat,
writes results.csv and the goodput plot, and a second start skips the complete runs and resumes an
interrupted one.

The sweep, the device copies and the campaign identity are tested without processes; one campaign on the
micro pair (2 points x 2 policies, 2 rounds each, virtual channel) is interrupted in its second run and
resumed.
"""

from __future__ import annotations

import csv
import json

import pytest

from testbed.run.campaign import (
    CampaignError,
    device_overrides,
    open_campaign,
    parse_sweep,
    plan_campaign,
    point_label,
    point_profile,
    run_campaign,
    run_status,
)
from testbed.run.profile import load_profile

# -- the sweep ----------------------------------------------------------------------------------------------

def test_parse_sweep_reads_keys_aliases_and_yaml_values():
    s = parse_sweep("devices=2,4,8")
    assert s.key == "devices" and s.values == (2, 4, 8) and s.path is None
    s = parse_sweep("dl_bandwidth=1e6, 2e6")
    assert s.path == "scenario.downlink_bandwidth_hz" and s.values == (1e6, 2e6)
    s = parse_sweep("channel.mode=real,virtual")
    assert s.path == "channel.mode" and s.values == ("real", "virtual")
    assert point_label(parse_sweep("dl_power=0.5"), 0.5) == "dl_power=0.5"
    assert point_label(s, "real") == "channel.mode=real"


@pytest.mark.parametrize("text, message", [
    ("devices", "expected KEY=V1,V2"), ("devices=", "no values"), ("devices=0,2", "integer >= 1"),
    ("devices=2.5", "integer >= 1"), ("dl_power=abc", "not a number"), ("devices=2,2", "listed twice"),
    ("policy=a,b", "use --policies"), ("seed=1,2", "--repeats"), ("model.threads=1,2", "one model pair")])
def test_parse_sweep_refuses_what_it_cannot_run(text, message):
    with pytest.raises(CampaignError, match=message):
        parse_sweep(text)


def test_devices_takes_the_first_n_and_copies_beyond_the_list():
    base = load_profile(None)  # the default profile: dev0..dev3 with four hardware profiles
    two = point_profile(base, parse_sweep("devices=2"), 2)
    assert two.device_names() == ["dev0", "dev1"] and two.hardware == {"dev0": "edge-class", "dev1": "laptop"}
    eight = point_profile(base, parse_sweep("devices=8"), 8)
    assert eight.device_names() == [f"dev{i}" for i in range(8)]
    devs = eight.scenario["devices"]
    assert [d["distance_m"] for d in devs[4:]] == [d["distance_m"] for d in devs[:4]]
    assert eight.hardware["dev6"] == "phone" and eight.hardware["dev7"] == "phone-slow"
    # Names that are not prefix + 0..m-1 get a copy suffix.
    data = {"scenario": {"devices": [{"name": "a"}, {"name": "b"}]}, "hardware": {"b": "phone"}}
    ov = device_overrides(data, 5, "--sweep devices=5")
    assert [d["name"] for d in ov[0].value] == ["a", "b", "a-1", "b-1", "a-2"]
    assert ov[1].key == "hardware" and ov[1].value == {"b": "phone", "b-1": "phone"}


def test_a_bad_point_or_key_names_the_sweep():
    base = load_profile(None)
    with pytest.raises(CampaignError, match=r"--sweep dl_power=-1: must be in \(0, inf\)"):
        point_profile(base, parse_sweep("dl_power=-1"), -1)
    with pytest.raises(CampaignError, match=r"--sweep deadline: unknown key 'deadline'.*did you mean deadline_s"):
        plan_campaign("x", base, parse_sweep("deadline=1,2"), ["proposed"], 1)


def test_plan_shares_seeds_across_policies_and_points(tmp_path):
    base = load_profile(None, {"seed": 5})
    camp = plan_campaign(tmp_path / "c", base, parse_sweep("devices=2,4"), ["proposed", "all-dl"], 2)
    assert len(camp.runs) == 8
    assert [(r.label, r.policy, r.repeat) for r in camp.runs[:4]] == [
        ("devices=2", "proposed", 0), ("devices=2", "all-dl", 0), ("devices=2", "proposed", 1),
        ("devices=2", "all-dl", 1)]
    for r in camp.runs:
        assert r.profile.seed == 5 + r.repeat and r.profile.policy == r.policy
        assert r.run_dir == tmp_path / "c" / r.label / f"{r.policy}-rep{r.repeat}"


def test_a_folder_of_another_campaign_is_refused(tmp_path):
    base = load_profile(None)
    camp = plan_campaign(tmp_path / "c", base, parse_sweep("devices=2,4"), ["proposed"], 1)
    assert open_campaign(camp) == 0 and (tmp_path / "c" / "campaign.json").is_file()
    assert open_campaign(camp) == 0  # the same campaign: resumed
    other = plan_campaign(tmp_path / "c", base, parse_sweep("devices=2,8"), ["proposed"], 1)
    with pytest.raises(CampaignError, match=r"holds another campaign \(sweep: .*\[2, 4\].*\[2, 8\]"):
        open_campaign(other)
    rounds = plan_campaign(tmp_path / "c", load_profile(None, {"rounds": 3}), parse_sweep("devices=2,4"),
                           ["proposed"], 1)
    with pytest.raises(CampaignError, match="profile fields rounds differ"):
        open_campaign(rounds)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("")
    with pytest.raises(CampaignError, match="not empty and not a campaign folder"):
        open_campaign(camp.moved(tmp_path / "d"))


def test_cli_refuses_a_bad_sweep_before_anything_runs(tmp_path, capsys):
    from testbed.cli import main

    assert main(["campaign", "--sweep", "devices=0", "--out", str(tmp_path / "c")]) == 2
    assert "integer >= 1" in capsys.readouterr().err and not (tmp_path / "c").exists()


# -- live: interrupted and resumed --------------------------------------------------------------------------

def _micro_base(pair):
    return load_profile({
        "name": "micro-campaign", "rounds": 2, "seed": 3, "deadline_s": 5.0,
        "prompts": ["def parse(text):", "import os"],
        "model": {"pair": "local", "target": str(pair.target_dir), "draft_onnx": str(pair.draft_onnx),
                  "tokenizer": str(pair.tokenizer), "threads": 1},
        "channel": {"mode": "virtual"}, "on_air_vocab_size": 4096, "wait_for_devices_s": 60,
        "hardware": {"d0": "phone", "d1": "laptop"},
        "scenario": {"bits_per_prob": 16, "max_draft_len": 6, "uplink_bandwidth_hz": 2e5,
                     "downlink_bandwidth_hz": 1e6, "downlink_power_w": 1.0,
                     "devices": [{"name": "d0", "distance_m": 100, "draft_time_s": 0.001, "acceptance": 0.6},
                                 {"name": "d1", "distance_m": 250, "draft_time_s": 0.001, "acceptance": 0.6}]}})


def test_campaign_writes_csv_and_plot_and_resumes_where_it_stopped(micro_pair, tmp_path):
    from testbed.run.launcher import resolve_pair

    base = _micro_base(micro_pair)
    pair = resolve_pair(base, progress=False)
    out = tmp_path / "camp"

    def plan():
        return plan_campaign(out, base, parse_sweep("devices=1,2"), ["all-ul", "all-dl"], 1)

    seen = []

    def stop_in_second_run(rec, run):
        seen.append((run.label, run.policy, rec["round"]))
        if (run.label, run.policy) == ("devices=1", "all-dl"):
            raise KeyboardInterrupt  # as Ctrl-C after the second run's first round

    with pytest.raises(KeyboardInterrupt):
        run_campaign(plan(), pair, plots=False, progress=False, on_round=stop_in_second_run, echo=lambda s: None)
    first, second = out / "devices=1" / "all-ul", out / "devices=1" / "all-dl"
    assert run_status(first) == "complete" and run_status(second) == "interrupted"
    assert not (out / "devices=2").exists()
    with open(out / "results.csv") as f:
        assert [r["policy"] for r in csv.DictReader(f)] == ["all-ul"]  # written as far as it got
    kept = {p: (first / p).read_bytes() for p in ("meta.json", "rounds.jsonl", "summary.json")}

    seen.clear()
    printed = []
    rows = run_campaign(plan(), pair, plots=True, progress=False, on_round=lambda rec, run: seen.append(
        (run.label, run.policy, rec["round"])), echo=printed.append)
    # The complete run was not run again; the interrupted one went on from its next round.
    assert {p: (first / p).read_bytes() for p in kept} == kept
    assert ("devices=1", "all-ul") not in {(a, b) for a, b, _ in seen}
    assert [r for a, b, r in seen if (a, b) == ("devices=1", "all-dl")] == [1]
    meta = json.loads((second / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["resumed"][0]["from_round"] == 1
    assert len((second / "rounds.jsonl").read_text().splitlines()) == 2

    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [(r["value"], r["policy"], r["status"]) for r in table] == [
        ("1", "all-ul", "complete"), ("1", "all-dl", "complete"), ("2", "all-ul", "complete"),
        ("2", "all-dl", "complete")]
    assert len(rows) == 4
    for r, row in zip(table, rows):
        summary = json.loads((out / r["run"] / "summary.json").read_text())
        assert float(r["measured_goodput_tps"]) == pytest.approx(summary["goodput_run_tps"]["measured"])
        assert float(r["predicted_goodput_tps"]) == pytest.approx(summary["goodput_run_tps"]["predicted"])
        assert float(r["measured_tokens_per_j"]) == pytest.approx(summary["energy"]["run"]["tokens_per_j"])
        assert r["ul_share"] == ("1.0" if r["policy"] == "all-ul" else "0.0")
        assert row["seed"] == 3
    assert (out / "plots" / "goodput.png").stat().st_size > 1000
    assert (out / "plots" / "tokens_per_j.png").is_file()
    assert json.loads((out / "devices=2" / "compare.json").read_text())["policies"] == ["all-ul", "all-dl"]
    text = (out / "summary.txt").read_text()
    assert "devices=1: measured/predicted tok/s" in text and "predicted order:" in text and printed

    seen.clear()  # a third start: every run is complete, nothing runs
    again = run_campaign(plan(), pair, plots=False, progress=False, on_round=lambda rec, run: seen.append(1),
                         echo=lambda s: None)
    assert seen == [] and [r["measured_goodput_tps"] for r in again] == [r["measured_goodput_tps"] for r in rows]


def test_a_campaign_in_the_live_view_shows_each_run_under_its_own_title(micro_pair, tmp_path, capsys):
    import yaml

    from testbed.cli import main

    base = _micro_base(micro_pair)
    profile = tmp_path / "micro.yaml"
    profile.write_text(yaml.safe_dump(base.snapshot()))
    out = tmp_path / "camp"
    rc = main(["campaign", str(profile), "--sweep", "devices=1", "--policies", "all-ul,all-dl", "--rounds", "2",
               "--out", str(out), "--no-plots", "--live-view"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    # The view's last frame: the second run, counted from its own first round
    assert "campaign devices=1 all-dl" in printed and "round 1/2" in printed
    with open(out / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["complete", "complete"]
