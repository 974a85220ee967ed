"""Walks a model's profile chain: a profile serves only if it builds, runs and matches eager on the golden set
(golden.py).

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
from collections.abc import Callable, Sequence
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
from infervisor.worker.profiles.dispatch import ShapeNotServed
from infervisor.worker.profiles.evidence import sample_count
from infervisor.worker.profiles.flags import apply_global_flags, reset_global_flags
from infervisor.worker.profiles.golden import GoldenCase, golden_set
from infervisor.worker.profiles.parts import Array, parts_verdict
from infervisor.worker.profiles.pick_record import decision_path, remember, timed_batches
from infervisor.worker.profiles.pick_record import remembered_pick as remembered_pick
from infervisor.worker.profiles.task_check import TaskCheck
from infervisor.worker.profiles.timing import Contender, Decision, decide, describe, run_rounds
from infervisor.worker.profiles.timing_size import TimingSize, timing_size
from infervisor.worker.profiles.validate import Tolerance, compare, worst_of
from infervisor.worker.progress import NoProgress, Progress
from infervisor.worker.runner import FailedAtSize, ModelRunner, failed_at

log = structlog.get_logger("worker")

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
        self.golden = golden_set(
            runner, validation, context.served_batches, context.served.samples if context.served else ()
        )
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
        refusal = cpu_refusal(name, self.caps) or self.attempts.refusal(name) or self.context.evidence_refusal(name)
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
        batches = timed_batches(self.runner.specs, self.context.served_batches)
        size = timing_size(self.runner.specs, batches, self.validation, self.context.typical_shape, self.context.served)
        inputs = size.inputs

        def served_mix() -> None:
            for case in size.mix:
                self.runner.forward(case)

        def contender(candidate: _Candidate) -> Contender:
            runs = {b: (lambda case=inputs[b]: self.runner.forward(case)) for b in size.batches}
            mixed: dict[int, Callable[[], object]] = {1: served_mix}
            return Contender(candidate.name, lambda: self.install(candidate), mixed if size.mix else runs)

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
    path = decision_path(context, chain, tolerance, timed_batches(trial.runner.specs, context.served_batches))
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
    batches = timed_batches(trial.runner.specs, context.served_batches)
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
