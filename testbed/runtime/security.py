"""CURVE authentication and encryption for the sockets of a LAN deployment (libsodium, through pyzmq).

A key directory, written by `multispin keys generate --out DIR --devices dev0,dev1`:

    DIR/server.key, DIR/server.key_secret   the edge host's server pair: edge ROUTER, emulator frontend
                                            and control socket
    DIR/authorized/<name>.key               the public key of every admitted client, named
    DIR/clients/<name>/                     what client <name> needs: its own pair and server.key

Clients are the devices, ``edge`` (the edge as the emulator's control client) and ``channel`` (the
emulator as the edge's client). Copy ``DIR/clients/dev0/`` to device dev0; nothing else leaves the edge
host. A ZAP handler admits only the authorized keys and stamps every message with its sender's name (the
``User-Id`` property): a node refuses a message whose routing identity is not the name its key is bound
to, so a listed key cannot speak for another device. A server socket may admit only some clients (`make_server`
`admit`: the edge behind an emulator admits only ``channel``). `RateLimiter` is the per-identity message limit the
edge and the emulator share, `LogThrottle` their bounded log of peers' bad messages.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("multispin.security")

SERVER = "server"
EDGE_CLIENT = "edge"         # the edge connecting to the emulator's control socket
CHANNEL_CLIENT = "channel"   # the emulator forwarding devices' messages to the edge
RESERVED = (SERVER, EDGE_CLIENT, CHANNEL_CLIENT)
LOOPBACK_PREFIXES = ("ipc://", "inproc://", "tcp://127.", "tcp://localhost:", "tcp://[::1]:")
ADMIT_DOMAIN = "multispin-admit:"  # ZAP domain prefix of a socket that admits only some clients (`make_server`)


class SecurityError(Exception):
    """A key directory or a security setting the user must fix (named file, named reason)."""


def is_loopback(endpoint: str) -> bool:
    """True for endpoints no other host can reach."""
    return endpoint.startswith(LOOPBACK_PREFIXES)


MAX_NAME_CHARS = 64  # as a `register.name` (testbed.wire.messages)


def _check_name(name: str) -> str:
    if (not name or len(name) > MAX_NAME_CHARS or not name.isascii() or name.startswith(".")
            or not all(c.isalnum() or c in "-_." for c in name)):
        raise SecurityError(f"client name {name!r}: use 1-{MAX_NAME_CHARS} ASCII letters, digits, '-', '_' or '.' "
                            "(not first), as in the profile")
    return name


def check_device_names(names: list[str]) -> list[str]:
    """`names` as given, each valid, none twice, none reserved: else a SecurityError naming the culprits."""
    for name in names:
        _check_name(name)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SecurityError(f"device names {', '.join(twice)} given more than once; each device needs its own key")
    clash = sorted(set(names) & set(RESERVED))
    if clash:
        raise SecurityError(f"device names {clash} are reserved for the testbed's own clients")
    return names


def device_names(keys_dir: str | Path) -> list[str]:
    """The devices a key directory admits (its authorized keys, the testbed's own clients left out)."""
    auth = Path(keys_dir) / "authorized"
    if not (Path(keys_dir) / "server.key_secret").is_file() or not auth.is_dir():
        raise SecurityError(f"{keys_dir}: not a key directory (make one with `multispin keys generate`)")
    return sorted(f.stem for f in auth.glob("*.key") if f.stem not in RESERVED)


def add_devices(keys_dir: str | Path, names: list[str]) -> dict[str, Path]:
    """Key pairs for new devices in an existing key directory (the others keep theirs); refuses names it has."""
    check_device_names(names)
    have = sorted(set(names) & set(device_names(keys_dir)))
    if have:
        raise SecurityError(f"{keys_dir} has keys for {', '.join(have)} already (`keys generate --force` replaces "
                            "every key)")
    server_pub = Path(keys_dir) / "server.key"
    return {name: _client_bundle(Path(keys_dir), name, server_pub) for name in names}


def revoke_devices(keys_dir: str | Path, names: list[str]) -> None:
    """Take devices' keys out of a key directory: the edge refuses them from its next start."""
    check_device_names(names)
    unknown = sorted(set(names) - set(device_names(keys_dir)))
    if unknown:
        raise SecurityError(f"{keys_dir} has no keys for {', '.join(unknown)}; it has: "
                            f"{', '.join(device_names(keys_dir)) or 'none'}")
    import shutil

    for name in names:
        (Path(keys_dir) / "authorized" / f"{name}.key").unlink()
        shutil.rmtree(Path(keys_dir) / "clients" / name, ignore_errors=True)


def _client_bundle(out: Path, name: str, server_pub: Path) -> Path:
    """DIR/clients/<name>/ (its pair and the server's public key) and DIR/authorized/<name>.key."""
    bundle = out / "clients" / name
    bundle.mkdir(parents=True, exist_ok=True)
    pub, _ = zmq.auth.create_certificates(bundle, "client", metadata={"name": name})
    (bundle / "server.key").write_bytes(server_pub.read_bytes())
    (out / "authorized" / f"{name}.key").write_bytes(Path(pub).read_bytes())
    for secret in bundle.glob("*.key_secret"):
        secret.chmod(0o600)
    return bundle


def generate_keys(out_dir: str | Path, devices: list[str], *, force: bool = False) -> dict[str, Path]:
    """Write a fresh key directory for `devices` (plus the edge and channel clients); returns the paths.

    Refuses to overwrite an existing server key unless `force`: replacing it locks out every device.
    """
    out = Path(out_dir)
    names = check_device_names(list(devices))
    if (out / "server.key_secret").exists() and not force:
        raise SecurityError(f"{out / 'server.key_secret'} exists; pass --force to replace every key")
    authorized, clients = out / "authorized", out / "clients"
    for d in (out, authorized, clients):
        d.mkdir(parents=True, exist_ok=True)
    server_pub, _ = zmq.auth.create_certificates(out, SERVER)
    paths = {SERVER: out}
    for name in [*names, EDGE_CLIENT, CHANNEL_CLIENT]:
        paths[name] = _client_bundle(out, name, Path(server_pub))
    for secret in out.rglob("*.key_secret"):
        secret.chmod(0o600)
    return paths


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: dict[bytes, str]  # public key (raw 32 bytes) -> client name

    @classmethod
    def load(cls, keys_dir: str | Path) -> ServerKeys:
        d = Path(keys_dir)
        pub, sec = _load_pair(d / "server.key_secret")
        auth_dir = d / "authorized"
        if not auth_dir.is_dir():
            raise SecurityError(f"{auth_dir}: missing (make the directory with `multispin keys generate`)")
        authorized = {}
        for f in sorted(auth_dir.glob("*.key")):
            try:
                key, _ = zmq.auth.load_certificate(f)
            except (OSError, ValueError) as exc:
                raise SecurityError(f"{f}: not a public key file: {exc}") from None
            authorized[z85.decode(key)] = f.stem
        return cls(pub, sec, authorized)


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, bundle_dir: str | Path) -> ClientKeys:
        """A client's bundle (``DIR/clients/<name>/``) or, on the edge host, the key directory + name."""
        d = Path(bundle_dir)
        pub, sec = _load_pair(d / "client.key_secret")
        server = d / "server.key"
        try:
            server_pub, _ = zmq.auth.load_certificate(server)
        except (OSError, ValueError) as exc:
            raise SecurityError(f"{server}: not readable as the server's public key: {exc}") from None
        return cls(pub, sec, server_pub)

    @classmethod
    def for_name(cls, keys_dir: str | Path, name: str) -> ClientKeys:
        return cls.load(Path(keys_dir) / "clients" / name)


