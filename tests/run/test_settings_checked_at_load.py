"""Settings checked when the profile loads (issue 29): a bad ``channel.state`` key or value, and ``topk_k``
without ``payload_format: topk``, end `run`, `compare` and `campaign` with exit status 2 and a one-line error
naming the key and the value, before any process starts or any run folder is made."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from testbed.cli import main
from testbed.run.profile import ProfileError, load_profile

RICIAN = "--set channel.state.fading=rician: 'rician' is not allowed; allowed: rayleigh, none"
TYPO = "--set channel.state.fadding=rayleigh: unknown key 'fadding' in channel.state; did you mean fading?"


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("setting, message", [("channel.state.fading=rician", RICIAN),
                                              ("channel.state.fadding=rayleigh", TYPO)])
def test_run_refuses_a_bad_channel_state_before_it_starts(tmp_path, capsys, setting, message):
    runs = tmp_path / "runs"
    assert main(["run", "--set", setting, "--runs-dir", str(runs)]) == 2
    assert _error_line(capsys) == f"multispin run: error: {message}"
    assert not runs.exists() or not any(runs.iterdir())
    assert main(["run", "--set", setting, "--print-config"]) == 2
    assert _error_line(capsys) == f"multispin run: error: {message}"


def test_compare_refuses_a_bad_channel_state(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["compare", "--set", "channel.state.fading=rician", "--runs-dir", str(runs)]) == 2
    assert _error_line(capsys) == f"multispin compare: error: {RICIAN}"
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize("sweep, message", [
    ("channel.state.fading=none,rician", "--sweep channel.state.fading=rician: 'rician' is not allowed; allowed: "
                                         "rayleigh, none"),
    ("channel.state.fadding=none,rayleigh", "--sweep channel.state.fadding=none: unknown key 'fadding' in "
                                            "channel.state; did you mean fading?"),
])
def test_campaign_checks_every_point_before_the_first_trial(tmp_path, capsys, sweep, message):
    out = tmp_path / "camp"
    assert main(["campaign", "--sweep", sweep, "--rounds", "2", "--out", str(out)]) == 2
    assert _error_line(capsys) == f"multispin campaign: error: {message}"
    assert not out.exists()


def test_a_bad_state_in_the_file_is_named_under_the_file(tmp_path):
    data = yaml.safe_load(load_profile("emulation").model_dump_json())
    data["channel"]["state"] = {"source": "model", "fading": "rician", "mobility": {"kind": "linear", "sped": 1}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}:"
    assert "  channel.state.fading: 'rician' is not allowed; allowed: rayleigh, none" in lines
    assert "  unknown key 'sped' in channel.state.mobility; did you mean speed_mps?" in lines


def test_the_shipped_states_load_and_a_sweep_of_sources_is_checked_per_point(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTISPIN_CACHE", str(tmp_path))  # the named qwen2.5-coder pair as fetched: stub files
    for rel in ("target/config.json", "draft.onnx", "tokenizer.json"):
        (tmp_path / "models" / "qwen2.5-coder" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / "qwen2.5-coder" / rel).touch()
    for name in ("emulation", "lan", "trace-replay", "qwen2.5-coder"):
        load_profile(name)
    with pytest.raises(ProfileError, match="override channel.state.source='trace': channel.state: source trace needs"):
        load_profile("emulation", {"channel.state.source": "trace"})
    assert load_profile("emulation", {"channel.state.source": "live"}).channel.state["source"] == "live"


def test_a_plug_in_source_keeps_free_form_keys(tmp_path, monkeypatch):
    (tmp_path / "myflat.py").write_text(textwrap.dedent("""
        from testbed.channel.source import LinkState
        class Flat:
            def __init__(self, cfg, devices):
                self.names, self.gain = [d["name"] for d in devices], float(cfg["flat"]["gain_db"])
            def link_states(self, round_index, t_s):
                return {n: LinkState(gain_db=self.gain) for n in self.names}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    prof = load_profile("emulation", {"channel.state": {"source": "myflat:Flat", "flat": {"gain_db": -90.0},
                                                        "fadding": "not ours to judge"}})
    assert prof.channel.state["flat"] == {"gain_db": -90.0}


def test_topk_k_without_payload_format_topk_is_refused_naming_both(capsys):
    with pytest.raises(ProfileError) as err:
        load_profile("emulation", {"scenario.topk_k": 64})
    text = str(err.value)
    assert text.startswith("override scenario.topk_k=64: scenario.topk_k: 64 is not allowed with payload_format "
                           "'dense'")
    assert "payload_format: topk" in text and "\n" not in text
    topk = load_profile("emulation", {"scenario.topk_k": 64, "scenario.payload_format": "topk"})
    assert topk.scenario["topk_k"] == 64
    assert load_profile("emulation", {"scenario.topk_choices": [16, 64]})  # the plan picks dense or a k
    assert main(["run", "--set", "scenario.topk_k=64", "--print-config"]) == 2
    assert _error_line(capsys).startswith("multispin run: error: --set scenario.topk_k=64: scenario.topk_k: 64")
