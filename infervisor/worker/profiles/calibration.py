"""The inputs static int8 quantization observes: a configured .npz set, or seeded synthetic inputs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infervisor.common.sample_groups import PLAIN, GroupError, group_name, round_robin, sample_groups
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.synthetic import draw

Inputs = tuple[torch.Tensor, ...]

#: Enough samples for the observers' min/max to settle; more only lengthens the first start.
MAX_SAMPLES = 128
RANDOM_SAMPLES = 16


class CalibrationError(Exception):
    """The calibration set does not fit the model's input spec; the message says how."""


def load_calibration(path: Path, specs: Sequence[TensorSpec]) -> list[Inputs]:
    """One batch-1 input tuple per sample of an .npz holding one array per input and shape group
    (infervisor/common/sample_groups.py), samples along dim 0; at most MAX_SAMPLES, taken from the groups in turn.

    Samples of different groups may differ in the open dims: whoever batches them groups them by shape.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            groups = sample_groups(list(archive.files), [s.name for s in specs])
            arrays = {key: archive[key] for members in groups.values() for key in members.values()}
    except GroupError as exc:
        raise CalibrationError(f"calibration set {path} {exc}") from exc
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"cannot read calibration set {path}: {exc}") from exc
    counts = [
        _checked_group(path, label, [arrays[members[s.name]] for s in specs], specs)
        for label, members in groups.items()
    ]
    keys = [[members[s.name] for s in specs] for members in groups.values()]
    return [
        tuple(torch.from_numpy(np.ascontiguousarray(arrays[key][i : i + 1])) for key in keys[group])
        for group, i in round_robin(counts, MAX_SAMPLES)
    ]


def _checked_group(path: Path, label: str, arrays: list[np.ndarray[Any, Any]], specs: Sequence[TensorSpec]) -> int:
    """The group's sample count, once its arrays fit the specs and share it."""
    where = "" if label == PLAIN else f" ({group_name(label)})"
    counts = {array.shape[0] if array.ndim else 0 for array in arrays}
    if len(counts) != 1 or 0 in counts:
        raise CalibrationError(f"calibration arrays in {path}{where} must share a non-empty first (sample) dimension")
    for spec, array in zip(specs, arrays, strict=True):
        fits = array.dtype.name == spec.dtype and array.ndim == len(spec.shape)
        if not fits or any(w is not None and w != g for w, g in zip(spec.shape[1:], array.shape[1:], strict=True)):
            raise CalibrationError(
                f"calibration array {spec.name!r}{where} is {array.dtype.name}{list(array.shape)}, "
                f"expected {spec.describe()}"
            )
    return counts.pop()


def random_calibration(example: Inputs, specs: Sequence[TensorSpec] | None = None) -> list[Inputs]:
    """Seeded synthetic inputs shaped like the example, drawn as each spec declares (infervisor/worker/synthetic.py).

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