def _load_pair(secret_file: Path) -> tuple[bytes, bytes]:
    try:
        pub, sec = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{secret_file}: not readable as a secret key: {exc}") from None
    if not sec:
        raise SecurityError(f"{secret_file}: holds no secret key")
    return pub, sec


class _NamedKeyAuthenticator(ThreadAuthenticator):
    """Admits the authorized keys only and names each connection after its key (its User-Id). A socket with
    an `ADMIT_DOMAIN` ZAP domain admits only the clients that domain names."""

    def __init__(self, context: zmq.Context, authorized: dict[bytes, str]):
        super().__init__(context)
        self.names = dict(authorized)

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names[client_public_key]

    def callback(self, domain: str, z85_key: bytes) -> bool:  # the credentials provider's hook
        # Info only: the socket's handshake watch (`testbed.runtime.handshake_watch`) warns, with the peer's
        # address and one line per peer per interval, where this would be one line per attempt.
        name = self.names.get(z85.decode(z85_key))
        if name is None:
            log.info("refused a CURVE client with an unlisted key %s...", bytes(z85_key[:10]).decode())
            return False
        if domain.startswith(ADMIT_DOMAIN) and name not in domain[len(ADMIT_DOMAIN):].split(","):
            log.info("refused the CURVE key of %r on a socket that admits only %s", name,
                     domain[len(ADMIT_DOMAIN):])
            return False
        return True


