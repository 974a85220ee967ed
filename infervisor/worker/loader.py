"""Turns a ModelSource into an eval-mode torch module."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infervisor.protocol.launch import ModelSource
from infervisor.protocol.tensors import DimRange, TensorSpec
from infervisor.worker.models import BUILTIN_OUTPUTS, build_builtin
from infervisor.worker.trusted_import import build_from_factory


class ModelLoadError(Exception):
    """The model could not be loaded; the worker exits with LOAD_FAILED."""


def load_model(source: ModelSource, specs: Sequence[TensorSpec] | None = None) -> Any:
    """Load the module the source names, in eval mode.

    An ExportedProgram knows the sizes each input dim takes (its range constraints): with `specs`, a
    config that promises more than that is refused here (ModelLoadError naming the shape to declare).
    """
    try:
        if source.kind == "builtin":
            return build_builtin(str(source.name))
        if source.kind == "python":
            # An eager model defined in code: a callable that returns the module, found on PYTHONPATH, in
            # site-packages, then in the config's directory (last, so it can shadow no installed package).
            # The config's directory is on the path only while the module is imported and its factory runs.
            return build_from_factory(str(source.name), source.search_dir).eval()
        path = Path(str(source.path))
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist")
        if source.kind == "torchscript":
            module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
            return module.eval()
        if source.kind == "exported":
            # An ExportedProgram's module() is a GraphModule; eval() on it is not supported, and it
            # needs none: export already captured inference behaviour.
            program = torch.export.load(str(path))
            if specs is not None:
                check_program_dims(program_dims(program), specs)
            return program.module()
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


def program_dims(program: torch.export.ExportedProgram) -> list[tuple[str, list[DimRange | None]]]:
    """Each user input of an ExportedProgram with the sizes each of its dims takes: (n, n) for a fixed dim, the
    range constraint of a dynamic one (max None: unbounded), None where the size is an expression of others."""
    # Here, not at the top: sympy costs a worker 33 MB and 0.2 s at start, and only a program's ranges need it.
    from torch.utils._sympy.numbers import int_oo

    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    inputs: list[tuple[str, list[DimRange | None]]] = []
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta.get("val") if name in placeholders else None
        dims: list[DimRange | None] = []
        for size in getattr(value, "shape", ()):
            if isinstance(size, int):
                dims.append((size, size))
                continue
            expr = size.node.expr
            if expr.is_number:
                dims.append((int(expr), int(expr)))
                continue
            bound = program.range_constraints.get(expr)
            if bound is None:
                dims.append(None)
                continue
            # torch's own infinity (int_oo) says it is finite; sympy's says it is not.
            upper = None if bound.upper == int_oo or not bound.upper.is_finite else int(bound.upper)
            dims.append((int(bound.lower), upper))
        inputs.append((name, dims))
    return inputs


def _config_dim(bound: DimRange) -> str:
    low, high = bound
    if low == high:
        return str(low)
    return "null" if bound == (1, None) else f"[{low}, {'null' if high is None else high}]"


def check_program_dims(program: list[tuple[str, list[DimRange | None]]], specs: Sequence[TensorSpec]) -> None:
    """ModelLoadError when a config dim allows sizes the program does not take (admission would let them through,
    and each profile would then fail or serve them differently); the message names the shape to declare."""
    if len(program) != len(specs):
        raise ModelLoadError(f"the exported program takes {len(program)} inputs; the config declares {len(specs)}")
    problems: list[str] = []
    for index, (spec, (name, dims)) in enumerate(zip(specs, program, strict=True)):
        if len(dims) != len(spec.shape):
            problems.append(f"inputs[{index}] {spec.name!r} has {len(spec.shape)} dims; the program's {name!r} has "
                            f"{len(dims)}")  # fmt: skip
            continue
        suggested: list[str] = []
        loose = False
        for position, taken in enumerate(dims):
            declared = spec.dim_range(position)
            if taken is None:  # sized by an expression of other dims: nothing to hold the config against
                suggested.append(_config_dim(declared))
                continue
            low, high = max(1, taken[0]), taken[1]  # the wire has no empty dims
            declared_low, declared_high = declared
            if declared_low < low or (high is not None and (declared_high is None or declared_high > high)):
                loose = True
            # What to declare: the config's range cut down to the program's (the program's when they do not meet).
            tight_low = max(declared_low, low)
            tight_high = high if declared_high is None else declared_high if high is None else min(declared_high, high)
            meet = tight_high is None or tight_low <= tight_high
            suggested.append(_config_dim((tight_low, tight_high) if meet else (low, high)))
        if loose:
            problems.append(
                f"inputs[{index}] {spec.name!r} shape {_shape_text(spec)} allows sizes the exported program refuses "
                f'(it takes {_program_text(dims)}); declare "shape": [{", ".join(suggested)}]'
            )
    if problems:
        raise ModelLoadError("; ".join(problems))


def _shape_text(spec: TensorSpec) -> str:
    return "[" + ", ".join(_config_dim(spec.dim_range(i)) for i in range(len(spec.shape))) + "]"


def _program_text(dims: list[DimRange | None]) -> str:
    return "[" + ", ".join("?" if d is None else _config_dim((max(1, d[0]), d[1])) for d in dims) + "]"
