"""The inputs static int8 quantization observes: a configured .npz set, or seeded synthetic inputs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.synthetic import draw

Inputs = tuple[torch.Tensor, ...]

#: Enough samples for the observers' min/max to settle; more only lengthens the first start.
MAX_SAMPLES = 128
RANDOM_SAMPLES = 16


class CalibrationError(Exception):
    """The calibration set does not fit the model's input spec; the message says how."""


def load_calibration(path: Path, specs: Sequence[TensorSpec]) -> list[Inputs]:
    """One batch-1 input tuple per sample of an .npz holding one array per input, samples along dim 0."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"cannot read calibration set {path}: {exc}") from exc
    missing = [s.name for s in specs if s.name not in arrays]
    if missing:
        raise CalibrationError(f"calibration set {path} lacks arrays for inputs {missing}; it has {sorted(arrays)}")
    counts = {arrays[s.name].shape[0] if arrays[s.name].ndim else 0 for s in specs}
    if len(counts) != 1 or 0 in counts:
        raise CalibrationError(f"calibration arrays in {path} must share a non-empty first (sample) dimension")
    for spec in specs:
        array = arrays[spec.name]
        if array.dtype.name != spec.dtype or array.ndim != len(spec.shape):
            raise CalibrationError(
                f"calibration array {spec.name!r} is {array.dtype.name}{list(array.shape)}, expected {spec.describe()}"
            )
        for want, got in zip(spec.shape[1:], array.shape[1:], strict=True):
            if want is not None and want != got:
                raise CalibrationError(
                    f"calibration array {spec.name!r} has shape {list(array.shape)}, expected {spec.describe()}"
                )
    samples = min(counts.pop(), MAX_SAMPLES)
    return [
        tuple(torch.from_numpy(np.ascontiguousarray(arrays[s.name][i : i + 1])) for s in specs) for i in range(samples)
    ]


def random_calibration(example: Inputs, specs: Sequence[TensorSpec] | None = None) -> list[Inputs]:
    """Seeded synthetic inputs shaped like the example, drawn as each spec declares (worker/synthetic.py).

    Without specs: floats N(0,1), integer inputs kept as they are. Seeds 1..16 differ from the golden
    inputs' (0, 1001, ...) so validation is not scored on the data that set the scales.
    """
    samples: list[Inputs] = []
    for seed in range(1, RANDOM_SAMPLES + 1):
        generator = torch.Generator().manual_seed(seed)
        if specs is not None:
            samples.append(tuple(draw(s, t.shape, generator) for s, t in zip(specs, example, strict=True)))
            continue
        samples.append(
            tuple(
                torch.randn(t.shape, generator=generator).to(t.dtype) if t.is_floating_point() else t.clone()
                for t in example
            )
        )
    return samples


def random_calibration_id(specs: Sequence[TensorSpec]) -> str:
    """What identifies the synthetic calibration data in a package's key: "random", plus any declared distribution."""
    declared = {s.name: s.synthetic.to_config() for s in specs if s.synthetic is not None}
    return "random" if not declared else "random:" + json.dumps(declared, sort_keys=True)
