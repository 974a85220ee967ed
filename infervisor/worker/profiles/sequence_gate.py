"""The sequence gate: a stateful model's profile against eager over whole sequences, each feeding back its own state.

Serving a stream feeds each step the state the previous step returned, so a profile's small error at one step
is carried into the next and can add up: a profile within 1e-5 of eager on one call can be 0.998 away after
137 steps. The single-call gate draws one state and sees one step; this gate walks every sequence twice, eager
on eager's own states and the profile on the profile's own, and compares every step's outputs (the state
outputs among them, so the last step compares the final state) with the single-call gate's measures
(validate.compare), output by output so the verdict names the output that drifted. A profile is refused at the
first step where an output crosses the tolerance, and the walk stops there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infervisor.common.accuracy import cosine_text
from infervisor.common.sample_groups import holds_samples
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.state import StateSpec
from infervisor.worker.profiles.calibration import Inputs, load_calibration
from infervisor.worker.profiles.dispatch import ShapeNotServed
from infervisor.worker.profiles.sequences import SequenceSet, file_sets, initial_state, synthetic_set
from infervisor.worker.profiles.validate import Agreement, Tolerance, compare
from infervisor.worker.runner import ModelRunner

Named = list[tuple[str, np.ndarray[Any, Any]]]
Forward = Callable[[dict[str, torch.Tensor]], Named]
#: Single samples taken from a file of sequences alone, for the single-call gate (each with eager's state there).
SAMPLES_FROM_SEQUENCES = 16


class StateMismatch(Exception):
    """A step returned no state output, or one of another shape: no further step can be fed."""


@dataclass(frozen=True)
class SequenceVerdict:
    """Why the profile is refused over the sequences (None: it passed), and what was checked with the worst figures."""

    failure: str | None
    summary: str


@dataclass
class _Worst:
    """One output's worst step so far, and its figures at step 1."""

    agreement: Agreement
    step: int
    first: Agreement


