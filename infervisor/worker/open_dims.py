"""What minimum to declare for open dims a model refuses at the size the daemon draws them at, found and checked.

The daemon's own inputs (the state check, warm-up, the gate, canaries) put each dynamic dim at its range's minimum,
so an open dim (`null`) is drawn at 1. A model that needs more (a conv kernel, a reflect pad of 432 audio samples)
fails there with a raw torch error; the load path reports instead the smallest size it runs at, searched by doubling
then bisecting (sizes into the hundreds of thousands: audio samples), and only after the model has also run at every
size the daemon would draw from the proposed range (synthetic.probe_sizes): advice that works in one step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.runner import ModelRunner
from infervisor.worker.synthetic import draw, probe_sizes

#: The largest size tried for an open dim, and the most elements the inputs of one try may hold (two open dims of
#: an image stop near 1180 x 1180 x 3: a model failing for another reason is not run at every size).
_MAX_SIZE = 1 << 20
_MAX_ELEMENTS = 1 << 22
#: Proposals checked over the proposed range before giving up (each failure raises the minimum past it).
_ROUNDS = 4

OpenDims = list[tuple[TensorSpec, list[int]]]


def open_dims(specs: Sequence[TensorSpec]) -> OpenDims:
    """Each spec with the indexes of its dynamic dims other than the batch."""
    return [(s, [i for i, d in enumerate(s.shape) if d is None and i > 0]) for s in specs]


def _runs(runner: ModelRunner, dims: OpenDims, size: int) -> bool | None:
    """Whether the model runs with every open dim at `size` (batch 1; a dim in steps at the first of its sizes from
    `size` up); None when the inputs would be too large."""
    generator = torch.Generator().manual_seed(0)
    inputs: dict[str, torch.Tensor] = {}
    for spec, indexes in dims:
        shape = [spec.on_step(i, size) if i in indexes else n for i, n in enumerate(spec.example_shape(1))]
        if math.prod(shape) > _MAX_ELEMENTS:
            return None
        inputs[spec.name] = draw(spec, shape, generator)
    try:
        runner.forward(inputs)
    except Exception:  # noqa: BLE001 - any failure at this size: the model does not run there
        return False
    return True


def smallest_size(runner: ModelRunner, dims: OpenDims, low: int, high: int | None) -> int | None:
    """The smallest size in [low, high] the model runs at (doubling to a size it runs at, then bisecting)."""
    limit = _MAX_SIZE if high is None else min(high, _MAX_SIZE)
    failed, size = low - 1, low
    while True:
        ran = _runs(runner, dims, size)
        if ran is None:
            return None
        if ran:
            break
        if size >= limit:
            return None
        failed, size = size, min(size * 2, limit)
    while size - failed > 1:  # the model fails at `failed`, runs at `size`
        middle = (failed + size) // 2
        if _runs(runner, dims, middle):
            size = middle
        else:
            failed = middle
    return size


def _high(dims: OpenDims) -> int | None:
    """The tightest declared maximum of the open dims (None: unbounded)."""
    highs = [h for spec, indexes in dims for i in indexes if (h := spec.dim_range(i)[1]) is not None]
    return min(highs) if highs else None


def _step(dims: OpenDims) -> int:
    """The step the open dims share (1 when none is stepped or they differ: _runs puts each on its own)."""
    steps = {spec.dim_step(i) for spec, indexes in dims for i in indexes}
    return steps.pop() if len(steps) == 1 else 1


def open_dim_hint(runner: ModelRunner) -> str | None:
    """What minimum to declare when the model cannot run its open dims at the minimum the config gives them, as a
    config shape the model was seen to run at over every size the daemon draws from it; None when it has no open
    dim, runs at the declared minimum, or no checked minimum was found."""
    dims = [(spec, indexes) for spec, indexes in open_dims(runner.specs) if indexes]
    if not dims:
        return None
    declared = max(spec.dim_range(i)[0] for spec, indexes in dims for i in indexes)
    high = _high(dims)
    low = declared
    for _ in range(_ROUNDS):
        found = smallest_size(runner, dims, low, high)
        if found is None:
            return None
        found = max(spec.on_step(i, found) for spec, indexes in dims for i in indexes)
        refused = [size for size in probe_sizes(found, high, _step(dims)) if not _runs(runner, dims, size)]
        if not refused:
            # Running at every size drawn from the declared range: the failure was not the sizes.
            return None if found == declared else _advice(dims, declared, found, high)
        low = max(refused) + 1
    return None


def _advice(dims: OpenDims, declared: int, found: int, high: int | None) -> str:
    upper = "null" if high is None else str(high)
    shapes = []
    for spec, indexes in dims:
        parts = [_proposed(spec, i, found, upper) if i in indexes else _dim_text(d)
                 for i, d in enumerate(spec.config_shape())]  # fmt: skip
        shapes.append(f'{spec.name!r}: "shape": [{", ".join(parts)}]')
    checked = ", ".join(str(size) for size in probe_sizes(found, high, _step(dims)))
    return (
        f"open dims are warmed up and checked from their declared minimum, {declared}, which this model refuses; it "
        f"runs from {found} (checked at {checked}, the sizes the daemon draws from that range): declare a minimum, "
        f"e.g. {'; '.join(shapes)}"
    )


def _proposed(spec: TensorSpec, index: int, found: int, upper: str) -> str:
    """`[found, max]`, or `[found, max, step]` for a dim in steps (found put on them: its max stays on them too)."""
    step = spec.dim_step(index)
    return f"[{found}, {upper}]" if step == 1 else f"[{spec.on_step(index, found)}, {upper}, {step}]"


def _dim_text(dim: int | None | list[int | None]) -> str:
    if isinstance(dim, list):
        return "[" + ", ".join("null" if part is None else str(part) for part in dim) + "]"
    return "null" if dim is None else str(dim)


def hinted(error: str, runner: Callable[[], ModelRunner]) -> str:
    """A load failure's text with what minimum to declare when the open dims' sizes caused it (`runner` gives an
    eager runner; it is only built when the specs have an open dim, and any failure to build it adds nothing)."""
    try:
        built = runner()
        if not any(indexes for _, indexes in open_dims(built.specs)):
            return error
        hint = open_dim_hint(built)
    except Exception:  # noqa: BLE001 - the hint is advice: the original error is what must reach status
        return error
    return f"{error} ({hint})" if hint else error
