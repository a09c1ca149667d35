"""The layers stay as docs/architecture.md draws them: read every import statement of the tree.

- `testbed/core/` is pure: besides itself it imports numpy, scipy, pydantic and stdlib modules that
  touch no socket, clock, file or process.
- `testbed/wire/` knows bytes on the wire: the core, numpy and pure stdlib, nothing of the runtime face.
- No node package (edge_node, device_node, channel_emulator) imports another node package.
- A device imports no PyTorch, anywhere in device_node/ (the live tests also check a real device process).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODES = ("edge_node", "device_node", "channel_emulator")
# stdlib modules that would give the core a clock, a socket, a file or a process.
IMPURE_STDLIB = {"time", "socket", "os", "io", "pathlib", "subprocess", "threading", "multiprocessing",
                 "asyncio", "shutil", "tempfile", "datetime", "logging", "random", "sys", "signal", "select"}
CORE_THIRD_PARTY = {"numpy", "scipy", "pydantic"}


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, function-level imports included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                pkg = path.relative_to(root).with_suffix("").parts[: -node.level]
                base = ".".join(pkg + ((node.module,) if node.module else ()))
            else:
                base = node.module
            out.append((node.lineno, base))
    return out


def files(package: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / package).rglob("*.py"))


def top(module: str) -> str:
    return module.split(".")[0]


def violations(package: str, allowed, root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{line}: imports {mod}"
            for p in files(package, root) for line, mod in imports_of(p, root) if not allowed(mod)]


def core_allowed(mod: str) -> bool:
    if mod == "__future__" or mod.startswith("testbed.core"):
        return True
    if top(mod) in CORE_THIRD_PARTY:
        return True
    return top(mod) in sys.stdlib_module_names and top(mod) not in IMPURE_STDLIB


def test_core_is_pure():
    assert files("testbed/core"), "testbed/core/ is missing"
    assert violations("testbed/core", core_allowed) == []


def test_wire_imports_only_core_and_pure_stdlib():
    def allowed(mod: str) -> bool:
        if mod == "__future__" or mod.startswith(("testbed.core", "testbed.wire")) or top(mod) == "numpy":
            return True
        return top(mod) in sys.stdlib_module_names and top(mod) not in IMPURE_STDLIB - {"logging"}

    assert files("testbed/wire"), "testbed/wire/ is missing"
    assert violations("testbed/wire", allowed) == []


@pytest.mark.parametrize("package", NODES)
def test_no_node_imports_another_node(package):
    others = set(NODES) - {package}
    assert violations(package, lambda mod: top(mod) not in others) == []


def test_device_imports_no_torch():
    heavy = {"torch", "transformers", "edge_node"}
    assert violations("device_node", lambda mod: top(mod) not in heavy) == []


def test_the_checker_sees_a_violation(tmp_path):
    # The rules must be able to fail: a core file with a socket, a runtime import and a relative import.
    core = tmp_path / "testbed" / "core"
    core.mkdir(parents=True)
    (core / "probe.py").write_text("import socket\nfrom testbed.launcher import run_live\nfrom .. import records\n"
                                   "import numpy\nfrom . import model\n")
    assert violations("testbed/core", core_allowed, root=tmp_path) == [
        "testbed/core/probe.py:1: imports socket",
        "testbed/core/probe.py:2: imports testbed.launcher",
        "testbed/core/probe.py:3: imports testbed",
    ]


# import name -> distribution, for the third-party modules a device may import
DEVICE_DISTRIBUTIONS = {"numpy": "numpy", "yaml": "pyyaml", "zmq": "pyzmq", "onnxruntime": "onnxruntime",
                        "pydantic": "pydantic", "tqdm": "tqdm"}


def test_device_requirements_cover_what_a_device_imports():
    def names(lines):
        return {re.split(r"[<>=~!\[ ]", line.strip(), maxsplit=1)[0].lower() for line in lines
                if line.strip() and not line.lstrip().startswith("#")}

    device = names((ROOT / "requirements-device.txt").read_text().splitlines())
    # the installed metadata is pyproject.toml's list (CI installs the clone fresh)
    project = names(r for r in importlib.metadata.requires("multispin-testbed") if "extra ==" not in r)
    assert device <= project and not device & {"torch", "transformers"}
    third_party = {top(mod) for pkg in ("device_node", "testbed/wire") for path in (ROOT / pkg).rglob("*.py")
                   for _, mod in imports_of(path)} - set(sys.stdlib_module_names) - {"testbed", "device_node"}
    assert third_party and {DEVICE_DISTRIBUTIONS.get(m, m) for m in third_party} <= device
