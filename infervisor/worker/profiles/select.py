"""Walks a model's profile chain: a profile serves only if it builds, runs and matches eager on golden inputs.

pick "first": the first such profile of the chain serves (the chain is the operator's order of
preference, and later entries are the fallbacks). pick "fastest": every profile of the chain is
built and validated, the ones that pass are timed in interleaved rounds at the batch sizes the
model serves (timing.py), and a later profile serves instead of an earlier one only when it is
faster by more than the measured noise; that decision is kept in the artifact cache so a restarted
worker builds only the winner.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from infervisor.common.accuracy import ACCURACY_WARNING_NOTE, SEQUENCE_NOTE
from infervisor.common.cpuinfo import CpuCaps
from infervisor.common.profiles import PROFILES, REFERENCE_PROFILE, TIMED_AT_NOTE, cpu_refusal
from infervisor.common.text import clip
from infervisor.protocol.constants import StartPhase
from infervisor.worker.profiles.attempts import AttemptLog
from infervisor.worker.profiles.build import build_profile
from infervisor.worker.profiles.builders import BuildContext, Built, ProfileError
from infervisor.worker.profiles.cache import NotBuiltYet, UntrustedCache
from infervisor.worker.profiles.calibration import Inputs
from infervisor.worker.profiles.evidence import sample_count
from infervisor.worker.profiles.export import ShapeNotServed
from infervisor.worker.profiles.flags import apply_global_flags, reset_global_flags
from infervisor.worker.profiles.parts import Array, parts_verdict
from infervisor.worker.profiles.pick_record import decision_path, remember
from infervisor.worker.profiles.pick_record import remembered_pick as remembered_pick
from infervisor.worker.profiles.pick_record import served_batches as served_batches
from infervisor.worker.profiles.task_check import TaskCheck
from infervisor.worker.profiles.timing import Contender, Decision, decide, describe, run_rounds
from infervisor.worker.profiles.timing_size import TimingSize, timing_size
from infervisor.worker.profiles.validate import Tolerance, compare, worst_of
from infervisor.worker.progress import NoProgress, Progress
from infervisor.worker.runner import FailedAtSize, ModelRunner, failed_at
from infervisor.worker.synthetic import describe as describe_synthetic
from infervisor.worker.synthetic import probe_steps, probed_inputs

log = structlog.get_logger("worker")

#: The largest batch the full golden set is checked in (larger sets are checked in batches of this many).
_MAX_GOLDEN_BATCH = 32
#: Without a validation set: synthetic samples drawn with these seeds (0 is the warm-up and canary input;
#: the int8 calibration fallback draws 1..16).
_SYNTHETIC_SEEDS = (0, 1001, 1002)
#: A batched check has at least this many rows when the bounds allow: packages are exported at 2, so only
#: another size shows a batch baked into the graph.
_MIN_BATCHED_ROWS = 3
#: Timing for pick "fastest": interleaved rounds until this long has passed, at least and at most so many.
_TIMING_S = 5.0
_MIN_ROUNDS = 6
_MAX_ROUNDS = 60
#: Why a worker that serves first skips a profile that must be traced, exported or compiled.
NEEDS_BUILD = "needs a build: the background builder builds it"
#: The summary of eager served first: the reference, neither built nor checked against itself.
_REFERENCE_SUMMARY = "the reference"


@dataclass
class Selection:
    """The profile that serves, why each other one does not, and what building it did."""

    profile: str
    skipped: list[str] = field(default_factory=list)
    build_ms: float = 0.0
    cosine: float = 1.0
    notes: list[str] = field(default_factory=list)


@dataclass
class _Candidate:
    name: str
    built: Built
    cosine: float
    build_ms: float
    #: What the gate measured: the worst row's cosine and error, where they were, and what was checked.
    summary: str = ""


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


def golden_set(runner: ModelRunner, validation: Sequence[Inputs] | None, served: Sequence[int] = ()) -> GoldenSet:
    """The samples of _sample_set, then synthetic inputs across each declared range (_shape_cases)."""
    samples = _sample_set(runner, validation, served)
    shaped = _shape_cases(runner)
    if not shaped:
        return samples
    shapes = ", ".join(case.label.removeprefix("synthetic input ") for case in shaped)
    return GoldenSet(
        [*samples.cases, *shaped], f"{samples.checked}; and synthetic inputs across the declared ranges ({shapes})"
    )


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


class _Trial:
    """Builds and validates candidates against the eager reference on the golden inputs."""

    def __init__(
        self,
        runner: ModelRunner,
        context: BuildContext,
        tolerance: Tolerance,
        caps: CpuCaps,
        validation: Sequence[Inputs] | None = None,
        attempts: AttemptLog | None = None,
        progress: Progress | None = None,
        ready_only: bool = False,
    ) -> None:
        #: Serve first: only what needs no build (a verified cached package, or a profile that builds nothing).
        self.ready_only = ready_only
        self.attempts = attempts or AttemptLog(None, {}, [])
        self.progress = progress or NoProgress()
        self.runner = runner
        self.context = context
        self.tolerance = tolerance
        self.caps = caps
        self.eager = runner.module
        self.golden = golden_set(runner, validation, context.served_batches)
        self.validation = validation
        self.cases = [case.inputs for case in self.golden.cases]
        #: Eager's outputs on the golden cases, and their names (so the gate can say which one failed), computed
        #: when the first candidate needs them: a worker serving first on eager alone runs none of them.
        self._reference: list[list[np.ndarray[Any, Any]]] | None = None
        self.output_names: list[str] = []
        #: The worst figure of the parts (parts.py) of the last candidate that passed, for its summary.
        self.part_note = ""
        self.task_check = TaskCheck(tolerance.task_check, tolerance.task_check_dir) if tolerance.task_check else None

    @property
    def reference(self) -> list[list[np.ndarray[Any, Any]]]:
        """Eager's outputs on every golden case (run on eager, whatever the runner serves when first asked)."""
        if self._reference is None:
            serving, self.runner.module = self.runner.module, self.eager
            try:
                named = [self.runner.forward_at(case.inputs, f"the gate's {case.label}") for case in self.golden.cases]
            finally:
                self.runner.module = serving
            self._reference = [[a for _, a in outputs] for outputs in named]
            self.output_names = [n for n, _ in named[0]] if named else []
        return self._reference

    def attempt(self, name: str) -> _Candidate | str:
        """The validated candidate installed on the runner, or why it does not qualify (runner back on eager)."""
        refusal = cpu_refusal(name, self.caps) or self.attempts.refusal(name)
        if refusal is None and self.ready_only and not (PROFILES[name].builds_nothing or PROFILES[name].packaged):
            refusal = NEEDS_BUILD
        if refusal is not None:
            self.progress.phase(StartPhase.REFUSED, name, refusal)
            return refusal
        started = time.perf_counter()
        # A failure is the build's (or a crash on the golden inputs) unless the tolerance is what failed.
        outcome = StartPhase.REJECTED
        try:
            # A native crash in here leaves the marker: the next worker skips this profile instead of crashing too.
            if self.ready_only and name == REFERENCE_PROFILE:  # the reference itself: nothing to build or check
                built = build_profile(name, self.context)
                self.progress.phase(StartPhase.PASSED, name, "the reference, served first while the rest is built")
                return _Candidate(
                    name, built, 1.0, (time.perf_counter() - started) * 1000.0, summary=_REFERENCE_SUMMARY
                )
            references = self.reference
            with self.attempts.attempting(name, "building and checking"):
                # Serving first builds nothing: it loads a verified package or a profile that needs no build.
                self.progress.phase(StartPhase.LOADING if self.ready_only else StartPhase.BUILDING, name)
                built = build_profile(name, self.context)
                self.runner.module = built.callable
                self.outputs(self.golden.cases[0], references[0])  # first runs compile or specialise a graph
                self.progress.phase(StartPhase.CHECKING, name)
                cases = self.golden.cases
                outputs = [self.outputs(case, reference) for case, reference in zip(cases, references, strict=True)]
                own = self.tolerance.judged_by_output_rule()
                agreements = [
                    (compare(reference, got, self.output_names, own), case.where)
                    for case, reference, got in zip(cases, references, outputs, strict=True)
                ]
                result = worst_of(agreements, self.golden.checked, sample_count(cases))
                failure = result.failure(self.tolerance) or self.beyond_the_cosine(references, outputs)
                if failure is None and self.context.sequences is not None and name != REFERENCE_PROFILE:
                    self.progress.phase(StartPhase.CHECKING, name, f"over {self.context.sequences.checked}")
                    over = self.context.sequences.check(self.tolerance)
                    failure = over.failure
        except NotBuiltYet as exc:  # serving first: the background builder builds it
            failure, outcome = f"{exc}: the background builder builds it", StartPhase.REFUSED
        except ProfileError as exc:
            failure, outcome = str(exc), StartPhase.FAILED
        except Exception as exc:  # noqa: BLE001 - a profile that crashes on golden inputs is skipped, not fatal
            failure = clip(f"{name} crashed on golden inputs: {type(exc).__name__}: {exc}")
            outcome = StartPhase.FAILED
        if failure is not None:
            self.progress.phase(outcome, name, failure)
            self.reset()
            return failure
        summary = "; ".join(filter(None, [result.summary(self.tolerance.min_cosine, self.tolerance), self.part_note]))
        if self.context.sequences is not None and name != REFERENCE_PROFILE:
            built.notes.append(f"{SEQUENCE_NOTE}{over.summary}")
        warning = result.evidence(self.tolerance).warning()  # a pass by less than the samples spread: status says so
        if warning is not None:
            built.notes.append(f"{ACCURACY_WARNING_NOTE}{warning}")
        candidate = _Candidate(name, built, result.cosine, (time.perf_counter() - started) * 1000.0, summary=summary)
        self.progress.phase(StartPhase.PASSED, name, "; ".join([*built.notes, _built_in(candidate)]))
        return candidate

    def beyond_the_cosine(self, references: list[list[Array]], outputs: list[list[Array]]) -> str | None:
        """Why the parts of the outputs (parts.py) or the operator's task check refuse the candidate, or None."""
        tolerance, cases = self.tolerance, self.golden.cases
        failure, self.part_note = parts_verdict(
            cases, references, outputs, self.output_names, tolerance.outputs, tolerance.max_channel_error
        )
        if failure is None and self.task_check is not None:
            failure = self.task_check.failure(cases, references, outputs, self.output_names)
            self.part_note += "; the task check passed on every case" if failure is None else ""
        return failure

    def outputs(self, case: GoldenCase, reference: list[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
        """The candidate's outputs on a golden input; eager's where the profile does not serve its shapes, as when
        serving (coverage.Covered): the daemon's own refusal is neither a failure nor a crash."""
        try:
            return [a for _, a in self.runner.forward(case.inputs)]
        except ShapeNotServed:
            return reference
        except Exception as exc:  # noqa: BLE001 - said with the sizes it failed at (the attempt skips the profile)
            raise FailedAtSize(failed_at(self.runner.specs, case.inputs, f"the gate's {case.label}", exc)) from exc

    def time(self, candidates: Sequence[_Candidate]) -> tuple[Decision, TimingSize]:
        """Interleaved rounds of every candidate at the size that is served (timing_size.py), at each batch size the
        model serves, and the decision they make."""
        batches = served_batches(self.runner.specs, self.context.served_batches)
        size = timing_size(self.runner.specs, batches, self.validation, self.context.typical_shape)
        inputs = size.inputs

        def contender(candidate: _Candidate) -> Contender:
            runs = {b: (lambda case=inputs[b]: self.runner.forward(case)) for b in size.batches}
            return Contender(candidate.name, lambda: self.install(candidate), runs)

        rounds = run_rounds(
            [contender(c) for c in candidates],
            _TIMING_S,
            _MIN_ROUNDS,
            _MAX_ROUNDS,
            guard=lambda name: self.attempts.attempting(name, "being timed"),
        )
        return decide([c.name for c in candidates], rounds), size

    def reset(self) -> None:
        """Back to eager, with every process-wide flag a profile switches off."""
        self.runner.module = self.eager
        reset_global_flags()

    def install(self, candidate: _Candidate) -> None:
        """Serve the candidate."""
        self.runner.module = candidate.built.callable
        apply_global_flags(candidate.name)


def select_profile(
    runner: ModelRunner,
    chain: Sequence[str],
    tolerance: Tolerance,
    caps: CpuCaps,
    context: BuildContext,
    pick: str = "first",
    validation: Sequence[Inputs] | None = None,
    attempts: AttemptLog | None = None,
    progress: Progress | None = None,
    ready_only: bool = False,
) -> Selection:
    """Install the chosen profile of `chain` on the runner; eager is the last resort.

    `ready_only` (serve first): nothing is built; a fastest pick serves its remembered winner when that is
    ready, else the first profile of the chain that is, and neither times nor remembers anything.
    """
    trial = _Trial(runner, context, tolerance, caps, validation, attempts, progress, ready_only)
    skipped: list[str] = []
    if pick == "fastest":
        decided = _decided(trial, context, chain, tolerance)
        if decided is not None:
            return decided
        if not ready_only:
            return _pick_fastest(trial, context, chain, tolerance)
    for name in chain:
        outcome = trial.attempt(name)
        if isinstance(outcome, _Candidate):
            log.info("profile_selected", profile=name, build_ms=round(outcome.build_ms, 1), skipped=skipped)
            notes = [*outcome.built.notes, _built_in(outcome)]
            return Selection(name, skipped, outcome.build_ms, outcome.cosine, notes)
        skipped.append(f"{name}: {outcome}")
    return _last_resort(trial, chain, skipped)


def _last_resort(trial: _Trial, chain: Sequence[str], skipped: list[str]) -> Selection:
    trial.reset()
    if REFERENCE_PROFILE not in chain:
        skipped.append(f"{REFERENCE_PROFILE}: last resort, no profile in the chain passed")
    log.warning("profile_fallback_to_eager", skipped=skipped)
    return Selection(REFERENCE_PROFILE, skipped)


def _decided(trial: _Trial, context: BuildContext, chain: Sequence[str], tolerance: Tolerance) -> Selection | None:
    """Reuse an earlier fastest-pick for the same model, chain and machine: build and validate only the winner."""
    path = decision_path(context, chain, tolerance, served_batches(trial.runner.specs, context.served_batches))
    if path is None or context.cache is None or not path.exists():
        return None
    try:
        decision = json.loads(context.cache.read_trusted(path))
        name, summary = str(decision["profile"]), str(decision["summary"])
    except (OSError, ValueError, KeyError, TypeError, UntrustedCache):
        return None  # an unsafe cache is said by each packaged profile's failure; a new pick is timed
    outcome = trial.attempt(name)
    if not isinstance(outcome, _Candidate):
        log.warning("cached_pick_failed", profile=name, reason=outcome)
        return None
    timed = [f"{TIMED_AT_NOTE}{decision['timed_at']}"] if decision.get("timed_at") else []
    notes = [*outcome.built.notes, _built_in(outcome), *timed, f"{summary} (decided earlier, {path.name})"]
    log.info("profile_selected", profile=name, build_ms=round(outcome.build_ms, 1), pick="cached")
    return Selection(name, list(decision.get("skipped", [])), outcome.build_ms, outcome.cosine, notes)


def _built_in(candidate: _Candidate) -> str:
    if candidate.summary == _REFERENCE_SUMMARY:
        return "the eager reference as loaded, served first while the background builder builds the chain"
    return f"built and checked against eager in {candidate.build_ms:.0f} ms: {candidate.summary}"


def _pick_fastest(trial: _Trial, context: BuildContext, chain: Sequence[str], tolerance: Tolerance) -> Selection:
    """Build and check every profile of the chain, time those that pass together, serve what the timing decides.

    Every passing candidate stays alive until the decision (interleaving needs them all at once), so
    the pick briefly holds each one's weights or packages; the losers are dropped before serving.
    """
    skipped: list[str] = []
    passed: list[_Candidate] = []
    for name in chain:
        outcome = trial.attempt(name)
        if isinstance(outcome, _Candidate):
            passed.append(outcome)
        else:
            skipped.append(f"{name}: {outcome}")
        trial.reset()
    if not passed:
        return _last_resort(trial, chain, skipped)
    batches = served_batches(trial.runner.specs, context.served_batches)
    record: dict[str, object] = {"threads": torch.get_num_threads(), "batches": list(batches)}
    timed: list[str] = []
    if len(passed) == 1:
        (best,) = passed
        summary = f"fastest pick: {best.name} is the only profile of the chain that passed (not timed)"
    else:
        trial.progress.phase(StartPhase.TIMING, ", ".join(c.name for c in passed))
        decision, size = trial.time(passed)
        best = next(c for c in passed if c.name == decision.profile)
        summary = describe(decision, torch.get_num_threads(), size.text)
        timed = [f"{TIMED_AT_NOTE}{size.text}"]
        served = decision.ratios[best.name]
        skipped += [
            f"{c.name}: passed (cosine {c.cosine:.5f}), not picked: x{decision.ratios[c.name] / served:.3f} the "
            f"per-sample time of {best.name}{' (within the noise)' if decision.ratios[c.name] < served else ''}"
            for c in passed
            if c is not best
        ]
        record.update(
            fastest=decision.fastest,
            rounds=decision.rounds,
            per_sample_ms={n: {str(b): round(ms, 5) for b, ms in v.items()} for n, v in decision.per_sample_ms.items()},
            ratios={n: round(r, 4) for n, r in decision.ratios.items()},
            noise={n: round(x, 4) for n, x in decision.noise.items()},
            reason=decision.reason,
            timed_at=size.text,
        )
    passed.clear()  # the losers' weights and packages go with their last reference
    trial.reset()
    trial.install(best)
    record.update(profile=best.name, summary=summary, skipped=skipped)
    remember(decision_path(context, chain, tolerance, batches), record)
    notes = [*best.built.notes, _built_in(best), *timed, summary]
    log.info("profile_selected", profile=best.name, pick="fastest", decision=record.get("reason"), skipped=skipped)
    return Selection(best.name, skipped, best.build_ms, best.cosine, notes)


def check_profiles(
    runner: ModelRunner,
    names: Sequence[str],
    tolerance: Tolerance,
    caps: CpuCaps,
    context: BuildContext,
    validation: Sequence[Inputs] | None = None,
    attempts: AttemptLog | None = None,
    progress: Progress | None = None,
) -> dict[str, str | None]:
    """Build and check each of `names` as a selection would, serving none (`infervisor build`): name -> failure.

    None is a profile that passed; its package, if it has one, is in the cache from now on.
    """
    trial = _Trial(runner, context, tolerance, caps, validation, attempts, progress)
    results: dict[str, str | None] = {}
    for name in names:
        outcome = trial.attempt(name)
        results[name] = None if isinstance(outcome, _Candidate) else outcome
        trial.reset()
    return results
