"""torch.export of a model with its declared dynamic dims, and the check that the program covers all of them.

The lowest part of building an exported profile: advice.py re-exports through it to find a range to declare, and
export.py wraps it with that advice, then quantizes and compiles.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from infervisor.common.text import clip
from infervisor.protocol.tensors import DimRange, TensorSpec
from infervisor.worker.profiles.export_dims import dynamic_shapes, export_low, traceable_example

Inputs = tuple[torch.Tensor, ...]
#: Each input of a program with the sizes each of its dims takes (loader.program_dims).
ProgramDims = list[tuple[str, list[DimRange | None]]]


class ExportError(Exception):
    """The model cannot go through torch.export / PT2E / AOTInductor; the message says what to change."""


def export_covering(module: Any, example: Inputs, specs: Sequence[TensorSpec]) -> torch.export.ExportedProgram:
    """torch.export of the module with the spec's dynamic dims; Uncovered when a guard breaks at a declared size."""
    try:
        with torch.no_grad():
            program = torch.export.export(
                module, traceable_example(example, specs), dynamic_shapes=dynamic_shapes(specs)
            )
    except Exception as exc:  # noqa: BLE001 - export fails in many ways on user models; each is a skip reason
        raise ExportError(clip(f"torch.export failed: {guard_words(f'{type(exc).__name__}: {exc}', specs)}")) from exc
    check_coverage(program, specs)
    return program


class Narrower(ExportError):
    """The program's range constraints are narrower than the config declares: each input's dims as it takes them."""

    def __init__(self, message: str, dims: list[tuple[str, list[tuple[int, int | None] | None]]]) -> None:
        super().__init__(message)
        self.dims = dims


class Uncovered(ExportError):
    """A guard of the exported program breaks at a declared size: where, and what part of the range it covers."""

    def __init__(self, message: str, position: int, index: int, covered: tuple[int, int] | None) -> None:
        super().__init__(message)
        self.position = position
        self.index = index
        #: The sizes from the range's start that the program covers (None: not even the start).
        self.covered = covered


#: How many sizes of one dim check_coverage tries when it looks for the part of a range a program covers.
_SCAN_SIZES = 2048


class _Size:
    """What a recorded guard reads of an input (`L['x'].size()[3]`): the sizes of one probed shape."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)

    def size(self) -> tuple[int, ...]:
        return self.shape

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))


def guard_words(text: str, specs: Sequence[TensorSpec]) -> str:
    """A raw guard (`L['x'].size()[3] <= 74`) as `x.shape[3] <= 74`, with what it means and what to do."""
    worded = re.sub(r"L\['([^']+)'\]\.size\(\)\[(\d+)\]", r"\1.shape[\2]", text)
    worded = re.sub(r"\b([A-Za-z_]\w*)\.size\(\)\[(\d+)\]", r"\1.shape[\2]", worded)
    if "Guard failed" in text or "Constraints violated" in text or "guard" in text.lower():
        declared = ", ".join(f"{s.name} {_shape_text(s)}" for s in specs)
        worded = (
            f"{clip(worded, 600)} (the compiled program only holds where that condition on the input sizes does, and "
            f"the config declares {declared}: declare only sizes where it holds, e.g. a fixed size or a narrower "
            "range, or take this profile out of the chain)"
        )
    return worded


def _shape_text(spec: TensorSpec) -> str:
    parts = []
    for dim in spec.config_shape():
        parts.append("[" + ", ".join("null" if part is None else str(part) for part in dim) + "]"
                     if isinstance(dim, list) else "null" if dim is None else str(dim))  # fmt: skip
    return "[" + ", ".join(parts) + "]"


def _holds(guards: Sequence[Any], names: Sequence[str], shapes: Sequence[Sequence[int]]) -> str | None:
    """The first recorded guard that these input shapes break (None: all hold, or none could be read).

    `names` are the program's own input names (the forward's arguments), which the guards read.
    """
    scope = {"L": {name: _Size(shape) for name, shape in zip(names, shapes, strict=True)}, "max": max, "min": min}
    for code, text in guards:
        try:
            if not eval(code, {"__builtins__": {}}, scope):  # noqa: S307 - torch's own guard text on our own export
                return str(text)
        except Exception:  # noqa: BLE001, S112 - a guard this cannot read says nothing either way
            continue
    return None


def _exported_shape(spec: TensorSpec) -> list[int]:
    """The spec's example shape as exported: batch 2, every other dynamic dim from export_low."""
    shape = list(spec.example_shape(2))
    for index, dim in enumerate(spec.shape):
        high = spec.dim_range(index)[1]
        if dim is None and index > 0 and (high is None or export_low(spec, index) <= high):
            shape[index] = max(shape[index], export_low(spec, index))
    return shape


