"""Device hardware profiles: how much slower than this host a device drafts (emulated heterogeneity).

A profile is a small YAML file in ``profiles/hardware/`` (or any path): ``name``, ``compute_scale`` (>= 1:
the device sleeps ``(scale - 1) x`` its measured compute after each draft), ``threads`` (onnxruntime
intra-op threads). On a real device in a LAN deployment use ``edge-class`` (scale 1): the real speed shows.
Energy model (optional; the edge's records use them, see testbed/runtime/energy.py): ``joules_per_token`` (J per
drafted token) and ``receive_power_w`` (W while receiving); left out, that energy is unknown, not zero.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from testbed import PROFILES_DIR
from testbed.core.energy import HARDWARE_ENERGY_FIELDS, check_energy_field

HARDWARE_DIR = PROFILES_DIR / "hardware"


@dataclass(frozen=True)
class HardwareProfile:
    name: str = "edge-class"
    compute_scale: float = 1.0
    threads: int = 1
    description: str = ""
    joules_per_token: float | None = None   # compute energy per drafted token, J/token
    receive_power_w: float | None = None    # power drawn while receiving, W

    def __post_init__(self) -> None:
        if not isinstance(self.compute_scale, (int, float)) or not math.isfinite(self.compute_scale) \
                or self.compute_scale < 1.0:
            raise ValueError(f"hardware {self.name!r}: compute_scale={self.compute_scale!r} is not allowed; "
                             "must be a finite number >= 1")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"hardware {self.name!r}: threads={self.threads!r} is not allowed; must be an int >= 1")
        for key in HARDWARE_ENERGY_FIELDS:
            if getattr(self, key) is not None:
                object.__setattr__(self, key, check_energy_field(key, getattr(self, key), f"hardware {self.name!r}"))

    def to_dict(self) -> dict:
        return asdict(self)


def available() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str | None) -> HardwareProfile:
    """A profile by name (``profiles/hardware/<name>.yaml``) or by path; None gives the reference device."""
    if name_or_path is None:
        return HardwareProfile()
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"hardware profile {name_or_path!r} not found; available: {', '.join(available())} "
                         "(or a path to a YAML file)")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {path}: must be a YAML mapping")
    allowed = {"name", "compute_scale", "threads", "description", *HARDWARE_ENERGY_FIELDS}
    extra = set(data) - allowed
    if extra:
        raise ValueError(f"hardware profile {path}: unknown field(s) {sorted(extra)}; allowed: {sorted(allowed)}")
    data.setdefault("name", path.stem)
    return HardwareProfile(**data)
