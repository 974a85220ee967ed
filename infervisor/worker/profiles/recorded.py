"""The served inputs the supervisor recorded (common/recorded_inputs.py), as the gate and pick "fastest" use them.

The gate checks every profile on up to GATE_SAMPLES of them beside the validation set (golden.py), taken newest
first from each shape group in turn, so a profile exact on its validation rows and off on what the box serves is
refused with the served row's figures and shape. Pick "fastest" times at their shape mix, each group weighted by
how often the sampling saw it served (timing_size.py). Read only from a cache that passes the strict modes: a file
another uid owns, that others may write, or that is damaged is refused with the reason (logged) and not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from infervisor.common import recorded_inputs as files
from infervisor.common.strict_modes import UnsafePath
from infervisor.protocol.arrays import from_frame
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.tensors import TensorDesc, TensorSpec, check_against_spec

log = structlog.get_logger("worker")

#: The most recorded requests the gate runs (through eager and each candidate).
GATE_SAMPLES = 32
#: The most bytes of recorded inputs the gate runs.
GATE_BYTES = 32 << 20
#: The most shape groups the served mix is timed at (the most served ones).
MIX_GROUPS = 4


@dataclass(frozen=True)
class ServedInput:
    """One recorded request: its shape group, inputs by name (batch first, as served) and its shapes' text."""

    group: str
    inputs: dict[str, torch.Tensor]
    shapes: str


@dataclass(frozen=True)
class ServedInputs:
    """What the gate checks and the timing weighs: the recorded requests, and the served mix (group -> share)."""

    samples: tuple[ServedInput, ...]
    mix: tuple[tuple[str, float], ...]
    file: str

    def of_group(self, group: str) -> ServedInput | None:
        """The newest recorded request of `group`."""
        return next((s for s in self.samples if s.group == group), None)


def read_served_inputs(
    root: Path | None, key: str, model: str, cap_mb: int, specs: Sequence[TensorSpec]
) -> ServedInputs | None:
    """The recording of spec key `key` in the cache `root` (None: none, recording off, or refused with the reason)."""
    if root is None or cap_mb <= 0 or not key:
        return None
    try:
        recording = files.read(root, key, model, cap_mb << 20)
    except (UnsafePath, ValueError, OSError) as exc:
        log.error("recorded_inputs_refused", error=str(exc))
        return None
    if recording is None or not recording.samples:
        return None
    samples = [s for s in map(lambda each: _tensors(each, specs), _for_the_gate(recording.samples)) if s is not None]
    seen = {group: n for group, n in recording.seen.items() if any(s.group == group for s in samples)}
    total = sum(seen.values())
    mix = sorted(((g, n / total) for g, n in seen.items()), key=lambda item: -item[1]) if total else []
    return ServedInputs(tuple(samples), tuple(mix[:MIX_GROUPS]), str(files.path_for(root, key, model)))


def _for_the_gate(samples: Sequence[files.RecordedSample]) -> list[files.RecordedSample]:
    """Up to GATE_SAMPLES (and GATE_BYTES), newest first from each group in turn: every group is represented."""
    groups: dict[str, list[files.RecordedSample]] = {}
    for sample in reversed(samples):
        groups.setdefault(sample.group, []).append(sample)
    taken: list[files.RecordedSample] = []
    size = 0
    for index in range(max((len(g) for g in groups.values()), default=0)):
        for members in groups.values():
            if index < len(members) and len(taken) < GATE_SAMPLES and size + members[index].nbytes <= GATE_BYTES:
                taken.append(members[index])
                size += members[index].nbytes
    return taken


def _tensors(sample: files.RecordedSample, specs: Sequence[TensorSpec]) -> ServedInput | None:
    """A recorded request as tensors in the specs' order (None when it does not fit the model's inputs)."""
    by_name = {t.name: t for t in sample.tensors}
    if set(by_name) != {spec.name for spec in specs}:
        return None
    descs = [TensorDesc(spec.name, by_name[spec.name].dtype, by_name[spec.name].shape) for spec in specs]
    try:
        check_against_spec(descs, specs)
        arrays = [np.array(from_frame(desc, by_name[desc.name].data)) for desc in descs]
    except (ProtocolError, ValueError):
        return None
    shapes = ", ".join(f"{d.name}{list(d.shape)}" for d in descs)
    return ServedInput(sample.group, {d.name: torch.from_numpy(a) for d, a in zip(descs, arrays, strict=True)}, shapes)
