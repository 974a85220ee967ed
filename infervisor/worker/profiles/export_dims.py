"""torch.export's view of the declared dims: the example it traces and the Dim each dynamic dim is exported as.

A dim of any size is `Dim.DYNAMIC` over its range; a dim in steps is `step * Dim(...) + offset` over its count of
steps, so the program knows every size is on them. Both start where export does not specialise: 2, or two steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from infervisor.protocol.tensors import TensorSpec

Inputs = tuple[torch.Tensor, ...]


def export_low(spec: TensorSpec, index: int) -> int:
    """The smallest size of dynamic dim `index` the dynamic program is exported for: 2 or the declared minimum for a
    dim of any size, the size of 2 steps or more for a dim in steps (export specialises a 1 into a constant, the
    count of steps as well). Smaller sizes are served apart (ShapeDispatch)."""
    low, _ = spec.dim_range(index)
    step = spec.dim_step(index)
    if step == 1:
        return max(2, low)
    return low % step + max(2, low // step) * step


def traceable_example(example: Inputs, specs: Sequence[TensorSpec]) -> Inputs:
    """The example with every dynamic dim below export_low grown to it (copies of its values, then cut): export
    would specialise a 1 (or a single step) into a constant."""
    grown: list[torch.Tensor] = []
    for tensor, spec in zip(example, specs, strict=True):
        for index, dim in enumerate(spec.shape):
            high = spec.dim_range(index)[1]
            want = export_low(spec, index)
            if dim is None and tensor.shape[index] < want and (high is None or want <= high):
                repeats = -(-want // tensor.shape[index])
                tensor = torch.cat([tensor] * repeats, dim=index).narrow(index, 0, want).contiguous()
        grown.append(tensor)
    return tuple(grown)


def _dim(spec: TensorSpec, index: int, high: int | None) -> Any:
    """Export's Dim for a dynamic dim: DYNAMIC over its range, or for a dim in steps `step * Dim(...) + offset`
    over its count of steps (export then knows every size is on them, and refuses a model that needs others)."""
    step = spec.dim_step(index)
    low = export_low(spec, index)
    if step == 1:
        return torch.export.Dim.DYNAMIC(min=low, max=high)
    offset = low % step
    name = re.sub(r"\W", "_", f"{spec.name}_{index}_steps")
    count = torch.export.Dim(name, min=low // step, max=None if high is None else (high - offset) // step)
    return step * count + offset if offset else step * count


def dynamic_shapes(specs: Sequence[TensorSpec]) -> tuple[dict[int, Any], ...]:
    """Export's dynamic_shapes for the spec: each dynamic dim over its declared range (from export_low).

    DYNAMIC, not AUTO: AUTO silently bakes a dim the model forces to one size into a constant, and a
    package does not check input shapes at run time (a wrong size reads out of bounds). DYNAMIC makes
    export refuse instead, which skips the profile with the reason. Related dims (input_ids and
    attention_mask sharing a batch) are still tied together by export. The declared bounds go in, so
    the program's range constraints say what it covers of the declared range (check_coverage); the
    minimum is at least 2, as export specialises a size of 1 (ShapeDispatch serves it another way). A dim
    in steps is a multiple of a Dim (its count of steps), from 2 steps.
    """
    shapes: list[dict[int, Any]] = []
    for spec in specs:
        dims: dict[int, Any] = {}
        for index, dim in enumerate(spec.shape):
            _, high = spec.dim_range(index)
            if dim is None and (high is None or high > export_low(spec, index) or
                                (spec.dim_step(index) == 1 and high >= 2)):  # fmt: skip
                dims[index] = _dim(spec, index, high)
        shapes.append(dims)
    return tuple(shapes)
