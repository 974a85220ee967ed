"""The golden set: every input a profile is checked on against eager before it serves.

Each sample alone (batch 1), all of them batched at the sizes the model serves, and synthetic inputs
across each declared dynamic range: the samples are the model's validation set when one is
configured, else synthetic samples drawn as the inputs declare. The gate (select.py) takes the worst
row of them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infervisor.common.recorded_inputs import case_label
from infervisor.worker.profiles.calibration import Inputs
from infervisor.worker.profiles.recorded import ServedInput
from infervisor.worker.runner import ModelRunner
from infervisor.worker.synthetic import describe as describe_synthetic
from infervisor.worker.synthetic import probe_steps, probed_inputs

#: The largest batch the full golden set is checked in (larger sets are checked in batches of this many).
_MAX_GOLDEN_BATCH = 32
#: Without a validation set: synthetic samples drawn with these seeds (0 is the warm-up and canary input;
#: the int8 calibration fallback draws 1..16).
_SYNTHETIC_SEEDS = (0, 1001, 1002)
#: A batched check has at least this many rows when the bounds allow: packages are exported at 2, so only
#: another size shows a batch baked into the graph.
_MIN_BATCHED_ROWS = 3


@dataclass(frozen=True)
class GoldenCase:
    """One input the gate runs through eager and the candidate: what it is called, and which sample each row is."""

    label: str
    inputs: dict[str, torch.Tensor]
    #: The sample behind each row of the batch (an index into the golden samples).
    rows: tuple[int, ...]
    #: What a sample is called (`validation sample`, `synthetic sample`).
    kind: str = "sample"

    def where(self, row: int) -> str:
        """Names row `row` (-1: the input as a whole), e.g. `validation sample 3 in a batch of 8 (row 3)`."""
        if len(self.rows) == 1:
            return self.label
        if not 0 <= row < len(self.rows):
            return f"{self.label} (samples {_rows_text(self.rows)})"
        return f"{self.kind} {self.rows[row]} in {self.label} (row {row})"


@dataclass(frozen=True)
class GoldenSet:
    """Every input a profile is checked on, and what they are in one phrase (for the notes and refusals)."""

    cases: list[GoldenCase]
    checked: str


def _batch_range(runner: ModelRunner) -> tuple[int, int | None] | None:
    """The batch sizes every input takes (its first dim, open in each), or None when the batch is not dynamic."""
    if not all(spec.shape and spec.shape[0] is None for spec in runner.specs):
        return None
    ranges = [spec.dim_range(0) for spec in runner.specs]
    highs = [high for _, high in ranges if high is not None]
    return max(low for low, _ in ranges), min(highs) if highs else None


def _batched_sizes(count: int, batch: tuple[int, int | None], bounded: bool, served: Sequence[int] = ()) -> list[int]:
    """The batch sizes all `count` samples are checked at together: the whole set (in chunks when it is larger
    than the model takes or than _MAX_GOLDEN_BATCH), at least _MIN_BATCHED_ROWS rows, a bounded batch at its
    bounds, and each batch size the broker joins requests into (`served`, samples cycled to fill it)."""
    low, high = batch
    largest = min(high, _MAX_GOLDEN_BATCH) if high is not None else _MAX_GOLDEN_BATCH
    size = max(low, min(count, largest), min(_MIN_BATCHED_ROWS, high if high is not None else _MIN_BATCHED_ROWS))
    sizes = [size] * max(1, -(-count // size))
    if bounded:
        sizes += [bound for bound in (low, high) if bound is not None and bound > 1 and bound not in sizes]
    sizes += [n for n in served if n > 1 and n not in sizes and (high is None or n <= high)]
    return sizes


def golden_set(
    runner: ModelRunner,
    validation: Sequence[Inputs] | None,
    served: Sequence[int] = (),
    recorded: Sequence[ServedInput] = (),
) -> GoldenSet:
    """The samples of _sample_set, then synthetic inputs across each declared range (_shape_cases), then the served
    inputs the supervisor recorded (recorded.py), each as it was served."""
    samples = _sample_set(runner, validation, served)
    shaped = _shape_cases(runner)
    cases, checked = [*samples.cases, *shaped], samples.checked
    if shaped:
        shapes = ", ".join(case.label.removeprefix("synthetic input ") for case in shaped)
        checked += f"; and synthetic inputs across the declared ranges ({shapes})"
    if recorded:
        cases += [_recorded_case(index, sample) for index, sample in enumerate(recorded)]
        groups = len({sample.group for sample in recorded})
        checked += f"; and {len(recorded)} recorded served inputs in {groups} shape group{'s' if groups > 1 else ''}"
    return GoldenSet(cases, checked)


def _recorded_case(index: int, sample: ServedInput) -> GoldenCase:
    """A recorded served request as its own case, at the batch it was served in."""
    rows = int(next(iter(sample.inputs.values())).shape[0]) if sample.inputs else 1
    return GoldenCase(case_label(index, sample.shapes), sample.inputs, (index,) * max(1, rows), "recorded input")


def _shape_cases(runner: ModelRunner) -> list[GoldenCase]:
    """Synthetic inputs at the sizes probe_shapes draws for each dynamic dim that is not the batch, at batch 1
    and batched: a compiled program is only as good as the sizes it was checked at."""
    steps = probe_steps(runner.specs)
    if steps < 2:
        return []
    batch = _batch_range(runner)
    batches = [1] if batch is None else sorted({max(1, batch[0]), _clamped(_MIN_BATCHED_ROWS, batch)})
    cases: list[GoldenCase] = []
    for step in range(1, steps):
        for size in batches:
            inputs = probed_inputs(runner.specs, size, step, seed=2000 + step)
            shapes = ", ".join("x".join(map(str, t.shape)) for t in inputs.values())
            cases.append(GoldenCase(f"synthetic input {shapes}", inputs, (0,) * size, "synthetic input"))
    return cases


def _clamped(size: int, bounds: tuple[int, int | None]) -> int:
    low, high = bounds
    return max(low, size if high is None else min(size, high))


def _sample_set(runner: ModelRunner, validation: Sequence[Inputs] | None, served: Sequence[int] = ()) -> GoldenSet:
    """The inputs every profile is checked on against eager: each sample alone (batch 1), and all of them batched.

    The samples are the model's validation set when one is configured (synthetic inputs say little about
    a quantized model with real weights), else synthetic samples drawn as the inputs declare. With a
    dynamic batch they are also checked together, at the batch sizes the model serves (_batched_sizes):
    tracing can bake batch 1 into a graph, packages keep a batch-1 variant, and a kernel's numerics
    can differ between batch sizes, so neither alone speaks for the other. The gate takes the worst row
    of them all.
    """
    names = [spec.name for spec in runner.specs]
    batch = _batch_range(runner)
    if validation:
        kind = "validation sample"
        samples = [dict(zip(names, sample, strict=True)) for sample in validation]
        what = f"{len(samples)} validation samples"
    else:
        kind = "synthetic sample"
        seeds = _SYNTHETIC_SEEDS if batch is None or batch[0] == 1 else _SYNTHETIC_SEEDS[:1]
        samples = [runner.example_inputs(batch=1, seed=seed) for seed in seeds]
        what = f"{len(samples)} {describe_synthetic(runner.specs)}"  # e.g. "3 synthetic samples (x: uniform 0..1)"
    # A validation set's shape groups (common/sample_groups.py) differ in open dims: rows join only their own.
    groups = _shape_groups(samples)
    shapes = [_shape_text(samples[members[0]]) for members in groups] if len(groups) > 1 else []
    if shapes:
        what += f" in {len(groups)} shape groups ({', '.join(shapes)})"
    if batch is None:
        if any(d is None for spec in runner.specs for d in spec.shape) and not validation:
            # A dynamic dim that is not a batch (a sequence length): checked at another size too.
            larger = GoldenCase(f"a synthetic input at size {_MIN_BATCHED_ROWS}",
                                runner.example_inputs(batch=_MIN_BATCHED_ROWS), (0,))  # fmt: skip
            return GoldenSet(
                [*_alone(samples, kind), larger], f"{what}, each alone and once at size {_MIN_BATCHED_ROWS}"
            )
        return GoldenSet(_alone(samples, kind, bool(shapes)), f"{what}, each alone")
    bounded = any(spec.bounds and spec.bounds[0] is not None for spec in runner.specs)
    cases = _alone(samples, kind, bool(shapes)) if batch[0] == 1 else []
    batched: list[str] = []
    for group, members in enumerate(groups):
        at = f" at {shapes[group]}" if shapes else ""
        sizes = _batched_sizes(len(members), batch, bounded, served)
        start = 0
        for size in sizes:
            rows = tuple(members[(start + i) % len(members)] for i in range(size))
            start = (start + size) % len(members) if size < len(members) else 0
            inputs = {name: torch.cat([samples[r][name] for r in rows]) for name in names}
            cases.append(GoldenCase(f"a batch of {size}{at}", inputs, rows, kind))
        batched.append(", ".join(str(n) for n in sizes) + at)
    alone = "each alone and " if batch[0] == 1 else ""
    return GoldenSet(cases, f"{what}, {alone}batched at {'; '.join(batched)}")


def _shape_groups(samples: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    """The samples' indices grouped by their inputs' shapes, in the order each shape first appears."""
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for index, sample in enumerate(samples):
        groups.setdefault(tuple(tuple(t.shape) for t in sample.values()), []).append(index)
    return list(groups.values())


def _shape_text(sample: dict[str, torch.Tensor]) -> str:
    """A sample's shape without its batch dim, e.g. `3x64x64`, or `x 3x64x64, mask 64` for several inputs."""
    shapes = {name: "x".join(map(str, t.shape[1:])) for name, t in sample.items()}
    return next(iter(shapes.values())) if len(shapes) == 1 else ", ".join(f"{n} {s}" for n, s in shapes.items())


def _alone(samples: list[dict[str, torch.Tensor]], kind: str, shaped: bool = False) -> list[GoldenCase]:
    """Each sample as its own batch-1 case; `shaped`: the label says its shape (the set has several)."""
    return [
        GoldenCase(f"{kind} {i} alone" + (f" at {_shape_text(sample)}" if shaped else ""), sample, (i,), kind)
        for i, sample in enumerate(samples)
    ]


def _rows_text(rows: tuple[int, ...]) -> str:
    """`0-7`, or `0-7 cycled` when samples repeat."""
    if list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return f"{rows[0]}-{rows[-1]}" if len(rows) > 1 else str(rows[0])
    return f"{min(rows)}-{max(rows)} cycled"


def golden_cases(runner: ModelRunner, validation: Sequence[Inputs] | None) -> list[dict[str, torch.Tensor]]:
    """The inputs of golden_set, in its order."""
    return [case.inputs for case in golden_set(runner, validation).cases]
