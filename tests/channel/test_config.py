"""The schema of ``channel.state`` (testbed/channel/config.py): every key the built-in sources read, typed and
bounded; an unknown key is named with the nearest valid one, a bad value with what is allowed; a plug-in
source keeps its own keys. The shipped profiles and the docs' examples validate, and the docs' key table is
the schema's."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed import PROFILES_DIR
from testbed.channel.config import (
    ChannelConfigError,
    ChannelStateSettings,
    PathLossLaw,
    check_state,
    keys_markdown,
)
from testbed.channel.state import FADING, LIVE_FALLBACK, MOBILITY, SOURCES, TRACE_INDEX, ChannelState
from testbed.core import radio

ROOT = Path(__file__).resolve().parents[2]
DEVICES = [{"name": "d0", "distance_m": 80.0}, {"name": "d1", "distance_m": 300.0}]


def _problems(cfg) -> list[tuple[tuple, str]]:
    with pytest.raises(ChannelConfigError) as err:
        check_state(cfg)
    return err.value.problems


@pytest.mark.parametrize("cfg, loc, fragment", [
    ({"fadding": "rayleigh"}, ("fadding",), "unknown key 'fadding' in channel.state; did you mean fading?"),
    ({"fading": "rician"}, ("fading",), "channel.state.fading: 'rician' is not allowed; allowed: rayleigh, none"),
    ({"path_loss_law": "3gpp"}, ("path_loss_law",), "allowed: 3gpp_macro, free_space_2ghz"),
    ({"shadowing_sigma_db": -2}, ("shadowing_sigma_db",), "channel.state.shadowing_sigma_db: -2 is not allowed; "
                                                          "must be >= 0"),
    ({"seed": -1}, ("seed",), "channel.state.seed: -1 is not allowed; must be >= 0"),
    ({"noise_figure_db": float("nan")}, ("noise_figure_db",), "channel.state.noise_figure_db: nan is not allowed"),
    ({"mobility": {"knd": "linear"}}, ("mobility", "knd"), "unknown key 'knd' in channel.state.mobility; did you "
                                                           "mean kind?"),
    ({"mobility": {"kind": "walk"}}, ("mobility", "kind"), "allowed: none, linear, random_waypoint"),
    ({"mobility": {"speed_mps": -1}}, ("mobility", "speed_mps"), "must be >= 0"),
    ({"mobility": {"min_distance_m": 600}}, ("mobility",), "min_distance_m 600 is not allowed; must be < the cell "
                                                           "radius 500 m"),
    ({"cell_radius_m": 5}, ("mobility",), "must be < the cell radius 5 m"),
    ({"snr_reference": {"power_dbm": 23, "bandwidth": 1e6}}, ("snr_reference", "bandwidth"),
     "did you mean bandwidth_hz?"),
    ({"snr_reference": {"bandwidth_hz": 0}}, ("snr_reference", "bandwidth_hz"), "must be > 0"),
    ({"source": "live", "live": {"fallback": "guess"}}, ("live", "fallback"), "allowed: model, last, drop"),
    ({"source": "live", "live": {"max_age_s": 0}}, ("live", "max_age_s"), "must be > 0"),
    ({"source": "live", "live": {"max_age": 3}}, ("live", "max_age"), "did you mean max_age_s?"),
    ({"source": "trace"}, (), "channel.state: source trace needs trace.path"),
    ({"source": "trace", "trace": {"devices": {}}}, (), "source trace needs trace.path"),
    ({"source": "trace", "trace": {"path": "a.csv", "index": "sample"}}, ("trace", "index"), "allowed: time, round"),
    ({"source": "trace", "trace": {"path": "a.csv", "loop": "yes"}}, ("trace", "loop"), "'yes' is not allowed"),
    ({"source": "trace", "trace": {"path": "a.csv", "min_rate_bps": 0}}, ("trace", "min_rate_bps"), "must be > 0"),
    ({"source": "trace", "trace": {"pth": "a.csv"}}, ("trace", "pth"), "unknown key 'pth' in channel.state.trace; "
                                                                       "did you mean path?"),
    ({"source": "trace", "trace": {"devices": {"d0": {"up": "x.up"}}}}, ("trace", "devices", "d0", "up"),
     "unknown key 'up' in channel.state.trace.devices.d0 (keys: snr, ul, dl)"),
    ({"source": "trace", "trace": {"devices": {"d0": {"ul": {"path": "x", "fromat": "ucc"}}}}},
     ("trace", "devices", "d0", "ul", "fromat"), "did you mean format?"),
    ({"source": "trace", "trace": {"devices": {"d0": {"ul": {"path": "x", "format": "pcap"}}}}},
     ("trace", "devices", "d0", "ul", "format"), "allowed: snr_csv, throughput_csv, mahimahi, ucc, lumos5g"),
    ({"source": "trace", "trace": {"devices": {"d0": {"ul": {"format": "ucc"}}}}},
     ("trace", "devices", "d0", "ul", "path"), "channel.state.trace.devices.d0.ul.path: required key is missing"),
    ({"source": "trace", "trace": {"devices": {"*": {"dl": {"path": "x", "scale": -1}}}}},
     ("trace", "devices", "*", "dl", "scale"), "must be > 0"),
    ({"source": "trace", "trace": {"devices": {"d0": {"snr": {"path": "x", "scale": 2}}}}},
     ("trace", "devices", "d0", "snr", "scale"), "a scale applies to a rate trace"),
    ({"source": 3}, ("source",), "channel.state.source: 3 is not allowed; must be the name of a source"),
    ("rayleigh", (), "channel.state: 'rayleigh' is not allowed; must be a mapping"),
])
def test_each_wrong_key_or_value_is_named(cfg, loc, fragment):
    problems = _problems(cfg)
    assert any(p_loc == loc and fragment in line for p_loc, line in problems), problems
    assert all("\n" not in line for _, line in problems)


def test_every_problem_is_listed_each_on_its_line():
    problems = _problems({"fading": "rician", "seed": -1, "fadding": 1})
    assert sorted(loc for loc, _ in problems) == [("fadding",), ("fading",), ("seed",)]
    err = ChannelConfigError(problems)
    assert str(err).count("\n") == 2


def test_a_plug_in_source_keeps_its_own_keys():
    assert check_state({"source": "ge_threshold.channels:GilbertElliott", "gilbert_elliott": {"p": 0.2},
                        "fadding": "whatever"}) is None
    assert check_state({"source": "gilbert-elliott", "seed": "any"}) is None
    assert check_state(None) is None


def test_the_allowed_values_are_the_sources_own():
    fields = ChannelStateSettings.model_fields
    assert typing.get_args(fields["source"].annotation) == tuple(SOURCES)
    assert typing.get_args(fields["fading"].annotation) == FADING
    mob = typing.get_args(fields["mobility"].annotation)[0]
    assert typing.get_args(mob.model_fields["kind"].annotation) == MOBILITY
    for law in typing.get_args(PathLossLaw):
        assert radio.path_loss_db(100.0, law) > 0
    for value, key in ((FADING, "fading"), (MOBILITY, "mobility.kind"), (LIVE_FALLBACK, "live.fallback"),
                       (TRACE_INDEX, "trace.index")):
        assert key in keys_markdown() and all(v in keys_markdown() for v in value)


def test_every_key_the_model_source_reads_validates_and_builds():
    cfg = {"source": "model", "seed": 3, "path_loss_law": "free_space_2ghz", "shadowing_sigma_db": 4.0,
           "fading": "none", "mobility": {"kind": "linear", "speed_mps": 2.0, "min_distance_m": 20.0,
                                          "cell_radius_m": 400.0},
           "cell_radius_m": 450.0, "noise_psd_dbm_hz": -170.0, "noise_figure_db": 7.0,
           "snr_reference": {"power_dbm": 20.0, "bandwidth_hz": 2e6},
           "live": {"max_age_s": 2.0, "fallback": "last"}, "trace": {"index": "round"}}
    assert check_state(cfg).mobility.kind == "linear"
    assert set(ChannelState.from_config(cfg, DEVICES).gains_db(0, 1.0)) == {"d0", "d1"}


def _shipped_states():
    for path in sorted(PROFILES_DIR.glob("*.yaml")):
        state = (yaml.safe_load(path.read_text()).get("channel") or {}).get("state")
        if state is not None:
            yield pytest.param(state, id=path.name)


@pytest.mark.parametrize("state", list(_shipped_states()))
def test_every_shipped_profiles_state_validates(state):
    assert check_state(state).source in SOURCES


def _doc_states():
    """channel.state of every YAML example in the docs that has one."""
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S)):
            try:
                data = yaml.safe_load(block)
            except yaml.YAMLError:
                continue
            state = ((data or {}).get("channel") or {}).get("state") if isinstance(data, dict) else None
            if state is not None:
                yield pytest.param(state, id=f"{doc.name}-{i}")


def test_the_docs_have_state_examples():
    assert len(list(_doc_states())) >= 3


@pytest.mark.parametrize("state", list(_doc_states()))
def test_every_docs_example_validates(state):
    check_state(state)  # a plug-in's example (docs/extending.md) checks its source only


def test_the_docs_key_table_is_the_schemas():
    text = (ROOT / "docs" / "real-links.md").read_text()
    table = text.split("<!-- channel-state-keys: begin -->\n", 1)[1].split("<!-- channel-state-keys: end -->")[0]
    assert table.strip() == keys_markdown().strip(), "regenerate with testbed.channel.config.keys_markdown()"


# -- properties ---------------------------------------------------------------------------------------------

KNOWN = set(ChannelStateSettings.model_fields)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True).filter(lambda k: k not in KNOWN))
def test_any_unknown_key_is_refused_by_name(key):
    problems = _problems({"source": "model", key: 1})
    assert problems == [((key,), problems[0][1])] and f"unknown key {key!r} in channel.state" in problems[0][1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fading=st.sampled_from(FADING), kind=st.sampled_from(MOBILITY),
       law=st.sampled_from(typing.get_args(PathLossLaw)), sigma=st.floats(0, 20), speed=st.floats(0, 30),
       rmin=st.floats(1, 100), extra=st.floats(1, 1000),
       seed=st.integers(0, 2**31))
def test_what_the_schema_accepts_the_model_source_builds(fading, kind, law, sigma, speed, rmin, extra, seed):
    cfg = {"source": "model", "seed": seed, "fading": fading, "path_loss_law": law, "shadowing_sigma_db": sigma,
           "mobility": {"kind": kind, "speed_mps": speed, "min_distance_m": rmin, "cell_radius_m": rmin + extra}}
    check_state(cfg)
    gains = ChannelState.from_config(cfg, DEVICES).gains_db(2, 5.0)
    assert set(gains) == {"d0", "d1"}


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=12).filter(lambda v: v not in FADING))
def test_a_fading_the_source_refuses_the_schema_refuses_first(value):
    assert _problems({"fading": value})[0][0] == ("fading",)
    with pytest.raises(ValueError):
        ChannelState.from_config({"fading": value}, DEVICES)
