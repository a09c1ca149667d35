"""Scenario schema: loading, derived values, readable errors that name the field, rebuilding helpers."""


import pytest

from testbed import PROFILES_DIR
from testbed.core import radio
from testbed.core.scenario import Scenario, ScenarioError
from testbed.run.scenario_file import load_scenario

PROFILES = PROFILES_DIR / "scenarios"


def base(**kw):
    d = dict(devices=[dict(name="d0", channel_gain_db=-101.8, draft_time_s=0.03, acceptance=0.7),
                      dict(name="d1", distance_m=350, draft_time_s=0.05, acceptance=0.8)])
    d.update(kw)
    return d


def error_of(data) -> str:
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict(data)
    return str(exc.value)


def test_example_profile_loads_with_spec_defaults():
    sc = load_scenario(PROFILES / "example-two-devices.yaml")
    assert sc.num_devices == 2 and sc.vocab_size == 151936
    assert sc.ul_protocol == "eager" and sc.dl_protocol == "rejected_only"
    assert sc.dl_provisioning == "worst_case" and sc.payload_format == "dense"
    assert sc.verify_batch == "ragged" and sc.dl_access == "fdma_equal_split" and sc.rounds == "synchronous"
    g = sc.gains_db()
    assert g[0] == pytest.approx(-101.8)
    assert g[1] == pytest.approx(radio.gain_from_distance_db(350.0))
    # N0 = -174 dBm/Hz + 9 dB noise figure
    assert sc.noise_psd_w_hz == pytest.approx(10 ** ((-174 + 9 - 30) / 10))


def test_default_profile_has_drop_settings_of_the_spec():
    sc = load_scenario(PROFILES / "default.yaml")
    assert sc.drop is not None
    assert sc.drop.distance_m == (50, 500) and sc.drop.acceptance == (0.6, 0.85)
    assert sc.downlink_power_w == 10.0 and sc.downlink_bandwidth_hz == 2e7 and sc.uplink_bandwidth_hz == 1e6


def test_out_of_range_value_names_field_value_and_range():
    d = base()
    d["devices"][1]["acceptance"] = 1.3
    msg = error_of(d)
    assert "devices[1].acceptance: 1.3 is not allowed: must be in (0, 1)" in msg


def test_unknown_field_and_bad_option_are_named():
    msg = error_of(base(dl_acess="tdma"))
    assert "dl_acess" in msg and "unknown field" in msg
    msg = error_of(base(dl_access="ofdma"))
    assert "dl_access: 'ofdma' is not allowed" in msg and "fdma_equal_split" in msg and "tdma" in msg


def test_missing_and_conflicting_channel_fields():
    d = base()
    del d["devices"][0]["draft_time_s"]
    assert "devices[0].draft_time_s: required field is missing" in error_of(d)
    d = base()
    d["devices"][0]["distance_m"] = 100
    assert "devices[0]" in error_of(d) and "exactly one of channel_gain_db or distance_m" in error_of(d)
    d = base()
    del d["devices"][1]["distance_m"]
    assert "exactly one of" in error_of(d)


def test_negative_bandwidth_and_duplicate_names():
    assert "downlink_bandwidth_hz: -5.0 is not allowed: must be in (0, inf)" in error_of(
        base(downlink_bandwidth_hz=-5.0))
    d = base()
    d["devices"][1]["name"] = "d0"
    assert "unique" in error_of(d)


def test_yaml_errors(tmp_path):
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "nope.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ScenarioError, match="expected a mapping"):
        load_scenario(p)
    p.write_text("devices: [\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(p)


def test_with_updates_and_device_updates():
    sc = Scenario.from_dict(base())
    s2 = sc.with_updates(downlink_bandwidth_hz=1e7, dl_access="tdma")
    assert s2.downlink_bandwidth_hz == 1e7 and s2.dl_access == "tdma" and sc.downlink_bandwidth_hz == 2e7
    with pytest.raises(ScenarioError, match="verify_t0_s"):
        sc.with_updates(verify_t0_s=-1)
    s3 = sc.with_device_updates(acceptance={"d0": 1.0}, draft_time_s={"d1": 0.02},
                                channel_gain_db={"d1": -90.0})
    assert s3.devices[0].acceptance == pytest.approx(0.999)  # an all-accepted estimate is clipped
    assert s3.devices[1].draft_time_s == 0.02
    assert s3.devices[1].distance_m is None and s3.gains_db()[1] == -90.0
    with pytest.raises(ScenarioError, match="unknown device"):
        sc.with_device_updates(acceptance={"zz": 0.5})
    with pytest.raises(ScenarioError, match="acceptance"):
        sc.with_device_updates(acceptance={"d0": 1.0}, clip_acceptance=False)
    # The controller's one validation a round: the devices kept and global fields with the updates.
    s4 = sc.with_device_updates(draft_time_s={"d1": 0.03}, only={"d1"}, fields={"verify_t0_s": 0.5})
    assert [d.name for d in s4.devices] == ["d1"] and s4.devices[0].draft_time_s == 0.03
    d1 = {**sc.devices[1].model_dump(exclude_none=True), "draft_time_s": 0.03}
    assert s4.verify_t0_s == 0.5 and s4 == Scenario.from_dict({**base(), "verify_t0_s": 0.5, "devices": [d1]})
    with pytest.raises(ScenarioError, match="verify_t0_s"):
        sc.with_device_updates(fields={"verify_t0_s": -1})