_authenticators: dict[int, _NamedKeyAuthenticator] = {}
_auth_lock = threading.Lock()


def _ensure_authenticator(ctx: zmq.Context, keys: ServerKeys, domain: str = "*") -> None:
    with _auth_lock:
        auth = _authenticators.get(id(ctx))
        if auth is None:
            auth = _NamedKeyAuthenticator(ctx, keys.authorized)
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=auth)
            _authenticators[id(ctx)] = auth
        else:
            auth.names.update(keys.authorized)
        if domain not in auth.credentials_providers:  # ZAP looks a domain up by its exact name
            auth.configure_curve_callback(domain, credentials_provider=auth)


def stop_authenticators(ctx: zmq.Context | None = None) -> None:
    """Stop the ZAP handler of `ctx` (None: every one this process started); call it before ctx.term()."""
    with _auth_lock:
        for key in [id(ctx)] if ctx is not None else list(_authenticators):
            auth = _authenticators.pop(key, None)
            if auth is not None:
                auth.stop()


def make_server(sock: zmq.Socket, keys: ServerKeys | None, *, admit: Iterable[str] | None = None) -> None:
    """Turn `sock` (before bind) into a CURVE server admitting only `keys.authorized`; None: plain. `admit`:
    only the clients of these names connect (the others fail the handshake, so they hold no routing id)."""
    if keys is None:
        return
    domain = "*"
    if admit is not None:
        names = sorted(set(admit))
        if not names or not all(n and "," not in n for n in names):
            raise ValueError(f"admit={names!r}: allowed: one or more client names without ','")
        domain = ADMIT_DOMAIN + ",".join(names)
        sock.zap_domain = domain.encode()
    _ensure_authenticator(sock.context, keys, domain)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Turn `sock` (before connect) into a CURVE client of the server in `keys`; None: plain."""
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def sender_name(frame: zmq.Frame) -> str | None:
    """The authenticated name of a received frame's sender; None on a plain (insecure) socket."""
    try:
        uid = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return uid or None


