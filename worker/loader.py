"""Turns a ModelSource into an eval-mode torch module."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from protocol.launch import ModelSource
from worker.models import BUILTIN_OUTPUTS, build_builtin


class ModelLoadError(Exception):
    """The model could not be loaded; the worker exits with LOAD_FAILED."""


def load_model(source: ModelSource) -> Any:
    """Load the module the source names, in eval mode."""
    try:
        if source.kind == "builtin":
            return build_builtin(str(source.name))
        if source.kind == "python":
            # An eager model defined in code: a callable that returns the module (found on sys.path).
            module_name, _, attribute = str(source.name).partition(":")
            factory = getattr(importlib.import_module(module_name), attribute)
            return factory().eval()
        path = Path(str(source.path))
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist")
        if source.kind == "torchscript":
            module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
            return module.eval()
        if source.kind == "exported":
            # An ExportedProgram's module() is a GraphModule; eval() on it is not supported, and it
            # needs none: export already captured inference behaviour.
            return torch.export.load(str(path)).module()
    except ModelLoadError:
        raise
    except Exception as exc:  # any loader failure is reported, whatever torch raised
        raise ModelLoadError(f"{source.kind} model failed to load: {type(exc).__name__}: {exc}") from exc
    raise ModelLoadError(f"unknown model source kind {source.kind!r}")


def default_output_names(source: ModelSource) -> tuple[str, ...] | None:
    """Output names of a built-in, or None to derive `output`, `output_1`, ... from the result."""
    if source.kind == "builtin" and source.name in BUILTIN_OUTPUTS:
        return BUILTIN_OUTPUTS[source.name]
    return None
