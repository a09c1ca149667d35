"""Size limits of the edge's modules (issue 28): no class over 400 lines, no function over 60, `server.py` under
400. A long class or function is where state and phases tangle; the limits keep the edge readable by concern."""

from __future__ import annotations

import ast
from pathlib import Path

EDGE = Path(__file__).resolve().parents[2] / "edge_node"
MAX_CLASS_LINES, MAX_FUNCTION_LINES, MAX_SERVER_LINES = 400, 60, 400


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def oversized(folder: Path) -> list[str]:
    """Every class and function of the modules under `folder` past its limit, as 'path:line name (n lines)'."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            if _span(node) > limit:
                found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name} ({_span(node)} lines)")
    return found


def test_no_class_or_function_of_the_edge_is_oversized():
    assert oversized(EDGE) == []


def test_the_edge_server_module_is_short():
    lines = len((EDGE / "server.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_SERVER_LINES, f"edge_node/server.py has {lines} lines"


def test_the_check_finds_a_planted_oversized_class_and_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES + 1))
    (tmp_path / "big.py").write_text(f"class Big:\n{body}\n", encoding="utf-8")
    steps = "\n".join(f"    y{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    (tmp_path / "long.py").write_text(f"def long():\n{steps}\n", encoding="utf-8")
    (tmp_path / "fine.py").write_text("class Small:\n    pass\n\n\ndef short():\n    return 1\n", encoding="utf-8")
    assert [f.split(" ")[1] for f in oversized(tmp_path)] == ["Big", "long"]
