"""Where things go on a host, under its fleet folder, and what this machine has to send there."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from testbed.fleet.probe import read_key
from testbed.fleet.schema import Fleet, local_path

DRAFTER = "draft.onnx"
SPEC = "run/supervisor.json"
PID_FILE = "run/supervisor.pid"
LOG_DIR = "logs"
KEY_FILES = {"client.key": 0o644, "client.key_secret": 0o600, "server.key": 0o644}


def key_dir(device: str) -> str:
    return f"keys/{device}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass
class Local:
    """This machine's side of the comparison: versions, the drafter, the key folder."""

    version: str
    protocol: int
    drafter: Path
    drafter_sha: str | None
    keys_dir: Path | None
    server_public: str | None = None
    authorized: dict[str, str] = field(default_factory=dict)  # public key z85 -> client name

    def uploads(self, devices: list[str]) -> dict[str, tuple[Path, int]]:
        """Fleet-folder path -> (local file, mode) of what the host of `devices` needs."""
        out = {DRAFTER: (self.drafter, 0o644)} if self.drafter_sha else {}
        if self.keys_dir is not None:
            for dev in devices:
                bundle = self.keys_dir / "clients" / dev
                for name, mode in KEY_FILES.items():
                    if (bundle / name).is_file():
                        out[f"{key_dir(dev)}/{name}"] = (bundle / name, mode)
        return out


def resolve_drafter(fleet: Fleet, base: Path) -> Path:
    if fleet.drafter == "default":
        from model_pairs.cache import ensure_default_pair  # unpacks the shipped pair once, then a cache hit

        return Path(ensure_default_pair(progress=False).draft_onnx)
    return local_path(base, fleet.drafter)


def local_facts(fleet: Fleet, base: Path) -> Local:
    from testbed import __version__
    from testbed.wire.protocol import PROTOCOL_VERSION

    drafter = resolve_drafter(fleet, base)
    keys = local_path(base, fleet.keys) if fleet.keys else None
    facts = Local(__version__, PROTOCOL_VERSION, drafter, sha256_file(drafter) if drafter.is_file() else None, keys)
    if keys is not None:
        server = read_key(str(keys / "server.key"))
        facts.server_public = server and server["public"]
        for f in sorted((keys / "authorized").glob("*.key")):
            info = read_key(str(f))
            if info and info["public"]:
                facts.authorized[info["public"]] = f.stem
    return facts
