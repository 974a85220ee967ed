"""The input sizes optimize and bench measure at: the sizes the box serves, never silently the declared minimum.

A keyword model declared `[null, 1, [256, 32000]]` that serves 16,000 samples costs 0.2 ms a call at 256 and 14.6 ms
at 16,000: a sweep timed at the minimum chooses, and promises, on a size nobody sends. The sizes come, in order,
from the constraints' `data.inputs` (each range read as a uniform distribution: SPREAD sizes at its quantiles, so
the mean cost over them is the range's), else the model's `typical_shape` (one size), else the served mix the
daemon recorded in the cache (common/recorded_inputs.py: each shape group in SPREAD sizes by its share of the
requests seen), else the declared example (its smallest sizes), which the text then says in so many words.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.common import recorded_inputs
from infervisor.common.recorded_inputs import Recording
from infervisor.common.strict_modes import UnsafePath
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.toolkit.constraints import Data

#: Sizes drawn over a declared range: its quantiles (k + 0.5) / SPREAD of a uniform distribution.
SPREAD = 5


@dataclass(frozen=True)
class ServedSizes:
    """Batch-1 shapes (input name -> full shape), cycled through request after request, and where they came from."""

    shapes: tuple[dict[str, tuple[int, ...]], ...]
    #: "constraints data.inputs", "typical_shape" or "the declared example".
    source: str
    #: Whether the sizes are the declared minimum of an open dim, for want of anything better (a warning).
    minimum: bool = False

    @property
    def text(self) -> str:
        """e.g. `audio 1x4100 .. 1x28900 (5 sizes spread over constraints data.inputs)`: what every figure states."""
        names = list(self.shapes[0])
        parts = []
        for name in names:
            seen = list(dict.fromkeys("x".join(map(str, shape[name][1:])) for shape in self.shapes))
            shown = seen[0] if len(seen) == 1 else f"{seen[0]} .. {seen[-1]}"
            parts.append(shown if len(names) == 1 else f"{name} {shown}")
        many = f"{len(self.shapes)} sizes spread over " if len(self.shapes) > 1 else ""
        return f"{', '.join(parts)} ({many}{self.source})"

    def as_json(self) -> list[dict[str, list[int]]]:
        """The shapes as JSON lists (what `python -m infervisor.worker.bench --sizes` takes)."""
        return [{name: list(shape) for name, shape in sizes.items()} for sizes in self.shapes]

    def at_batch(self, index: int, batch: int) -> dict[str, tuple[int, ...]]:
        """Size `index` with `batch` rows."""
        return {name: (batch, *shape[1:]) for name, shape in self.shapes[index].items()}


def _quantile(low: int, high: int, k: int) -> int:
    return round(low + (high - low) * (k + 0.5) / SPREAD)


def _from_data(specs: tuple[TensorSpec, ...], data: Data) -> ServedSizes | None:
    """SPREAD sizes over the ranges of `data.inputs` (the k-th quantile of every range at once: inputs whose lengths
    go together, ids and mask, stay equal), inside what each spec takes; None when no range names a spec's input."""
    declared = {item.name: item.dims for item in data.inputs}
    if not any(spec.name in declared for spec in specs):
        return None
    ranged = any(isinstance(d, tuple) for dims in declared.values() for d in dims[1:])
    shapes = []
    for k in range(SPREAD if ranged else 1):
        sizes: dict[str, tuple[int, ...]] = {}
        for spec in specs:
            dims = declared.get(spec.name)
            if dims is None or len(dims) != len(spec.shape):
                sizes[spec.name] = spec.example_shape(1)
                continue
            chosen = [d if isinstance(d, int) else _quantile(d[0], d[1], k) for d in dims]
            sizes[spec.name] = (1, *(spec.on_step(i, size) for i, size in enumerate(chosen) if i > 0))
        shapes.append(sizes)
    return ServedSizes(tuple(shapes), "constraints data.inputs")


