"""The operator's task-level check (`tolerance.task_check`): what no generic measure captures, such as which
detections a model's own post-processing keeps, judged by a function the operator names.

`module:function` is imported as a `python` model source is (trusted_import.py: only from files and folders other
users cannot write), and called on every golden case with eager's outputs and the profile's, each a dict of output
name -> numpy array (copies: the function cannot change the reference). It returns `(passed, reason)`; a failure,
an exception or any other return refuses the profile with the reason, and the case it was on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from infervisor.common.text import clip
from infervisor.worker.trusted_import import strict_imports

Array = np.ndarray[Any, Any]
CheckFunction = Callable[[dict[str, Array], dict[str, Array]], object]


class _Case(Protocol):
    @property
    def label(self) -> str: ...


class TaskCheck:
    """One configured check, imported on first use."""

    def __init__(self, dotted: str, search_dir: str | None) -> None:
        self.dotted = dotted
        self.search_dir = search_dir
        self._function: CheckFunction | None = None

    def _load(self) -> CheckFunction:
        if self._function is None:
            module_name, _, attribute = self.dotted.partition(":")
            with strict_imports(self.search_dir):
                function = getattr(importlib.import_module(module_name), attribute)
            if not callable(function):
                raise TypeError(f"{self.dotted} is a {type(function).__name__}, not a function")
            self._function = function
        return self._function

    def failure(
        self,
        cases: Sequence[_Case],
        references: Sequence[Sequence[Array]],
        candidates: Sequence[Sequence[Array]],
        names: Sequence[str],
    ) -> str | None:
        """Why the check refuses the profile (the first case it fails on), or None when it passes every case."""
        try:
            function = self._load()
        except Exception as exc:  # noqa: BLE001 - any import failure refuses the profile with its reason
            return clip(f"task check {self.dotted} could not be imported: {type(exc).__name__}: {exc}")
        for case, want, got in zip(cases, references, candidates, strict=True):
            eager = {name: array.copy() for name, array in zip(names, want, strict=True)}
            profile = {name: array.copy() for name, array in zip(names, got, strict=True)}
            try:
                result = function(eager, profile)
            except Exception as exc:  # noqa: BLE001 - the operator's code: its failure is a refusal, never a crash
                return clip(f"task check {self.dotted} raised on {case.label}: {type(exc).__name__}: {exc}")
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool | np.bool_)):
                return clip(f"task check {self.dotted} returned {result!r} on {case.label}, not (passed, reason)")
            if not result[0]:
                return clip(f"task check {self.dotted} failed on {case.label}: {result[1]}")
        return None
