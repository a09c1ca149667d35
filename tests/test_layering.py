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
from support import ROOT

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
    (core / "probe.py").write_text("import socket\nfrom testbed.run.launcher import run_live\nfrom .. import records\n"
                                   "import numpy\nfrom . import model\n")
    assert violations("testbed/core", core_allowed, root=tmp_path) == [
        "testbed/core/probe.py:1: imports socket",
        "testbed/core/probe.py:2: imports testbed.run.launcher",
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


# -- the layer table of docs/architecture.md: which folder may import which -------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
TABLE_START, TABLE_END = "<!-- layers: begin -->", "<!-- layers: end -->"


def layer_table(text: str) -> dict[str, set[str]]:
    """folder -> the project folders it may import, from the table between the layer markers."""
    body = text[text.index(TABLE_START) + len(TABLE_START):text.index(TABLE_END)]
    table = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        table[cells[0].strip("`")] = set(re.findall(r"`([\w/]+)`", cells[1]))
    return table


def folder_of(module: str, folders) -> str | None:
    """The table's folder that holds a module (the longest match), None for a module outside the project."""
    path = module.replace(".", "/")
    matches = [f for f in folders if path == f or path.startswith(f + "/")]
    return max(matches, key=len) if matches else None


def layer_violations(table: dict[str, set[str]], root: Path = ROOT) -> list[str]:
    out = []
    for folder, allowed in table.items():
        for path in (root / folder).rglob("*.py"):
            if folder_of(str(path.relative_to(root).with_suffix("")), table) != folder:
                continue  # a deeper folder of the table owns this file
            for line, mod in imports_of(path, root):
                target = folder_of(mod, table)
                if target is not None and target != folder and target not in allowed:
                    out.append(f"{path.relative_to(root)}:{line}: {folder} imports {mod} ({target})")
    return out


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (function-level imports included)."""
    modules = {}
    for pkg in PROJECT:
        for path in (root / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for _, mod in imports_of(path, root):
            while mod and mod not in modules:
                mod = mod.rpartition(".")[0]
            if mod and mod != name and not name.startswith(mod + "."):  # a package's own __init__ is no edge
                deps.add(mod)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


PROJECT = ("testbed", "edge_node", "device_node", "channel_emulator", "model_pairs")


def test_every_folder_imports_only_what_the_layer_table_allows():
    table = layer_table(ARCHITECTURE.read_text())
    assert {"testbed/core", "testbed/wire", "testbed/run", "testbed/cli", *NODES} <= set(table)
    assert layer_violations(table) == []


def test_the_layer_table_covers_every_package():
    table = layer_table(ARCHITECTURE.read_text())
    packages = {str(p.parent.relative_to(ROOT)) for pkg in PROJECT for p in (ROOT / pkg).rglob("__init__.py")}
    assert {p for p in packages - {"testbed"} if folder_of(p.replace("/", "."), table) is None} == set()


def test_the_module_import_graph_is_acyclic():
    assert cycles(module_graph()) == []


def test_the_layer_and_cycle_checks_see_a_planted_violation(tmp_path):
    table = {"testbed/core": set(), "testbed/run": {"testbed/core"}, "device_node": {"testbed/core"}}
    for folder, code in (("testbed/core", "from testbed.run import launcher\n"),
                         ("testbed/run", "from testbed.core import model\nimport device_node.node\n"),
                         ("device_node", "import testbed.core.model\n")):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "m.py").write_text(code)
    assert layer_violations(table, tmp_path) == [
        "testbed/core/m.py:1: testbed/core imports testbed.run (testbed/run)",
        "testbed/run/m.py:2: testbed/run imports device_node.node (device_node)",
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
