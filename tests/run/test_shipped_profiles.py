"""Every profile that ships with the project loads under its schema (a typo in one is a user's first error)."""


import pytest

from device_node.hardware import load_hardware
from testbed import PROFILES_DIR
from testbed.run.profile import load_profile
from testbed.run.scenario_file import load_scenario

PROFILES = PROFILES_DIR


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.yaml")), ids=lambda p: p.name)
def test_run_profiles_load(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTISPIN_CACHE", str(tmp_path))  # a named pair (qwen2.5-coder) as fetched: stub files
    for rel in ("target/config.json", "draft.onnx", "tokenizer.json"):
        (tmp_path / "models" / "qwen2.5-coder" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / "qwen2.5-coder" / rel).touch()
    profile = load_profile(path)
    names = profile.device_names()
    assert names and len(set(names)) == len(names)
    for device, hardware in profile.hardware.items():
        assert device in names, f"{path.name}: hardware for unknown device {device}"
        load_hardware(hardware)


@pytest.mark.parametrize("path", sorted((PROFILES / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_scenarios_load(path):
    assert load_scenario(path).num_devices >= 1


@pytest.mark.parametrize("path", sorted((PROFILES / "hardware").glob("*.yaml")), ids=lambda p: p.name)
def test_hardware_profiles_load(path):
    assert load_hardware(str(path)).compute_scale >= 1.0


def test_a_bad_scenario_field_in_a_run_profile_is_named_at_load():
    from testbed.run.profile import ProfileError

    with pytest.raises(ProfileError) as err:
        load_profile("emulation", {"scenario.devices": [{"name": "d0", "acceptance": 1.5, "distance_m": 100,
                                                           "max_power_w": 0.2, "draft_time_s": 0.01}]})
    assert "acceptance" in str(err.value) and "1.5" in str(err.value)
