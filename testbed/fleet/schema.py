"""The fleet file: which hosts, how to reach them over SSH, which device names run on each, where the drafter
and the key bundles go there, and the endpoints the devices connect to.

    edge: tcp://192.168.1.10:5555        # the edge ROUTER (reachability is checked from every host)
    emulator: tcp://192.168.1.10:5600    # optional: the channel emulator's frontend; devices connect here if set
    keys: keys                           # `multispin keys generate` folder on this machine (optional: no CURVE)
    drafter: default                     # the draft ONNX file to copy; `default`: the default pair's
    hosts:
      - name: pi-a
        address: 192.168.1.21
        user: pi
        devices: [dev0]

Paths are relative to the fleet file's folder; `~` is the local (or, for `dir`, the remote) home.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from testbed.runtime.errors import TestbedError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
ENDPOINT = re.compile(r"^tcp://([^:/\s]+|\[[0-9a-fA-F:]+\]):([0-9]{1,5})$")


class FleetFileError(TestbedError, ValueError):
    """A fleet file that cannot be used; the message names the key (the CLI exits 2)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _endpoint(value: str) -> str:
    m = ENDPOINT.match(value)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{value!r}: use tcp://HOST:PORT with a port 1..65535")
    return value


def endpoint_host_port(endpoint: str) -> tuple[str, int]:
    host, port = ENDPOINT.match(endpoint).groups()
    return host.strip("[]"), int(port)


class Host(_Strict):
    name: str = Field(description="the host's name in logs and the check table")
    address: str = Field(description="address or DNS name the SSH client connects to")
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = Field(default=None, description="SSH user (default: the local user)")
    client_key: str | None = Field(default=None, description="SSH private key file (default: ~/.ssh/id_*, agent)")
    known_hosts: str | None = Field(default="~/.ssh/known_hosts",
                                    description="known_hosts file the host key is checked against")
    dir: str = Field(default="multispin-fleet", description="the fleet's folder on the host (relative: to "
                                                            "the SSH user's home): drafter, keys, logs, pid file")
    python: str = Field(default="python3", description="interpreter that makes the venv, or runs the devices "
                                                       "when install: check")
    install: Literal["venv", "check"] = Field(
        default="venv", description="venv: make DIR/venv and install the device requirements there when missing; "
                                    "check: `python` must already import the project (nothing is installed)")
    devices: list[str] = Field(min_length=1, description="device names that run on this host")
    hardware: str | None = Field(default=None, description="--hardware of its devices (profile name or path)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the checks and devices")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(f"{v!r}: use letters, digits, '-', '_' or '.'")
        return v

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        for name in v:
            if not NAME.match(name):
                raise ValueError(f"device name {name!r}: use letters, digits, '-', '_' or '.'")
        return v


class DeviceOptions(_Strict):
    register_timeout_s: float = Field(default=600.0, gt=0, description="--register-timeout of every device")
    reconnect: bool = Field(default=True, description="--reconnect: a device outlives an edge restart")
    link_probe: str = Field(default="none", description="--link-probe of every device")


class Fleet(_Strict):
    edge: str = Field(description="the edge ROUTER endpoint as the hosts reach it, tcp://HOST:PORT")
    emulator: str | None = Field(default=None, description="the channel emulator's frontend; devices connect "
                                                           "to it when set, else to `edge`")
    keys: str | None = Field(default=None, description="the key folder of `multispin keys generate`; none: "
                                                       "devices run without CURVE (profile security: insecure)")
    drafter: str = Field(default="default", description="draft ONNX file to copy to every host; default: the "
                                                        "default model pair's")
    max_clock_offset_s: float = Field(default=0.1, gt=0, description="a host's clock further off than this fails")
    wait_for_endpoints_s: float = Field(default=180.0, ge=0, description="`fleet up` waits this long for the "
                                        "edge (and emulator) to answer: the edge loads its model before it binds")
    min_endpoint_checks: int = Field(default=5, ge=1, le=100, description="TCP connects of the link probe")
    device: DeviceOptions = Field(default_factory=DeviceOptions)
    hosts: list[Host] = Field(min_length=1)

    @field_validator("edge", "emulator")
    @classmethod
    def _endpoints(cls, v: str | None) -> str | None:
        return None if v is None else _endpoint(v)

    @model_validator(mode="after")
    def _unique(self) -> Fleet:
        seen_hosts, seen_devices = set(), {}
        for h in self.hosts:
            if h.name in seen_hosts:
                raise ValueError(f"hosts: host name {h.name!r} appears twice")
            seen_hosts.add(h.name)
            for d in h.devices:
                if d in seen_devices:
                    raise ValueError(f"hosts: device {d!r} is on {seen_devices[d]!r} and {h.name!r}")
                seen_devices[d] = h.name
        return self

    @property
    def connect(self) -> str:
        """What the devices connect to."""
        return self.emulator or self.edge

    def endpoints(self) -> dict[str, str]:
        return {"edge": self.edge, **({"emulator": self.emulator} if self.emulator else {})}


def _where(loc: tuple, data: dict) -> str:
    """`hosts[1].devices` -> `hosts[1] (pi-b).devices`: a host named as the user wrote it."""
    parts = []
    for i, key in enumerate(loc):
        if isinstance(key, int):
            parts[-1] += f"[{key}]"
            if loc[:i] == ("hosts",) and isinstance(data.get("hosts"), list) and key < len(data["hosts"]):
                name = data["hosts"][key].get("name") if isinstance(data["hosts"][key], dict) else None
                if name:
                    parts[-1] += f" ({name})"
        else:
            parts.append(str(key))
    return ".".join(parts)


def parse_fleet(data: object, origin: str = "fleet file") -> Fleet:
    if not isinstance(data, dict):
        raise FleetFileError(f"{origin}: expected a mapping of keys (edge, hosts, ...), got {type(data).__name__}")
    try:
        return Fleet.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = _where(tuple(err["loc"]), data) or "(top level)"
            if err["type"] == "extra_forbidden":
                lines.append(f"{where}: unknown key")
            elif err["type"] == "missing":
                lines.append(f"{where}: required key is missing")
            else:
                lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})")
        raise FleetFileError(f"{origin}: " + "; ".join(lines)) from None


def load_fleet(path: str | Path) -> tuple[Fleet, Path]:
    """The fleet and the folder its relative paths start from."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise FleetFileError(f"{p}: cannot read the fleet file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise FleetFileError(f"{p}: not valid YAML: {exc}") from None
    return parse_fleet(data, str(p)), p.resolve().parent


def local_path(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path
