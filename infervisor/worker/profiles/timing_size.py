"""At which input size pick "fastest" times its candidates: the size that is served, not the smallest declared.

A camera box declares `[null, 3, [64, 640], [64, 640]]` and serves 480x640; timed at the example (64x64) a profile
with a fixed cost per call can win where a profile whose cost grows faster with the image is the one to serve. So
the timing runs at, in order: the model's `typical_shape` (what the operator says is served), else the served shape
mix the supervisor recorded (recorded.py: one timed call runs a recorded request of each of the most served groups,
each repeated in proportion to how often it is served, so a candidate's time is the served mix's), else the largest
shape group of the validation set (common/sample_groups.py: real inputs at the sizes the operator cares about),
else, as before, the declared example at each batch size the model serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.calibration import Inputs
from infervisor.worker.profiles.recorded import ServedInputs
from infervisor.worker.synthetic import draw, synthetic_inputs

#: Calls one timed run of the served mix makes, shared among its groups by how often each is served.
MIX_CALLS = 8
#: Seed of the inputs drawn at a typical shape (apart from the warm-up's and the gate's).
_TYPICAL_SEED = 3000


@dataclass(frozen=True)
class TimingSize:
    """The inputs each timed batch size runs, and what they are (status's `timed_at`)."""

    inputs: dict[int, dict[str, torch.Tensor]]
    #: e.g. `3x480x640 (typical_shape)`, `3x128x128 (the validation set's largest shape group)`.
    text: str
    #: Timed at the served mix: the requests one timed call runs, in order (inputs[1] is the first of them).
    mix: tuple[dict[str, torch.Tensor], ...] = ()

    @property
    def batches(self) -> tuple[int, ...]:
        """The batch sizes timed."""
        return tuple(sorted(self.inputs))


def timing_size(
    specs: Sequence[TensorSpec],
    batches: Sequence[int],
    validation: Sequence[Inputs] | None,
    typical: Mapping[str, Sequence[int]] | None,
    served: ServedInputs | None = None,
) -> TimingSize:
    """The inputs to time at (see the module's docstring); `batches`: the served batch sizes of the default."""
    if typical:
        generator = torch.Generator().manual_seed(_TYPICAL_SEED)
        drawn = {spec.name: draw(spec, typical[spec.name], generator) for spec in specs}
        return TimingSize({int(next(iter(drawn.values())).shape[0]): drawn}, f"{_shape_text(drawn)} (typical_shape)")
    open_dims = any(None in spec.shape[1:] for spec in specs)
    if served is not None and served.mix and open_dims:
        return _served_mix(served)
    if validation and open_dims:
        largest = max(validation, key=lambda sample: sum(math.prod(t.shape[1:]) for t in sample))
        sample = {spec.name: tensor[:1] for spec, tensor in zip(specs, largest, strict=True)}
        return TimingSize({1: sample}, f"{_shape_text(sample)} (the validation set's largest shape group)")
    inputs = {b: synthetic_inputs(specs, batch=b) for b in batches}
    what = "the declared shape" if not open_dims else "the declared example: its smallest sizes"
    return TimingSize(inputs, f"{_shape_text(inputs[min(inputs)])} ({what})")


def _served_mix(served: ServedInputs) -> TimingSize:
    """One timed call: a recorded request of each of the most served groups, repeated by its share of MIX_CALLS."""
    calls: list[dict[str, torch.Tensor]] = []
    parts: list[str] = []
    for group, share in served.mix:
        sample = served.of_group(group)
        if sample is None:
            continue
        repeats = max(1, round(MIX_CALLS * share))
        calls += [sample.inputs] * repeats
        parts.append(f"{_shape_text(sample.inputs)} x{repeats} ({share:.0%} of requests)")
    text = f"the served mix: {', '.join(parts)} (recorded inputs)"
    return TimingSize({1: calls[0]}, text, tuple(calls))


def _shape_text(inputs: Mapping[str, torch.Tensor]) -> str:
    """The inputs' shapes without the batch dim: `3x480x640`, or `image 3x480x640, mask 480x640`."""
    shapes = {name: "x".join(map(str, t.shape[1:])) for name, t in inputs.items()}
    return next(iter(shapes.values())) if len(shapes) == 1 else ", ".join(f"{n} {s}" for n, s in shapes.items())
