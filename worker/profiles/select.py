"""Walks a model's profile chain: a profile serves only if it builds, runs and matches eager on golden inputs.

pick "first": the first such profile of the chain serves (the chain is the operator's order of
preference, and later entries are the fallbacks). pick "fastest": every profile of the chain is
built, validated and timed, and the fastest serves; that decision is kept in the artifact cache so
a restarted worker builds only the winner.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from common.cpuinfo import CpuCaps
from common.profiles import REFERENCE_PROFILE, cpu_refusal
from protocol.constants import StartPhase
from worker.profiles.attempts import AttemptLog
from worker.profiles.build import BuildContext, Built, ProfileError, build_profile
from worker.profiles.calibration import Inputs
from worker.profiles.flags import apply_global_flags, reset_global_flags
from worker.profiles.validate import Tolerance, compare
from worker.progress import NoProgress, Progress
from worker.runner import ModelRunner

log = structlog.get_logger("worker")

#: Validation samples checked one by one when the batch dim is fixed.
_MAX_CASES = 16
#: Timing a candidate for pick "fastest": at least this many runs, and more until this long has passed.
_TIMING_RUNS = 5
_TIMING_S = 0.5


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
    median_ms: float = 0.0


def golden_cases(runner: ModelRunner, validation: Sequence[Inputs] | None) -> list[dict[str, torch.Tensor]]:
    """The inputs every profile is checked on: batch 1, and a batch of several when the batch dim is dynamic.

    Seeded random inputs by default; the model's validation set when one is configured (random
    inputs say little about a quantized model with real weights). A dynamic batch is checked at
    more than 1 as well: tracing can bake batch 1 into a graph, and packages keep a batch-1 variant.
    """
    names = [spec.name for spec in runner.specs]
    dynamic = any(d is None for spec in runner.specs for d in spec.shape)
    if not validation:
        # 3, not 2: packages are exported at 2, so only another size shows a batch baked into the graph.
        batches = [1, 3] if dynamic else [1]
        return [runner.example_inputs(batch=b) for b in batches]
    samples = [dict(zip(names, sample, strict=True)) for sample in validation[:_MAX_CASES]]
    if not dynamic:
        return samples
    together = {name: torch.cat([sample[name] for sample in samples]) for name in names}
    return [samples[0], together] if len(samples) > 1 else [samples[0]]


def _median_ms(run: Callable[[], Any]) -> float:
    times: list[float] = []
    stop = time.perf_counter() + _TIMING_S
    while len(times) < _TIMING_RUNS or (time.perf_counter() < stop and len(times) < 200):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000.0)
    return sorted(times)[len(times) // 2]


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
    ) -> None:
        self.attempts = attempts or AttemptLog(None, {}, [])
        self.progress = progress or NoProgress()
        self.runner = runner
        self.context = context
        self.tolerance = tolerance
        self.caps = caps
        self.eager = runner.module
        self.cases = golden_cases(runner, validation)
        self.reference = [[a for _, a in runner.forward(case)] for case in self.cases]

    def attempt(self, name: str) -> _Candidate | str:
        """The validated candidate installed on the runner, or why it does not qualify (runner back on eager)."""
        refusal = cpu_refusal(name, self.caps) or self.attempts.refusal(name)
        if refusal is not None:
            self.progress.phase(StartPhase.REFUSED, name, refusal)
            return refusal
        started = time.perf_counter()
        # A failure is the build's (or a crash on the golden inputs) unless the tolerance is what failed.
        outcome = StartPhase.REJECTED
        try:
            # A native crash in here leaves the marker: the next worker skips this profile instead of crashing too.
            with self.attempts.attempting(name, "building and checking"):
                self.progress.phase(StartPhase.BUILDING, name)
                built = build_profile(name, self.context)
                self.runner.module = built.callable
                self.runner.forward(self.cases[0])  # first runs compile or specialise a graph
                self.progress.phase(StartPhase.CHECKING, name)
                failure = None
                cosine = 1.0
                for case, reference in zip(self.cases, self.reference, strict=True):
                    agreement = compare(reference, [a for _, a in self.runner.forward(case)])
                    cosine = min(cosine, agreement.cosine)
                    failure = failure or agreement.failure(self.tolerance)
        except ProfileError as exc:
            failure, outcome = str(exc), StartPhase.FAILED
        except Exception as exc:  # noqa: BLE001 - a profile that crashes on golden inputs is skipped, not fatal
            failure = f"{name} crashed on golden inputs: {type(exc).__name__}: {str(exc)[:300]}"
            outcome = StartPhase.FAILED
        if failure is not None:
            self.progress.phase(outcome, name, failure)
            self.reset()
            return failure
        candidate = _Candidate(name, built, cosine, (time.perf_counter() - started) * 1000.0)
        self.progress.phase(StartPhase.PASSED, name, "; ".join([*built.notes, _built_in(candidate)]))
        return candidate

    def time(self, candidate: _Candidate) -> float:
        """Median batch-1 latency of the candidate, installed on the runner for the measurement."""
        self.runner.module = candidate.built.callable
        apply_global_flags(candidate.name)
        golden = self.cases[0]
        with self.attempts.attempting(candidate.name, "being timed"):
            return _median_ms(lambda: self.runner.forward(golden))

    def reset(self) -> None:
        """Back to eager, with every process-wide flag a profile switches off."""
        self.runner.module = self.eager
        reset_global_flags()

    def install(self, candidate: _Candidate) -> None:
        """Serve the candidate."""
        self.runner.module = candidate.built.callable
        apply_global_flags(candidate.name)


def _decision_path(context: BuildContext, chain: Sequence[str], tolerance: Tolerance) -> Path | None:
    if context.cache is None:
        return None
    key = {
        "model": context.digest,
        "chain": list(chain),
        "tolerance": asdict(tolerance),
        "threads": torch.get_num_threads(),
        "channels_last": context.channels_last,
        "calibration": str(context.calibration),
        "validation": str(context.validation),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return context.cache.root / f"pick-{name}.json"


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
) -> Selection:
    """Install the chosen profile of `chain` on the runner; eager is the last resort."""
    trial = _Trial(runner, context, tolerance, caps, validation, attempts, progress)
    skipped: list[str] = []
    if pick == "fastest":
        decided = _decided(trial, context, chain, tolerance)
        if decided is not None:
            return decided
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
    path = _decision_path(context, chain, tolerance)
    if path is None or not path.exists():
        return None
    try:
        decision = json.loads(path.read_text())
        name, timings = str(decision["profile"]), dict(decision["timings_ms"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    outcome = trial.attempt(name)
    if not isinstance(outcome, _Candidate):
        log.warning("cached_pick_failed", profile=name, reason=outcome)
        return None
    notes = [
        *outcome.built.notes,
        _built_in(outcome),
        f"fastest of {_timing_text(timings)} (decided earlier, {path.name})",
    ]
    log.info("profile_selected", profile=name, build_ms=round(outcome.build_ms, 1), pick="cached")
    return Selection(name, list(decision.get("skipped", [])), outcome.build_ms, outcome.cosine, notes)


def _built_in(candidate: _Candidate) -> str:
    return f"built and checked against eager in {candidate.build_ms:.0f} ms (cosine {candidate.cosine:.5f})"


def _timing_text(timings: dict[str, float]) -> str:
    return ", ".join(f"{n} {ms:.3g} ms" for n, ms in sorted(timings.items(), key=lambda item: item[1]))


def _pick_fastest(trial: _Trial, context: BuildContext, chain: Sequence[str], tolerance: Tolerance) -> Selection:
    skipped: list[str] = []
    slower: list[str] = []
    timings: dict[str, float] = {}
    best: _Candidate | None = None
    for name in chain:
        outcome = trial.attempt(name)
        if isinstance(outcome, _Candidate):
            trial.progress.phase(StartPhase.TIMING, name)
            outcome.median_ms = trial.time(outcome)
            timings[name] = round(outcome.median_ms, 4)
            # Only the fastest so far stays alive: every candidate holds its own weights (or packages).
            loser = outcome if best is not None and outcome.median_ms >= best.median_ms else best
            best = outcome if loser is not outcome else best
            if loser is not None:
                slower.append(f"{loser.name}: passed (cosine {loser.cosine:.5f}), {loser.median_ms:.3g} ms (slower)")
        else:
            skipped.append(f"{name}: {outcome}")
        trial.reset()
    if best is None:
        return _last_resort(trial, chain, skipped)
    skipped += slower
    trial.install(best)
    _remember(
        _decision_path(context, chain, tolerance), {"profile": best.name, "timings_ms": timings, "skipped": skipped}
    )
    notes = [*best.built.notes, _built_in(best), f"fastest of {_timing_text(timings)}"]
    log.info("profile_selected", profile=best.name, pick="fastest", timings_ms=timings, skipped=skipped)
    return Selection(best.name, skipped, best.build_ms, best.cosine, notes)


def _remember(path: Path | None, decision: dict[str, object]) -> None:
    """Store a fastest-pick decision atomically; siblings may write the same one at once, and losing it is harmless."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(decision, file)
        os.replace(temporary, path)
    except OSError as exc:  # a full or read-only cache only costs the next restart a new pick
        log.warning("pick_not_remembered", path=str(path), error=str(exc))


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
