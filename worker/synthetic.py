"""The daemon's own inputs for a model: drawn, seeded, as each input's spec declares (`inputs[].synthetic`).

Warm-up, the golden inputs profiles are checked on when no validation set is configured, the int8
calibration fallback and canaries all draw from here, so a mel spectrogram declared non-negative or
token ids declared in the vocabulary are what those see. Undeclared: N(0, 1) floats, ones for the
other dtypes (a valid token id, mask value, class index and boolean alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.tensors import TensorSpec

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


def describe(specs: Sequence[TensorSpec]) -> str:
    """What the synthetic samples are, e.g. `synthetic samples (mel: uniform 0..1)`."""
    declared = [f"{s.name}: {s.synthetic.describe()}" for s in specs if s.synthetic is not None]
    return "synthetic samples " + (f"({', '.join(declared)})" if declared else "(seeded N(0,1) floats, ones otherwise)")
