"""`multispin keys generate|add|revoke`: a name twice, an invalid name, a name the command needs to exist (or not)
is refused with exit 2, naming it; nothing is written then."""

from __future__ import annotations

import pytest
from zmq.utils import z85

from testbed.cli import main
from testbed.runtime.security import ClientKeys, ServerKeys, device_names


@pytest.mark.parametrize("devices, says", [
    ("dev0,dev0", "dev0 given more than once"),
    ("dev0,dev1,dev1,dev0", "dev0, dev1 given more than once"),
    ("dev 0", "client name 'dev 0'"),
    ("dév0", "client name 'dév0'"),
    (".hidden", "client name '.hidden'"),
    ("d" * 65, "1-64 ASCII"),
    ("dev0,channel", "reserved"),
])
def test_generate_refuses_bad_names_and_writes_nothing(tmp_path, capsys, devices, says):
    out = tmp_path / "keys"
    assert main(["keys", "generate", "--out", str(out), "--devices", devices]) == 2
    err = capsys.readouterr().err
    assert says in err and "--devices" in err
    assert not out.exists()


def test_add_and_revoke_take_only_the_names_they_can(tmp_path, capsys):
    out = tmp_path / "keys"
    assert main(["keys", "generate", "--out", str(out), "--devices", "dev0,dev1"]) == 0
    dev0 = (out / "clients" / "dev0" / "client.key").read_bytes()
    # add: new names only; dev0 keeps its key.
    assert main(["keys", "add", "--keys", str(out), "--devices", "dev2,dev0"]) == 2
    assert "has keys for dev0 already" in capsys.readouterr().err
    assert main(["keys", "add", "--keys", str(out), "--devices", "dev2,dev2"]) == 2
    assert "dev2 given more than once" in capsys.readouterr().err
    assert device_names(out) == ["dev0", "dev1"]
    assert main(["keys", "add", "--keys", str(out), "--devices", "dev2"]) == 0
    assert "copy " + str(out / "clients" / "dev2") in capsys.readouterr().out
    assert device_names(out) == ["dev0", "dev1", "dev2"]
    assert (out / "clients" / "dev0" / "client.key").read_bytes() == dev0
    server = ServerKeys.load(out)
    assert server.authorized[z85.decode(ClientKeys.for_name(out, "dev2").public)] == "dev2"
    assert ClientKeys.for_name(out, "dev2").server_public == server.public  # the same edge
    # revoke: existing names only.
    assert main(["keys", "revoke", "--keys", str(out), "--devices", "dev1,dev7"]) == 2
    err = capsys.readouterr().err
    assert "no keys for dev7" in err and "it has: dev0, dev1, dev2" in err
    assert device_names(out) == ["dev0", "dev1", "dev2"]
    assert main(["keys", "revoke", "--keys", str(out), "--devices", "dev1"]) == 0
    assert device_names(out) == ["dev0", "dev2"] and not (out / "clients" / "dev1").exists()
    assert "dev1" not in ServerKeys.load(out).authorized.values()
    # A folder that is no key directory.
    assert main(["keys", "add", "--keys", str(tmp_path), "--devices", "dev9"]) == 2
    assert "not a key directory" in capsys.readouterr().err