def _probe(spec: TensorSpec, index: int, size: int) -> list[int]:
    """The spec's example shape as exported with dim `index` at `size`."""
    shape = _exported_shape(spec)
    shape[index] = size
    return shape


def _served_apart(found: list[tuple[str, list[DimRange | None]]], specs: Sequence[TensorSpec]) -> ProgramDims:
    """The program's dims with a range starting at export_low read as starting at the declared minimum: the sizes
    below are served apart from the program (dispatch.ShapeDispatch)."""
    dims: ProgramDims = []
    for position, (name, taken) in enumerate(found):
        spec = specs[position] if position < len(specs) else None
        read: list[DimRange | None] = []
        for index, bound in enumerate(taken):
            dynamic = spec is not None and index < len(spec.shape) and spec.shape[index] is None
            if bound is not None and dynamic and spec is not None and bound[0] == export_low(spec, index):
                bound = (min(bound[0], spec.dim_range(index)[0]), bound[1])
            elif bound is not None and bound[0] == 2:
                bound = (1, bound[1])
            read.append(bound)
        dims.append((name, read))
    return dims


def check_coverage(program: torch.export.ExportedProgram, specs: Sequence[TensorSpec]) -> None:
    """ExportError when the program covers less of a dynamic dim than the config declares, naming the range to declare.

    Two things say what a program covers: its range constraints, and the guards export recorded (an
    AOTInductor package checks neither at run time, so a size outside them is served wrong, not refused).
    Each dynamic dim is scanned over its declared range, the other dims at their example sizes.
    """
    from infervisor.worker.loader import ModelLoadError, check_program_dims, program_dims

    # A size of 1 (or of one step) is served apart from the program (ShapeDispatch), which was exported from 2.
    found = program_dims(program)
    dims = _served_apart(found, specs)
    names = [name for name, _ in found]
    try:
        check_program_dims(dims, specs)
    except ModelLoadError as exc:
        raise Narrower(f"torch.export covers less than the config declares: {exc}", dims) from exc
    codes = [str(code) for code in getattr(program, "_guards_code", None) or []]
    guards: list[tuple[Any, str]] = []
    for code in codes:
        try:
            guards.append((compile(code, "<guard>", "eval"), guard_words(code, ())))
        except SyntaxError:
            continue
    if not guards:
        return
    for position, spec in enumerate(specs):
        for index, dim in enumerate(spec.shape):
            low, high = spec.dim_range(index)
            step = spec.dim_step(index)
            start = export_low(spec, index)
            if dim is not None or index == 0 or (high is not None and high < start):
                continue
            end = start + _SCAN_SIZES * step if high is None else min(high, start + _SCAN_SIZES * step)

            def broken(size: int, index: int = index, position: int = position) -> str | None:
                shapes = [_probe(s, index, size) if i == position else list(s.example_shape(2))
                          for i, s in enumerate(specs)]  # fmt: skip
                return _holds(guards, names, shapes)

            sizes = range(start, end + 1, step)  # a dim in steps is never asked for a size off them
            first = next(((size, why) for size in sizes if (why := broken(size)) is not None), None)
            if first is None:
                continue
            size, why = first
            covered = f"[{start}, {size - step}]" if size > start else "no size"
            declared = f"[{low}, {'null' if high is None else high}{'' if step == 1 else f', {step}'}]"
            raise Uncovered(
                f"torch.export's program for inputs[{position}] {spec.name!r} dim {index} holds only where {why}, "
                f"which a size of {size} breaks: it covers {covered} of the declared {declared}",
                position,
                index,
                (start, size - step) if size > start else None,
            )