class SequenceGate:
    """Walks the sequence sets through eager and a candidate installed on the runner, step against step."""

    def __init__(self, runner: ModelRunner, pairs: Sequence[StateSpec], sets: Sequence[SequenceSet]) -> None:
        self.runner = runner
        #: The module as loaded, captured before any profile is installed on the runner.
        self.eager = runner.module
        self.pairs = tuple(pairs)
        self.sets = tuple(sets)

    @property
    def checked(self) -> str:
        """e.g. `4 synthetic streams x 200 steps`."""
        return "; ".join(f"{s.streams} {s.label} streams x {s.steps} steps" for s in self.sets)

    def _eager(self, inputs: dict[str, torch.Tensor]) -> Named:
        serving, self.runner.module = self.runner.module, self.eager
        try:
            return self.runner.forward(inputs)
        finally:
            self.runner.module = serving

    def _candidate(self, inputs: dict[str, torch.Tensor]) -> Named:
        try:
            return self.runner.forward(inputs)
        except ShapeNotServed:  # served by eager, as coverage.Covered serves it (on the profile's own state)
            return self._eager(inputs)

    def _walk(self, forward: Forward, sequences: SequenceSet) -> Iterator[tuple[dict[str, torch.Tensor], Named]]:
        """Each step's inputs (the state the walk carried included) and outputs."""
        state = {pair.input: initial_state(pair, sequences.streams) for pair in self.pairs}
        for step_inputs in sequences.step_inputs():
            inputs = {**step_inputs, **state}
            outputs = [(name, np.array(array, copy=True)) for name, array in forward(inputs)]
            yield inputs, outputs
            state = {pair.input: self._next_state(pair, outputs, sequences.streams) for pair in self.pairs}

    @staticmethod
    def _next_state(pair: StateSpec, outputs: Named, streams: int) -> torch.Tensor:
        named = dict(outputs)
        if pair.output not in named:
            raise StateMismatch(f"the model returned no output {pair.output!r} (the state of {pair.input!r})")
        array = named[pair.output]
        if tuple(array.shape) != (streams, *pair.shape):
            raise StateMismatch(
                f"output {pair.output!r} (the state of {pair.input!r}) has shape {list(array.shape)}, not "
                f"{[streams, *pair.shape]}"
            )
        return torch.from_numpy(np.ascontiguousarray(array.astype(pair.dtype, copy=False)))

    def check(self, tolerance: Tolerance) -> SequenceVerdict:
        """The candidate on the runner against eager over every set; stops at the first step that fails."""
        worst: dict[str, _Worst] = {}
        for sequences in self.sets:
            failure = self._check_set(sequences, tolerance, worst)
            if failure is not None:
                return SequenceVerdict(failure, self.checked)
        return SequenceVerdict(None, self._summary(worst, tolerance))

    def _check_set(self, sequences: SequenceSet, tolerance: Tolerance, worst: dict[str, _Worst]) -> str | None:
        pairs = zip(self._walk(self._eager, sequences), self._walk(self._candidate, sequences), strict=True)
        first: dict[str, Agreement] = {}
        for step, ((_, want), (_, got)) in enumerate(pairs, start=1):
            if [n for n, _ in want] != [n for n, _ in got]:
                return f"over {self.checked} its outputs differ from eager's at step {step}"
            for (name, reference), (_, candidate) in zip(want, got, strict=True):
                agreement = compare([reference], [candidate], [name])
                first.setdefault(name, agreement)
                known = worst.get(name)
                if known is None or agreement.cosine < known.agreement.cosine:
                    worst[name] = _Worst(agreement, step, first[name])
                why = agreement.failure(tolerance)
                if why is not None:
                    return (
                        f"over {sequences.steps}-step sequences ({sequences.streams} {sequences.label} streams, each "
                        f"feeding back its own state) its {self._what(name)} drifted from eager: {why} at step {step} "
                        f"(stream {agreement.worst_row}; step 1: {_figures(first[name], tolerance)})"
                    )
        return None

    def _what(self, name: str) -> str:
        states = {pair.output: pair.input for pair in self.pairs}
        return f"state {name!r}" if name in states else f"output {name!r}"

    def _summary(self, worst: dict[str, _Worst], tolerance: Tolerance) -> str:
        if not worst:
            return f"over {self.checked}: no step"
        name, found = min(worst.items(), key=lambda item: item[1].agreement.cosine)
        margin = found.agreement.cosine - tolerance.min_cosine
        return (
            f"over {self.checked}, each feeding back its own state, every step within the tolerance: worst cosine "
            f"{cosine_text(found.agreement.cosine, tolerance.min_cosine)} on {self._what(name)} at step {found.step} "
            f"(step 1: {_figures(found.first, tolerance)}), passed by {margin:.2g} of cosine"
        )

    def samples(self, limit: int = SAMPLES_FROM_SEQUENCES) -> list[Inputs]:
        """Single samples for the single-call gate: inputs at evenly spread steps, one stream each in turn, with
        the state eager reached there (a file of sequences alone holds no single sample)."""
        specs = self.runner.specs
        taken: list[Inputs] = []
        per_set = max(1, limit // max(1, len(self.sets)))
        for sequences in self.sets:
            every = max(1, sequences.steps // per_set)
            for step, (inputs, _) in enumerate(self._walk(self._eager, sequences)):
                if step % every == 0 and len(taken) < limit:
                    row = (step // every) % sequences.streams
                    taken.append(tuple(inputs[s.name][row : row + 1].clone() for s in specs))
        return taken


def _figures(agreement: Agreement, tolerance: Tolerance) -> str:
    text = f"cosine {cosine_text(agreement.cosine, tolerance.min_cosine)}"
    if agreement.relative.output:
        text += f", relative error {agreement.relative.error:.3g}"
    return text


def sequence_gate_for(launch: LaunchSpec, runner: ModelRunner) -> SequenceGate | None:
    """The gate of a stateful model (None for a stateless one): the validation file's sequences, else synthetic."""
    if not launch.state:
        return None
    steps = launch.sequence_steps
    sets = file_sets(Path(launch.validation), runner.specs, launch.state, steps) if launch.validation else []
    return SequenceGate(runner, launch.state, sets or [synthetic_set(runner.specs, launch.state, steps)])


def validation_samples(launch: LaunchSpec, runner: ModelRunner, gate: SequenceGate | None) -> list[Inputs] | None:
    """The single-call gate's samples: the validation file's, or taken from its sequences when it holds only
    those; None without a validation file (seeded synthetic inputs)."""
    if not launch.validation:
        return None
    path = Path(launch.validation)
    with np.load(path, allow_pickle=False) as archive:
        keys = list(archive.files)
    if holds_samples(keys) or gate is None:
        return load_calibration(path, runner.specs)
    return gate.samples()
