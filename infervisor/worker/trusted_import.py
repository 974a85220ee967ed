"""Importing a `{"python": "module:factory"}` model: only from files and folders other users cannot write.

While the model's module is imported and its factory runs, a finder in front of the path finder refuses
every module (the model's own, and whatever it imports that is not loaded yet) whose file or folder fails
the strict modes (infervisor/common/strict_modes.py). The config's folder is on the import path for that
time only, last: once the factory has returned it is taken off again, so a later optional import of a
missing name (torch does several) can never resolve to a file lying there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

from infervisor.common.strict_modes import spec_problem


class RefusedModule(ImportError):
    """A module's file or folder is writable by another user (or owned by one); the message says which."""


class _StrictPathFinder:
    """The path finder, except that a module found in an unsafe place raises RefusedModule instead of loading."""

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        spec = PathFinder.find_spec(name, path, target)
        if spec is None:
            return None
        problem = spec_problem(spec)
        if problem is not None:
            raise RefusedModule(problem, name=name)
        return spec

    @staticmethod
    def invalidate_caches() -> None:
        PathFinder.invalidate_caches()


@contextmanager
def strict_imports(search_dir: str | None) -> Iterator[None]:
    """Within: imports go through the strict finder, and `search_dir` (if any) is on the path, last."""
    finder = _StrictPathFinder()
    position = sys.meta_path.index(PathFinder) if PathFinder in sys.meta_path else 0
    sys.meta_path.insert(position, finder)
    added = search_dir is not None and search_dir not in sys.path
    if added:
        sys.path.append(str(search_dir))
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        if added:
            sys.path.remove(str(search_dir))
            sys.path_importer_cache.pop(str(search_dir), None)


def build_from_factory(dotted: str, search_dir: str | None) -> Any:
    """Import `module:factory` under the strict finder and call the factory; its result as it returned it."""
    module_name, _, attribute = dotted.partition(":")
    with strict_imports(search_dir):
        factory: Callable[[], Any] = getattr(importlib.import_module(module_name), attribute)
        return factory()