def _from_recording(specs: tuple[TensorSpec, ...], recording: Recording) -> ServedSizes | None:
    """SPREAD sizes over the recorded shape groups, each by its share of the requests seen (the largest share first);
    None when the recording holds no sample every spec accepts (the model changed since)."""
    shapes_of_group: dict[str, dict[str, tuple[int, ...]]] = {}
    for sample in recording.samples:
        sizes = {t.name: (1, *t.shape[1:]) for t in sample.tensors}
        if sample.group not in shapes_of_group and _accepted(specs, sizes):
            shapes_of_group[sample.group] = sizes
    seen = {group: recording.seen.get(group, 0) or 1 for group in shapes_of_group}
    if not seen:
        return None
    total = sum(seen.values())
    ranked = sorted(seen, key=lambda group: -seen[group])
    slots = {group: round(SPREAD * seen[group] / total) for group in ranked}
    slots[ranked[0]] = max(1, slots[ranked[0]])
    shapes = tuple(shapes_of_group[group] for group in ranked for _ in range(slots[group]))
    shares = ", ".join(f"{group} {100 * seen[group] / total:.0f}%" for group in ranked if slots[group])
    return ServedSizes(shapes, f"the served mix recorded by the daemon: {shares}")


def _accepted(specs: tuple[TensorSpec, ...], sizes: dict[str, tuple[int, ...]]) -> bool:
    """Whether every spec takes its input at these sizes (same names, ranks and fixed dims)."""
    if set(sizes) != {spec.name for spec in specs}:
        return False
    for spec in specs:
        shape = sizes[spec.name]
        if len(shape) != len(spec.shape) or not all(spec.takes(i, size) for i, size in enumerate(shape) if i > 0):
            return False
    return True


def served_sizes(
    specs: tuple[TensorSpec, ...],
    data: Data | None,
    typical: dict[str, list[int]] | None,
    recording: Recording | None = None,
) -> ServedSizes:
    """The sizes to measure at (see the module's docstring)."""
    found = _from_data(specs, data) if data is not None else None
    if found is not None:
        return found
    if typical:
        return ServedSizes(({s.name: (1, *typical[s.name][1:]) for s in specs},), "typical_shape")
    served = _from_recording(specs, recording) if recording is not None else None
    if served is not None:
        return served
    example = {spec.name: spec.example_shape(1) for spec in specs}
    open_dims = any(spec.shape[i] is None for spec in specs for i in range(1, len(spec.shape)))
    what = "the declared example: its smallest sizes" if open_dims else "the declared shape"
    return ServedSizes((example,), what, minimum=open_dims)


def recorded_mix(root: Path, model: str, cap_mb: int) -> tuple[Recording | None, str]:
    """The model's newest recording in the cache `root` and "", or None and why there is none to use."""
    paths = recorded_inputs.of_model(root, model)
    if not paths:
        return None, ""
    newest = max(paths, key=lambda path: path.stat().st_mtime)
    key = newest.name.removesuffix(recorded_inputs.SUFFIX).rpartition("-")[2]
    try:
        return recorded_inputs.read(root, key, model, cap_mb << 20), ""
    except (UnsafePath, ValueError, OSError) as exc:
        return None, f"the daemon's recorded inputs were not used: {exc}"


def warning(sizes: ServedSizes) -> list[str]:
    """A WARNING line when the figures rest on the declared minimum of an open dim."""
    if not sizes.minimum:
        return []
    return [
        f"WARNING: measured at {sizes.text}, which may be far from the sizes served: declare them in the "
        "constraints' data.inputs ([min, max] per dim) or set the model's typical_shape"
    ]


def shapes_of(arrays: dict[str, Any]) -> dict[str, list[int]]:
    """The shapes of named arrays, as JSON lists (what a report records the inputs sent as)."""
    return {name: list(value.shape) for name, value in arrays.items()}
