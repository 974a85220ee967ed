"""Whether a `{"python": "package.module:factory"}` model's module can be found, without importing anything.

The supervisor never imports model code (it would pull torch into the daemon), so it walks the
import path the way the import system would and checks that each package and the module exist:
a misspelt module is then a refused reload instead of a worker that cannot start.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec, PathFinder


def module_missing(dotted: str) -> str | None:
    """Why `dotted` would not import in a worker started from here (same cwd and PYTHONPATH), or None if found."""
    if dotted in sys.modules:
        return None
    # A worker runs `python -m infervisor.worker` from our working directory: that directory comes first on its path.
    path: list[str] | None = [os.getcwd(), *sys.path]
    found = ""
    for part in dotted.split("."):
        name = f"{found}.{part}" if found else part
        spec: ModuleSpec | None
        if found:
            spec = PathFinder.find_spec(name, path)
        else:
            # Top level: every finder may answer (an editable install maps a package from outside the path),
            # and finding a top-level name imports nothing.
            spec = PathFinder.find_spec(name, path) or importlib.util.find_spec(name)
        if spec is None:
            where = f"package {found!r}" if found else "the import path (working directory, PYTHONPATH, site-packages)"
            return f"no module {name!r} in {where}"
        found = name
        locations = spec.submodule_search_locations
        path = list(locations) if locations is not None else None
        if path is None and name != dotted:
            return f"{name!r} is a module, not a package, so it has no {dotted[len(name) + 1 :]!r}"
    return None
