"""Whether a `{"python": "package.module:factory"}` model's module can be found, without importing anything.

The supervisor never imports model code (it would pull torch into the daemon), so it walks the
import path the way a worker's import system would and checks that each package and the module
exist: a misspelt module is then a refused reload instead of a worker that cannot start.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

from infervisor.common.strict_modes import spec_problem


def worker_import_path(config_dir: Path) -> list[str]:
    """A worker's import path: PYTHONPATH, the interpreter's own (site-packages), then the config's directory.

    Workers start with `python -P`, so no working directory is on it: a `common.py` or `supervisor/` lying
    where the daemon was started can neither break a worker nor run in it.
    """
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = {"", os.getcwd()}
    interpreter = [p for p in sys.path if p not in here and p not in python_path and not p.endswith(("/bin", "\\bin"))]
    return [*python_path, *interpreter, str(config_dir)]


def module_missing(dotted: str, config_dir: Path) -> str | None:
    """Why `dotted` would not import in a worker of a config in `config_dir`, or None if found."""
    path: list[str] | None = worker_import_path(config_dir)
    found = ""
    for part in dotted.split("."):
        name = f"{found}.{part}" if found else part
        spec: ModuleSpec | None
        if found:
            spec = PathFinder.find_spec(name, path)
        else:
            # Top level: every finder may answer (an editable install maps a package from outside the path),
            # and finding a top-level name imports nothing.
            spec = PathFinder.find_spec(name, path) or _meta_path_spec(name)
        if spec is None:
            where = f"package {found!r}" if found else "PYTHONPATH, site-packages or the config's directory"
            return f"no module {name!r} in {where}"
        unsafe = spec_problem(spec)
        if unsafe is not None:
            return unsafe
        found = name
        locations = spec.submodule_search_locations
        path = list(locations) if locations is not None else None
        if path is None and name != dotted:
            return f"{name!r} is a module, not a package, so it has no {dotted[len(name) + 1 :]!r}"
    return None


def _meta_path_spec(name: str) -> ModuleSpec | None:
    """A top-level name found by an import hook other than the path (an editable install's finder), or None."""
    for finder in sys.meta_path:
        if finder is PathFinder or not hasattr(finder, "find_spec"):
            continue
        spec: ModuleSpec | None = finder.find_spec(name, None)
        if spec is not None:
            return spec
    return None
