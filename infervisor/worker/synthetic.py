"""The daemon's own inputs for a model: drawn, seeded, as each input's spec declares (`inputs[].synthetic`).

Warm-up, the golden inputs profiles are checked on when no validation set is configured, the int8
calibration fallback and canaries all draw from here, so a mel spectrogram declared non-negative or
token ids declared in the vocabulary are what those see. Undeclared: N(0, 1) floats, ones for the
other dtypes (a valid token id, mask value, class index and boolean alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infervisor.protocol.tensors import TensorSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def draw(spec: TensorSpec, shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """One tensor of `shape` for `spec`, from `generator`."""
    dtype = TORCH_DTYPES[spec.dtype]
    size = tuple(shape)
    synthetic = spec.synthetic
    if synthetic is None:
        if dtype.is_floating_point:
            return torch.randn(size, generator=generator).to(dtype)
        return torch.ones(size, dtype=dtype)
    if synthetic.distribution == "normal":
        values = torch.randn(size, generator=generator, dtype=torch.float64) * synthetic.b + synthetic.a
    elif synthetic.distribution == "uniform":
        values = torch.rand(size, generator=generator, dtype=torch.float64) * (synthetic.b - synthetic.a) + synthetic.a
    else:
        values = torch.randint(int(synthetic.a), int(synthetic.b), size, generator=generator, dtype=torch.int64)
    return values.to(dtype)


def synthetic_inputs(specs: Sequence[TensorSpec], batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of every spec (dynamic dims = `batch`, moved into their bounds), drawn in spec order from one seed."""
    generator = torch.Generator().manual_seed(seed)
    return {spec.name: draw(spec, spec.example_shape(batch), generator) for spec in specs}


def probe_sizes(low: int, high: int | None, step: int = 1) -> list[int]:
    """The sizes of a dynamic dim (not the batch) that the gate, warm-up and canaries draw besides its minimum.

    The minimum, the next odd size, an odd size in between, and the maximum when bounded or else a larger
    odd size (4 x the minimum + 1, or 17 from a minimum of 1): a compiled program can be right at one
    size and wrong at another (rounding in a ceil-mode pool, a size baked into a graph). A dim in steps
    draws the same counted in steps (min + k * step for those k from 0): never a size off its steps.
    """
    if step > 1:
        count = None if high is None else (high - low) // step
        larger = count if count is not None else max(2, 3 * low // step + 1)
        return [low + k * step for k in probe_sizes(0, larger) if count is None or k <= count]
    larger = high if high is not None else (4 * low + 1 if low > 1 else 17)
    odd = low + 1 if (low + 1) % 2 else low + 2
    middle = (low + larger) // 2 | 1
    sizes = [low, odd, middle, larger]
    inside = [size for size in sizes if high is None or size <= high]
    return list(dict.fromkeys(inside))


def dim_probe_sizes(spec: TensorSpec, index: int) -> list[int]:
    """probe_sizes of dim `index` of `spec`, over its range and on its steps."""
    return probe_sizes(*spec.dim_range(index), spec.dim_step(index))


def probe_shapes(specs: Sequence[TensorSpec], batch: int, turn: int) -> list[tuple[int, ...]]:
    """Each spec's shape with the batch (dim 0, when dynamic) at `batch` and every other dynamic dim at a size of
    probe_sizes: turn 0 is every range's minimum, turn k > 0 puts the j-th dynamic dim of a spec at its size
    (k + j) % n, so no two dims share a size by accident."""
    shapes: list[tuple[int, ...]] = []
    for spec in specs:
        shape: list[int] = []
        other = 0
        for index, dim in enumerate(spec.shape):
            low, high = spec.dim_range(index)
            if dim is not None:
                shape.append(dim)
            elif index == 0:
                shape.append(min(max(batch, low), high if high is not None else batch))
            else:
                sizes = dim_probe_sizes(spec, index)
                shape.append(sizes[(turn + other) % len(sizes)] if turn else low)
                other += 1
        shapes.append(tuple(shape))
    return shapes


def probed_inputs(specs: Sequence[TensorSpec], batch: int, turn: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs at probe_shapes(specs, batch, turn), drawn as each spec declares."""
    generator = torch.Generator().manual_seed(seed)
    shapes = probe_shapes(specs, batch, turn)
    return {spec.name: draw(spec, shape, generator) for spec, shape in zip(specs, shapes, strict=True)}


def probe_steps(specs: Sequence[TensorSpec]) -> int:
    """How many distinct probe turns (probe_shapes) the specs have (1: no dynamic dim besides the batch)."""
    counts = [len(dim_probe_sizes(s, i)) for s in specs for i, d in enumerate(s.shape) if d is None and i > 0]
    return max(counts, default=1)


def describe(specs: Sequence[TensorSpec]) -> str:
    """What the synthetic samples are, e.g. `synthetic samples (mel: uniform 0..1)`."""
    declared = [f"{s.name}: {s.synthetic.describe()}" for s in specs if s.synthetic is not None]
    return "synthetic samples " + (f"({', '.join(declared)})" if declared else "(seeded N(0,1) floats, ones otherwise)")