def peer_address(frame: zmq.Frame) -> str | None:
    """The address ZeroMQ gives a received frame's connection (an IP address on tcp); None if it has none."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
    return address or None


def claims_route(key_name: str, header: dict | None) -> bool:
    """Whether a keyed device's message moves the replies to its name onto the connection it came from: only a
    `register` under the key's own name (a restarted device, its new connection). Any other message, or a
    register for another name (which the edge refuses), leaves them where they are, so a second holder of a
    key cannot pull replies off the registered connection message by message."""
    return isinstance(header, dict) and header.get("type") == "register" and header.get("name") == key_name


def check_identity(identity: str, frame: zmq.Frame, *, forwarder: str | None = None) -> str | None:
    """Why a message whose routing identity is `identity` must be refused, or None if it may pass.

    With CURVE on, the identity must be the name the sender's key is bound to; `forwarder` names the one
    client allowed to speak for others (the channel emulator, which checked them itself)."""
    name = sender_name(frame)
    if name is None or name == identity or (forwarder is not None and name == forwarder):
        return None
    return f"the key of {name!r} cannot speak as {identity!r}"


def require_keys_or_insecure(endpoints: list[str], keys_dir: str | None, insecure: bool, what: str, *,
                             keys_setting: str = "security: {keys: DIR}",
                             insecure_setting: str = "security: insecure") -> None:
    """Refuse to serve a non-loopback endpoint without keys unless the profile says `security: insecure`
    (`keys_setting`, `insecure_setting`: how a command line says the same, e.g. `--keys DIR`, `--insecure`)."""
    exposed = [e for e in endpoints if e and not is_loopback(e)]
    if not exposed or keys_dir:
        return
    if not insecure:
        raise SecurityError(f"{what} binds {', '.join(exposed)} without keys: make them with `multispin keys "
                            f"generate --out DIR --devices ...` and set `{keys_setting}`, or set "
                            f"`{insecure_setting}` to accept any peer that reaches the port")
    log.warning("SECURITY: %s serves %s with no authentication and no encryption (%s)",
                what, ", ".join(exposed), insecure_setting)


class RateLimiter:
    """A token bucket per peer identity: `rate` messages a second on average, in bursts of one second's worth.
    Bookkeeping only (the caller passes its clock's `now`); a bucket refilled to the brim is forgotten, so a
    stream of new identities grows it only by those heard within the last second."""

    def __init__(self, rate: float):
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 1):
            raise ValueError(f"max_msgs_per_s={rate!r}; allowed: a finite number of messages a second >= 1")
        self.rate = float(rate)
        self.buckets: dict[bytes, tuple[float, float]] = {}  # identity -> (tokens, when counted)
        self._prune_at = 1024

    def allow(self, ident: bytes, now: float) -> bool:
        """Whether `ident` may send one more message at `now` (it is counted if so)."""
        if ident not in self.buckets and len(self.buckets) >= self._prune_at:
            self.prune(now)
            self._prune_at = max(1024, 2 * len(self.buckets))
        tokens, at = self.buckets.get(ident, (self.rate, now))
        tokens = min(self.rate, tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self.buckets[ident] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def forget(self, ident: bytes) -> None:
        self.buckets.pop(ident, None)

    def prune(self, now: float) -> None:
        """Forget the buckets full again (quiet for a second): the same as never seen."""
        for ident in [i for i, (t, at) in self.buckets.items() if t + (now - at) * self.rate >= self.rate]:
            del self.buckets[ident]


class LogThrottle:
    """At most `burst` warnings a second about peers' messages (a flood must not fill the disk); the rest are
    counted by reason and said in one line once the second is over. The owner calls `flush` from its periodic
    tick too, so that a flood that stops is still reported."""

    def __init__(self, logger: logging.Logger, burst: int, what: str):
        self.logger, self.burst, self.what = logger, burst, what
        self.start, self.logged, self.suppressed = 0.0, 0, Counter()

    def warn(self, now: float, reason: str, msg: str, *args) -> None:
        """Log `msg % args` if this second's burst allows, else count it under `reason`."""
        self.flush(now)
        if self.logged < self.burst:
            self.logged += 1
            self.logger.warning(msg, *args)
        else:
            self.suppressed[reason] += 1

    def flush(self, now: float) -> None:
        """A second after the window opened: say how many were not logged, by reason; open a new window."""
        if now - self.start < 1.0:
            return
        if self.suppressed:
            self.logger.warning("%d more %s were not logged (%s)", self.suppressed.total(), self.what,
                                ", ".join(f"{k}: {v}" for k, v in self.suppressed.most_common()))
        self.start, self.logged, self.suppressed = now, 0, Counter()


def fd_limit(raise_soft: bool = False) -> int | None:
    """This process's soft limit on open files (None: unlimited, or not POSIX); with `raise_soft`, first
    raised to the hard limit (at most 2**16), as a process of its own may."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2**16 if hard == resource.RLIM_INFINITY else min(hard, 2**16)
    if raise_soft and soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return None if soft == resource.RLIM_INFINITY else soft
