"""The fleet file: a good one loads; an unknown key or a bad value is refused naming the key (exit 2)."""

from __future__ import annotations

import pytest
import yaml

from testbed.cli import main
from testbed.fleet.schema import FleetFileError, load_fleet, parse_fleet

GOOD = {"edge": "tcp://192.168.1.10:5555", "keys": "keys",
        "hosts": [{"name": "pi-a", "address": "192.168.1.21", "user": "pi", "devices": ["dev0", "dev1"]},
                  {"name": "pi-b", "address": "192.168.1.22", "devices": ["dev2"]}]}


def with_host(**fields) -> dict:
    return {**GOOD, "hosts": [{**GOOD["hosts"][0], **fields}, GOOD["hosts"][1]]}


def test_a_fleet_file_loads_with_defaults(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "emulator": "tcp://192.168.1.10:5600"}))
    fleet, base = load_fleet(path)
    assert base == tmp_path
    assert fleet.connect == "tcp://192.168.1.10:5600"  # devices connect to the emulator when there is one
    assert fleet.hosts[0].devices == ["dev0", "dev1"] and fleet.hosts[1].port == 22
    assert fleet.hosts[1].install == "venv" and fleet.drafter == "default"
    assert parse_fleet(GOOD).connect == GOOD["edge"]


@pytest.mark.parametrize("data, named", [
    (with_host(passwd="x"), "hosts[0] (pi-a).passwd: unknown key"),
    ({**GOOD, "edges": "tcp://a:1"}, "edges: unknown key"),
    (with_host(port=0), "hosts[0] (pi-a).port"),
    (with_host(install="pip"), "hosts[0] (pi-a).install"),
    (with_host(devices=[]), "hosts[0] (pi-a).devices"),
    (with_host(devices=["dev 0"]), "device name 'dev 0'"),
    ({**GOOD, "edge": "192.168.1.10:5555"}, "edge: '192.168.1.10:5555': use tcp://HOST:PORT"),
    ({**GOOD, "emulator": "tcp://h:70000"}, "emulator:"),
    ({**GOOD, "max_clock_offset_s": -1}, "max_clock_offset_s"),
    ({k: v for k, v in GOOD.items() if k != "edge"}, "edge: required key is missing"),
    (with_host(devices=["dev2"]), "device 'dev2' is on 'pi-a' and 'pi-b'"),
    ({**GOOD, "device": {"reconect": True}}, "device.reconect: unknown key"),
])
def test_a_bad_fleet_file_names_the_key(data, named):
    with pytest.raises(FleetFileError, match=None) as err:
        parse_fleet(data)
    assert named in str(err.value), str(err.value)


def test_the_command_exits_2_naming_the_key(tmp_path, capsys):
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(with_host(adress="x")))
    assert main(["fleet", "check", str(path)]) == 2
    assert "hosts[0] (pi-a).adress: unknown key" in capsys.readouterr().err
    assert main(["fleet", "up", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the fleet file" in capsys.readouterr().err
