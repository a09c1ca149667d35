"""The check's rows from a host's report, and the NTP-style clock arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.fleet.check import clock_row, drafter_row, endpoint_rows, key_row, project_rows, render
from testbed.fleet.clock import ClockSample, best, offset_of
from testbed.fleet.layout import Local
from testbed.fleet.schema import parse_fleet

FLEET = parse_fleet({"edge": "tcp://10.0.0.1:5555", "emulator": "tcp://10.0.0.1:5600", "keys": "keys",
                     "hosts": [{"name": "h1", "address": "10.0.0.2", "devices": ["dev0"]}]})
HOST = FLEET.hosts[0]
LOCAL = Local("0.1.0", 1, drafter=Path("draft.onnx"), drafter_sha="a" * 64,
              keys_dir=Path("keys"), server_public="S",
              authorized={"K0": "dev0", "K1": "dev1"})


def report(**over) -> dict:
    base = {"dir": "/home/pi/multispin-fleet", "files": {"draft.onnx": "a" * 64},
            "keys": {"dev0": {"client": {"public": "K0", "name": "dev0", "secret": True},
                              "server": {"public": "S", "name": None, "secret": False}}},
            "endpoints": {"edge": {"connect_s": [0.001, 0.002, 0.0015], "error": None},
                          "emulator": {"connect_s": [], "error": "Connection refused"}}}
    return {**base, **over}


@given(st.floats(-5, 5), st.floats(0, 0.5), st.floats(0, 0.5), st.floats(0, 1e9))
def test_the_offset_is_within_half_the_round_trip_whatever_the_asymmetry(theta, out_s, back_s, t0):
    s = offset_of(t0, t0 + out_s + theta, t0 + out_s + back_s)  # the host answers after `out_s`, on its clock
    assert s.rtt_s == pytest.approx(out_s + back_s, abs=1e-6)
    assert abs(s.offset_s - theta) <= s.uncertainty_s + 1e-6


def test_the_least_round_trip_sample_is_kept():
    samples = [ClockSample(0.5, 0.2, 0.1), ClockSample(0.01, 0.002, 0.001), ClockSample(-0.3, 0.05, 0.025)]
    assert best(samples).offset_s == 0.01
    with pytest.raises(ValueError):
        best([])


def test_a_clock_two_seconds_off_fails_and_one_within_its_uncertainty_passes():
    bad = clock_row(HOST, "dev0", FLEET, ClockSample(2.0, 0.001, 0.0005))
    assert not bad.ok and "+2000.0 ms" in bad.detail and "chronyc makestep" in bad.fix
    # 0.15 s off, but the sample cannot tell it from 0.05 s (RTT 0.2 s): not a failure
    assert clock_row(HOST, "dev0", FLEET, ClockSample(0.15, 0.2, 0.1)).ok


def test_keys_of_another_device_are_named():
    swapped = report(keys={"dev0": {"client": {"public": "K1", "name": "dev1", "secret": True},
                                    "server": {"public": "S"}}})
    row = key_row(HOST, "dev0", LOCAL, swapped, FLEET, "fleet.yaml")
    assert not row.ok and "holds the key of 'dev1', not dev0's" in row.detail
    assert row.fix.startswith("multispin fleet up fleet.yaml")
    assert key_row(HOST, "dev0", LOCAL, report(), FLEET, "fleet.yaml").ok
    other_server = report(keys={"dev0": {"client": {"public": "K0", "secret": True}, "server": {"public": "X"}}})
    assert "another key folder" in key_row(HOST, "dev0", LOCAL, other_server, FLEET, "f").detail
    unknown = Local(**{**LOCAL.__dict__, "authorized": {"K1": "dev1"}})
    assert "keys generate" in key_row(HOST, "dev0", unknown, report(), FLEET, "f").fix


def test_drafter_versions_and_endpoints():
    assert drafter_row(HOST, "dev0", LOCAL, report(), "f").ok
    changed = drafter_row(HOST, "dev0", LOCAL, report(files={"draft.onnx": "b" * 64}), "f")
    assert not changed.ok and "differs" in changed.detail
    assert "missing" in drafter_row(HOST, "dev0", LOCAL, report(files={}), "f").detail
    old = project_rows(HOST, "dev0", LOCAL, {"version": "0.0.9", "protocol": 0, "missing": []}, "python3")
    assert [r.ok for r in old] == [False] and "project 0.0.9, protocol 0" in old[0].detail
    rows = {r.item: r for r in endpoint_rows(HOST, "dev0", FLEET, report())}
    assert rows["reach edge"].ok and "1.00 ms min, 1.50 ms median (3)" in rows["link edge"].detail
    assert not rows["reach emulator"].ok and "port 5600" in rows["reach emulator"].fix
    text = render(list(rows.values()))
    assert text.endswith("1 failure(s)") and "fix: start the edge with channel.mode" in text
