"""The size limits of supervisor/ (issue 33) and worker/ (issue 43): no class over 25 methods, no module over 600
lines, no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from infervisor.supervisor import cli

SUPERVISOR = Path(cli.__file__).resolve().parent
#: Read as files, not imported: importing the worker would load torch for a check of sizes.
WORKER = SUPERVISOR.parent / "worker"
MAX_METHODS, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 25, 600, 80


def oversized(folder: Path) -> list[str]:
    """Every class, module and function under `folder` past its limit, named with its size."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(folder)
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) for item in node.body)
                if methods > MAX_METHODS:
                    found.append(f"{where}: class {node.name} has {methods} methods")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    found.append(f"{where}: {node.name} is {length} lines")
    return found


def test_the_supervisor_keeps_its_size_limits() -> None:
    """Every class, module and function of supervisor/ is within its limit."""
    assert oversized(SUPERVISOR) == []


def test_the_worker_keeps_its_size_limits() -> None:
    """Every class, module and function of worker/ is within the same limits."""
    assert WORKER.is_dir() and oversized(WORKER) == []


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("class Big:\n" + "".join(f"    def m{i}(self) -> None: ...\n" for i in range(26)), "class Big has 26 methods"),
        ("def long() -> None:\n" + "    x = 1\n" * 80, "long is 81 lines"),
        ("x = 1\n" * 601, "601 lines"),
    ],
)
def test_a_breach_of_a_size_limit_is_named(tmp_path: Path, source: str, named: str) -> None:
    """A class, function or module one past its limit is reported by name."""
    (tmp_path / "big.py").write_text(source)
    assert [f"big.py: {named}"] == oversized(tmp_path)
