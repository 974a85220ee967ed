"""The package layering declared as import-linter contracts in pyproject.toml holds, and the check catches a breach."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infervisor.supervisor import cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "common", "supervisor", "worker")
#: import-linter's own command line, run by this interpreter so the venv's import-linter and grimp are used.
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run the contracts of `root`/pyproject.toml on the packages under `root` (a fresh process: grimp finds
    packages through the import system, and this one has the repository's already imported)."""
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )


def copy_of_the_tree(destination: Path) -> Path:
    """The `infervisor` package with its four subpackages and pyproject.toml, copied so one module can be broken
    without touching the repository; returns the copy's `infervisor` folder."""
    package_root = destination / "infervisor"
    package_root.mkdir()
    shutil.copy(ROOT / "infervisor" / "__init__.py", package_root / "__init__.py")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, package_root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", destination / "pyproject.toml")
    return package_root


def add_line_after_future_import(module: Path, line: str) -> None:
    """Put `line` right after the module's `from __future__` import, where a real import would go."""
    text = module.read_text()
    anchor = "from __future__ import annotations\n"
    if anchor not in text:
        raise ValueError(f"{module} has no `from __future__ import annotations` line")
    module.write_text(text.replace(anchor, anchor + line + "\n", 1))


def test_the_packages_keep_their_layering() -> None:
    """protocol, common, supervisor and worker import only what the contracts allow, lazy imports included."""
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 4 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "offence"),
    [
        (
            "supervisor/commands/serve.py",
            "import infervisor.worker",
            "infervisor.supervisor.commands.serve -> infervisor.worker",
        ),
        (
            "supervisor/toolkit/doctor.py",
            "def _probe() -> object:\n    import torch\n\n    return torch",
            "infervisor.supervisor.toolkit.doctor -> torch",
        ),
        (
            "protocol/launch.py",
            "import infervisor.common.profiles",
            "infervisor.protocol.launch -> infervisor.common.profiles",
        ),
    ],
)
def test_a_forbidden_import_breaks_the_layering_and_is_named(
    tmp_path: Path, module: str, line: str, offence: str
) -> None:
    """One forbidden import added to a copy of the tree (a lazy one too) fails the check, which names the import."""
    package_root = copy_of_the_tree(tmp_path)
    add_line_after_future_import(package_root / module, line)
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert offence in done.stdout, done.stdout
    assert "Contracts: 3 kept, 1 broken." in done.stdout


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` imports by absolute name, lazy and TYPE_CHECKING imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith(f"{package}.")}


def test_the_daemon_core_and_the_toolkit_never_import_the_cli() -> None:
    """No arrow points up: the core imports neither the toolkit nor the CLI, and the toolkit never the CLI."""
    package = cli.__name__.removesuffix(".cli")
    folder = Path(cli.__file__).resolve().parent
    cli_side = (f"{package}.commands", f"{package}.cli", f"{package}.__main__")
    offences = []
    for path in sorted(folder.rglob("*.py")):
        part = path.relative_to(folder).parts[0].removesuffix(".py")
        if part in ("commands", "cli", "__main__"):
            continue
        above = cli_side if part == "toolkit" else (*cli_side, f"{package}.toolkit")
        offences += [f"{path.relative_to(folder)} -> {name}" for name in _imported_modules(path, package)
                     if any(name == up or name.startswith(f"{up}.") for up in above)]  # fmt: skip
    assert offences == []
