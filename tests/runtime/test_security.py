"""CURVE keys and the ZAP handler: only listed keys get in, and a key speaks only for its own name."""

from __future__ import annotations

import stat

import pytest
import zmq

from testbed.runtime.security import (
    ClientKeys,
    RateLimiter,
    SecurityError,
    ServerKeys,
    check_identity,
    generate_keys,
    make_client,
    make_server,
    require_keys_or_insecure,
    stop_authenticators,
)

pytestmark = pytest.mark.live  # ZeroMQ sockets with CURVE in every test


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "keys", ["dev0", "dev1"])
    return tmp_path / "keys"


@pytest.fixture
def server(keys):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    make_server(sock, ServerKeys.load(keys))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close()
    stop_authenticators()
    ctx.term()


def dealer(endpoint: str, routing_id: str, client: ClientKeys | None):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 1000)  # a refused CURVE client may never get a pipe to send on
    s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    make_client(s, client)
    s.connect(endpoint)
    return s


def receive(sock, timeout_ms: int = 1500):
    if not sock.poll(timeout_ms):
        return None
    return sock.recv_multipart(copy=False)


def test_layout_and_secret_permissions(keys):
    assert (keys / "server.key").is_file() and (keys / "server.key_secret").is_file()
    assert sorted(p.stem for p in (keys / "authorized").glob("*.key")) == ["channel", "dev0", "dev1", "edge"]
    bundle = keys / "clients" / "dev0"
    assert sorted(p.name for p in bundle.iterdir()) == ["client.key", "client.key_secret", "server.key"]
    for secret in keys.rglob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert ServerKeys.load(keys).authorized.__len__() == 4


def test_generate_refuses_overwrite_and_reserved_names(keys):
    with pytest.raises(SecurityError, match="--force"):
        generate_keys(keys, ["dev0"])
    with pytest.raises(SecurityError, match="reserved"):
        generate_keys(keys.parent / "other", ["edge"])
    with pytest.raises(SecurityError, match="client name"):
        generate_keys(keys.parent / "other", ["../evil"])


def test_listed_key_gets_in_and_is_named(server, keys):
    sock, endpoint = server
    d = dealer(endpoint, "dev0", ClientKeys.for_name(keys, "dev0"))
    d.send(b"hello")
    frames = receive(sock)
    assert frames is not None and frames[0].bytes == b"dev0"
    assert check_identity("dev0", frames[1]) is None
    d.close()


def test_unlisted_and_plain_clients_never_deliver(server, keys, tmp_path):
    sock, endpoint = server
    stranger_dir = tmp_path / "stranger"
    generate_keys(stranger_dir, ["dev0"])  # a well-formed key pair the server does not list
    stranger = ClientKeys.load(stranger_dir / "clients" / "dev0")
    stranger = ClientKeys(stranger.public, stranger.secret, ClientKeys.for_name(keys, "dev0").server_public)
    a = dealer(endpoint, "dev0", stranger)
    b = dealer(endpoint, "dev1", None)
    for sock, text in ((a, b"let me in"), (b, b"me too")):
        try:
            sock.send(text)
        except zmq.Again:
            pass  # refused before any pipe was up: nothing can be delivered either
    assert receive(sock, 1000) is None
    a.close()
    b.close()


def test_listed_key_cannot_use_another_name(server, keys):
    sock, endpoint = server
    d = dealer(endpoint, "dev0", ClientKeys.for_name(keys, "dev1"))
    d.send(b"I am dev0")
    frames = receive(sock)
    assert frames is not None and frames[0].bytes == b"dev0"
    assert check_identity("dev0", frames[1]) == "the key of 'dev1' cannot speak as 'dev0'"
    # The channel emulator's key may speak for any device (it checked them on its own frontend).
    c = dealer(endpoint, "dev1", ClientKeys.for_name(keys, "channel"))
    c.send(b"forwarded")
    frames = receive(sock)
    assert check_identity("dev1", frames[1], forwarder="channel") is None
    assert check_identity("dev1", frames[1]) is not None
    d.close()
    c.close()


def test_exposed_endpoint_needs_keys_or_insecure(caplog):
    require_keys_or_insecure(["ipc:///tmp/x", "tcp://127.0.0.1:5555"], None, False, "edge")
    require_keys_or_insecure(["tcp://0.0.0.0:5555"], "/keys", False, "edge")
    with pytest.raises(SecurityError, match="security: insecure"):
        require_keys_or_insecure(["tcp://0.0.0.0:5555"], None, False, "edge")
    require_keys_or_insecure(["tcp://0.0.0.0:5555"], None, True, "edge")
    assert "no authentication" in caplog.text and "(security: insecure)" in caplog.text
    # A command line names its own flags.
    with pytest.raises(SecurityError, match="set `--keys DIR`, or set `--insecure`"):
        require_keys_or_insecure(["tcp://0.0.0.0:5600"], None, False, "serve", keys_setting="--keys DIR",
                                 insecure_setting="--insecure")
    require_keys_or_insecure(["tcp://0.0.0.0:5600"], None, True, "serve", insecure_setting="--insecure")
    assert "SECURITY: serve serves tcp://0.0.0.0:5600 with no authentication" in caplog.text
    assert "(--insecure)" in caplog.text


def test_rate_limiter_token_bucket_per_identity():
    lim = RateLimiter(100)
    # A burst of one second's worth, then the rate; another identity has its own bucket.
    assert sum(lim.allow(b"a", 0.0) for _ in range(150)) == 100
    assert lim.allow(b"b", 0.0)
    assert sum(lim.allow(b"a", 0.5) for _ in range(100)) == 50
    assert 99 <= sum(lim.allow(b"a", 0.5 + i / 200) for i in range(201)) <= 100  # 200/s for 1 s: 100 pass
    with pytest.raises(ValueError, match="max_msgs_per_s"):
        RateLimiter(float("nan"))
    # Buckets full again are forgotten when new identities pile up: memory follows the identities of the last
    # second, not all that ever came.
    for i in range(5000):
        lim.allow(str(i).encode(), 10.0 + i)
    assert len(lim.buckets) <= 1025


def test_multispin_keys_generate_on_the_command_line(tmp_path, capsys):
    from testbed.cli import main

    out = tmp_path / "k"
    assert main(["keys", "generate", "--out", str(out), "--devices", "dev0, dev1"]) == 0
    said = capsys.readouterr().out
    assert f"copy {out / 'clients' / 'dev0'}/ to device dev0" in said and "security: {keys:" in said
    assert sorted(p.stem for p in (out / "authorized").glob("*.key")) == ["channel", "dev0", "dev1", "edge"]
    assert set(ServerKeys.load(out).authorized.values()) == {"channel", "dev0", "dev1", "edge"}
    ClientKeys.load(out / "clients" / "dev1")  # a complete bundle for the device
    # Existing keys are kept unless --force; reserved names and an empty list are clear errors.
    assert main(["keys", "generate", "--out", str(out), "--devices", "dev0"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["keys", "generate", "--out", str(tmp_path / "k2"), "--devices", "edge"]) == 2
    assert "reserved" in capsys.readouterr().err
    assert main(["keys", "generate", "--out", str(tmp_path / "k3"), "--devices", " , "]) == 2
    assert "--devices" in capsys.readouterr().err
    old = (out / "server.key").read_bytes()
    assert main(["keys", "generate", "--out", str(out), "--devices", "dev0", "--force"]) == 0
    assert (out / "server.key").read_bytes() != old
