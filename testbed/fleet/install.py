"""install: venv — make DIR/venv on the host and install the device requirements and this project there.

The project goes as a wheel built here (`pip wheel --no-deps`, no PyTorch: a device imports none), the
requirements from PyPI (or the index the host's pip is configured for). Run only when the venv's Python
cannot import what a device needs; `fleet check` then says whether it worked."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from testbed.fleet.remote import HostError, HostSession, device_python

PROJECT = Path(__file__).resolve().parents[2]
REQUIREMENTS = PROJECT / "requirements-device.txt"


def build_wheel(out: Path) -> Path:
    if not (PROJECT / "pyproject.toml").is_file() or not REQUIREMENTS.is_file():
        raise HostError(f"install: venv needs the project's source here (no pyproject.toml in {PROJECT})",
                        "run multispin from a checkout, or install the project on the host and set install: check")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(PROJECT)], capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise HostError(f"building the project's wheel failed: {done.stderr.strip()[-400:]}",
                        "pip install wheel setuptools here")
    return wheels[-1]


async def ensure_venv(session: HostSession, host) -> None:
    python = device_python(host, session.root)
    await session.run(session.command(host.python, "-m", "venv", session.path("venv")), timeout_s=300)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        await session.put(wheel, f"dist/{wheel.name}")
        await session.put(REQUIREMENTS, "dist/requirements-device.txt")
    pip = [python, "-m", "pip", "install", "-q"]
    await session.run(session.command(*pip, "-r", session.path("dist/requirements-device.txt")), timeout_s=1800)
    await session.run(session.command(*pip, "--no-deps", "--force-reinstall", session.path(f"dist/{wheel.name}")),
                      timeout_s=600)
