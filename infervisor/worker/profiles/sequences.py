"""The sequences a stateful model's profiles are checked on: from the validation file's `seq:` keys, else synthetic.

A sequence set is `streams` streams fed together (one batch per step) for `steps` steps. Only the inputs other
than the state come from the set: every stream starts from the declared initial state, and each step's state is
what the previous step returned, as when the daemon serves a stream.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infervisor.common.sample_groups import PLAIN, GroupError, group_name, sequence_groups
from infervisor.common.strict_modes import UnsafePath, read_small_file
from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.calibration import CalibrationError
from infervisor.worker.synthetic import draw, probe_shapes

#: Streams of a synthetic set (fewer when the batch is bounded lower): several, so the set is also a batch of them.
SYNTHETIC_STREAMS = 4
#: Seed of the synthetic sequences' inputs (other than the golden samples' 0, 1001, 1002 and calibration's 1..16).
SYNTHETIC_SEED = 4545
#: Sets of sequences read from one file (one per label); more are left out, so the check stays bounded.
MAX_SETS = 8
#: Largest initial-state file read (as the config check reads it).
_MAX_INITIAL_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SequenceSet:
    """Streams fed together step by step: the inputs other than the state, at each step a batch of `streams` rows."""

    #: Where the set comes from in verdicts: `synthetic`, `validation`, `validation (group 'a')`.
    label: str
    streams: int
    steps: int
    #: input name -> [steps, streams, ...] (from a file); empty for a synthetic set, drawn at each walk.
    arrays: dict[str, np.ndarray[Any, Any]]
    #: The inputs a synthetic set draws, and their shapes at `streams` rows.
    drawn: tuple[tuple[TensorSpec, tuple[int, ...]], ...] = ()

    def step_inputs(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each step's inputs (the same every time it is walked: eager and the profile see one sequence)."""
        if self.arrays:
            for step in range(self.steps):
                yield {name: torch.from_numpy(np.ascontiguousarray(a[step])) for name, a in self.arrays.items()}
            return
        generator = torch.Generator().manual_seed(SYNTHETIC_SEED)
        for _ in range(self.steps):
            yield {spec.name: draw(spec, shape, generator) for spec, shape in self.drawn}


def initial_state(pair: StateSpec, streams: int) -> torch.Tensor:
    """The declared initial state of `streams` streams, stacked (batch first); CalibrationError if the file is bad."""
    if pair.initial is None:
        one = np.zeros(pair.shape, dtype=pair.dtype)
    else:
        try:
            one = np.load(io.BytesIO(read_small_file(Path(pair.initial), "initial state", _MAX_INITIAL_BYTES)))
        except (UnsafePath, OSError, ValueError) as exc:
            raise CalibrationError(f"cannot read the initial state of {pair.input!r}: {exc}") from exc
        if not isinstance(one, np.ndarray) or one.dtype.name != pair.dtype or tuple(one.shape) != pair.shape:
            raise CalibrationError(f"the initial state {pair.initial} is not {pair.dtype}{list(pair.shape)}")
    return torch.from_numpy(np.ascontiguousarray(np.broadcast_to(one, (streams, *pair.shape))))


def synthetic_set(specs: Sequence[TensorSpec], pairs: Sequence[StateSpec], steps: int) -> SequenceSet:
    """SYNTHETIC_STREAMS streams (within the batch's bounds) of `steps` steps, drawn as each input declares, other
    dynamic dims at their minimum."""
    streams = SYNTHETIC_STREAMS
    for spec in specs:
        if spec.shape:
            low, high = spec.dim_range(0)
            streams = max(low, min(streams, high if high is not None else streams))
    state = {pair.input for pair in pairs}
    fed = [spec for spec in specs if spec.name not in state]
    shapes = probe_shapes(fed, streams, 0)
    return SequenceSet("synthetic", streams, steps, {}, tuple(zip(fed, shapes, strict=True)))


def file_sets(path: Path, specs: Sequence[TensorSpec], pairs: Sequence[StateSpec], steps: int) -> list[SequenceSet]:
    """The validation file's sequence sets, each cut to its first `steps` steps ([] when it holds none)."""
    state = {pair.input for pair in pairs}
    fed = [spec for spec in specs if spec.name not in state]
    try:
        with np.load(path, allow_pickle=False) as archive:
            groups = sequence_groups(list(archive.files), [spec.name for spec in fed])
            arrays = {
                label: {name: archive[key] for name, key in members.items()}
                for label, members in list(groups.items())[:MAX_SETS]
            }
    except GroupError as exc:
        raise CalibrationError(f"validation set {path} {exc}") from exc
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"cannot read validation set {path}: {exc}") from exc
    sets: list[SequenceSet] = []
    for label, members in arrays.items():
        where = "validation" + ("" if label == PLAIN else f" ({group_name(label)})")
        leading = {tuple(a.shape[:2]) if a.ndim >= 2 else () for a in members.values()}
        if len(leading) != 1 or () in leading or 0 in next(iter(leading)):
            raise CalibrationError(
                f"{where} sequences in {path}: every array must share non-empty [steps, streams] dims"
            )
        for spec in fed:
            array = members[spec.name]
            if array.dtype.name != spec.dtype or array.ndim != len(spec.shape) + 1:
                raise CalibrationError(
                    f"{where} sequences in {path}: {spec.name!r} is {array.dtype.name}{list(array.shape)}, expected "
                    f"[steps, streams, ...] of {spec.describe()}"
                )
        total, streams = next(iter(leading))
        cut = min(total, steps)
        sets.append(SequenceSet(where, streams, cut, {name: a[:cut] for name, a in members.items()}))
    return sets
