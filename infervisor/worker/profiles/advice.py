"""The range to declare for a dim a compiled program does not cover, printed only once a re-export covered it.

A guard export recorded says where the program holds for the example it was traced at, and the example sits at the
range's minimum: declaring the part of the range the first program covered can trace another program with other
guards (a model branching on `size % 12` holds at 12 alone when traced there, and at 13..23 when traced at 13). So
each proposal is exported again with the dim declared as proposed, and only one whose program covers it all is
printed; a refused proposal leads to the next (the sizes above what it covered, then the single size it covered).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.covered_export import ExportError, Inputs, Narrower, Uncovered, export_covering

#: Re-exports tried before saying no proposal held (each is a full trace of the model).
_TRIES = 4

Proposal = tuple[int, int | None]


def checked_advice(module: Any, example: Inputs, specs: tuple[TensorSpec, ...], first: Uncovered | Narrower) -> str:
    """`declare the range [13, 74] for that dim ...` for a range a re-export covered, or what was tried."""
    if isinstance(first, Uncovered):
        return _search(module, example, specs, first)
    tight = _tightened(first.dims, specs)
    fitted = _fitted(example, tight)
    try:
        export_covering(module, fitted, tight)
    except Uncovered as again:
        return f"that shape exported again: {again}; {_search(module, fitted, tight, again)}"
    except ExportError as exc:
        return f"that shape exported again was refused too ({exc}): take this profile out of the chain"
    return "exported again with that shape: covered"


def _search(module: Any, example: Inputs, specs: tuple[TensorSpec, ...], first: Uncovered) -> str:
    """Proposals for the dim `first` names, each exported again, until one is covered (at most _TRIES)."""
    spec = specs[first.position]
    low, high = spec.dim_range(first.index)
    queue: deque[Proposal] = deque(_next(first.covered, (max(2, low), high)))
    tried: list[Proposal] = []
    while queue and len(tried) < _TRIES:
        proposal = queue.popleft()
        # A dim in steps is only proposed sizes on its steps (covered ranges end on them; `last + 1` does not).
        proposal = (spec.on_step(first.index, proposal[0]), proposal[1])
        if proposal in tried or (proposal[1] is not None and proposal[1] < proposal[0]):
            continue
        tried.append(proposal)
        narrowed = _narrowed(specs, first.position, first.index, proposal)
        resized = _resized(example, first.position, first.index, proposal[0])
        try:
            export_covering(module, resized, narrowed)
        except Uncovered as again:
            queue.extendleft(reversed(_next(again.covered, proposal)))
            continue
        except ExportError:
            continue
        step = spec.dim_step(first.index)
        shown = _text(proposal, low, step)
        earlier = ", ".join(_text(p, low, step) for p in tried[:-1])
        before = f"; {earlier} exported again was not" if len(tried) > 1 else ""
        what = "a fixed size" if proposal[1] == proposal[0] else "the range"
        return (
            f"declare {what} {shown} for that dim (exported again with it, the program covers it{before}), or take "
            "this profile out of the chain"
        )
    listed = ", ".join(_text(p, low, spec.dim_step(first.index)) for p in tried) or "nothing"
    return (
        f"no range to declare was found: exported again with {listed}, each was refused; declare a fixed size the "
        "model serves, or take this profile out of the chain"
    )


def _next(covered: tuple[int, int] | None, exported: Proposal) -> list[Proposal]:
    """What to try after a program traced over `exported` covered only `covered` of it."""
    start, high = exported
    if covered is None:
        return [(start + 1, high)] if high is None or start + 1 <= high else []
    first, last = covered
    if last > first:
        return [(first, last)]
    above: list[Proposal] = [(last + 1, high)] if high is None or last + 1 <= high else []
    return [*above, (last, last)]


def _text(proposal: Proposal, declared_low: int, step: int = 1) -> str:
    low, high = proposal
    if high == low:
        return str(low)
    # Export starts at 2 (a size of 1 is served apart): a declared 1 is as covered as 2; a single step likewise.
    shown_low = declared_low if low == max(2, declared_low) or (step > 1 and low <= declared_low + step) else low
    return f"[{shown_low}, {'null' if high is None else high}{'' if step == 1 else f', {step}'}]"


def _narrowed(specs: tuple[TensorSpec, ...], position: int, index: int, proposal: Proposal) -> tuple[TensorSpec, ...]:
    spec = specs[position]
    shape = list(spec.shape)
    bounds = [spec.bounds[i] if i < len(spec.bounds) else None for i in range(len(shape))]
    if proposal[1] == proposal[0]:
        shape[index], bounds[index] = proposal[0], None
    else:
        bounds[index] = proposal
    narrowed = dataclasses.replace(spec, shape=tuple(shape), bounds=tuple(bounds))
    return tuple(narrowed if i == position else s for i, s in enumerate(specs))


def _resized(example: Inputs, position: int, index: int, size: int) -> Inputs:
    """The example with one input's dim at `size` (repeated copies of its values, then cut)."""
    tensor = example[position]
    repeats = math.ceil(size / max(1, tensor.shape[index]))
    grown = torch.cat([tensor] * repeats, dim=index) if repeats > 1 else tensor
    return tuple(grown.narrow(index, 0, size).contiguous() if i == position else t for i, t in enumerate(example))


def _tightened(
    dims: list[tuple[str, list[tuple[int, int | None] | None]]], specs: tuple[TensorSpec, ...]
) -> tuple[TensorSpec, ...]:
    """The specs cut down to the program's ranges (loader.check_program_dims says the same shape in words)."""
    narrowed: list[TensorSpec] = []
    for spec, (_, taken_dims) in zip(specs, dims, strict=True):
        shape = list(spec.shape)
        bounds = [spec.bounds[i] if i < len(spec.bounds) else None for i in range(len(shape))]
        for index, taken in enumerate(taken_dims):
            if taken is None or spec.shape[index] is not None:
                continue
            low, high = spec.dim_range(index)
            tight_low = max(low, max(1, taken[0]))
            tight_high = taken[1] if high is None else high if taken[1] is None else min(high, taken[1])
            if tight_high is not None and tight_high < tight_low:
                tight_low, tight_high = max(1, taken[0]), taken[1]
            if tight_high == tight_low:
                shape[index], bounds[index] = tight_low, None
            else:
                bounds[index] = (tight_low, tight_high)
        narrowed.append(dataclasses.replace(spec, shape=tuple(shape), bounds=tuple(bounds)))
    return tuple(narrowed)


def _fitted(example: Inputs, specs: tuple[TensorSpec, ...]) -> Inputs:
    """The example with every dim other than the batch at the size the specs' example shape gives it."""
    fitted = list(example)
    for position, spec in enumerate(specs):
        want = spec.example_shape(fitted[position].shape[0] if fitted[position].dim() else 1)
        for index in range(1, len(want)):
            if fitted[position].shape[index] != want[index]:
                fitted = list(_resized(tuple(fitted), position, index, want[index]))
    return tuple(fitted)
