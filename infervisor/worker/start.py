"""The worker's start sequence: load the model, select and install its profile (re-exec after a build), warm up,
and build READY; a load that fails is told to the supervisor as LOAD_ERROR before the worker exits LOAD_FAILED."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from infervisor.common import verdicts
from infervisor.common.cpuinfo import read_caps
from infervisor.common.json_logs import adopt_library_handlers
from infervisor.common.profiles import PROFILES, REFERENCE_PROFILE
from infervisor.common.strict_modes import UnsafePath
from infervisor.common.text import clip
from infervisor.common.verdicts import Verdicts
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import MAX_MESSAGE_LEN, StartPhase, WorkerExitCode
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.worker_link import Link, LinkClosed
from infervisor.worker import reexec
from infervisor.worker.loader import ModelLoadError, default_output_names, load_model
from infervisor.worker.memory import release_unused_memory
from infervisor.worker.open_dims import hinted
from infervisor.worker.profiles.attempts import AttemptLog
from infervisor.worker.profiles.build import package_options
from infervisor.worker.profiles.builders import REJECTED_NOTE, BuildContext
from infervisor.worker.profiles.cache import ArtifactCache, artifact_key, model_digest
from infervisor.worker.profiles.coverage import Covered, Reloaded
from infervisor.worker.profiles.recorded import read_served_inputs
from infervisor.worker.profiles.select import Selection, check_profiles, select_profile
from infervisor.worker.profiles.sequence_gate import sequence_gate_for, validation_samples
from infervisor.worker.profiles.validate import Tolerance
from infervisor.worker.progress import LinkProgress
from infervisor.worker.runner import ModelRunner, timed_ms
from infervisor.worker.state_check import refuse_stateful

log = structlog.get_logger("worker")


@dataclass(frozen=True)
class Started:
    """A model loaded, selected and warmed: the runner that serves and the READY that announces it."""

    runner: ModelRunner
    ready: wm.Ready


def build_context(launch: LaunchSpec, runner: ModelRunner, progress: LinkProgress | None = None) -> BuildContext:
    """What profile building needs: the example inputs, and for cached artifacts the model's digest."""
    example = tuple(runner.example_inputs()[s.name] for s in runner.specs)
    if launch.channels_last:
        example = tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in example)
    # Hashing every weight costs ~0.2 s on ResNet-50: only paid when something is kept under the digest (a
    # package, a fastest pick, or the crash markers of any profile but the eager reference).
    cached = launch.pick == "fastest" or any(p != REFERENCE_PROFILE for p in launch.profiles)
    digest = model_digest(runner.module, launch.source) if cached else ""
    cache = ArtifactCache(Path(launch.cache_dir), progress) if launch.cache_dir else None
    known = read_verdicts(launch, cache, runner, digest) if digest else None
    trusted = cache.root if cache is not None and known is not None and cache.trusted() else None
    return BuildContext(
        module=runner.module,
        example=example,
        specs=runner.specs,
        digest=digest,
        channels_last=launch.channels_last,
        cache=cache,
        calibration=Path(launch.calibration) if launch.calibration else None,
        validation=Path(launch.validation) if launch.validation else None,
        served_batches=tuple(launch.served_batches),
        typical_shape=launch.typical_shape,
        sequences=sequence_gate_for(launch, runner),
        verdicts=known,
        needs_evidence=launch.shadow and not launch.build_only,
        served=read_served_inputs(
            trusted, known.key if known else "", launch.model, launch.recorded_inputs_mb, runner.specs
        ),
    )


def read_verdicts(launch: LaunchSpec, cache: ArtifactCache | None, runner: ModelRunner, digest: str) -> Verdicts:
    """What live traffic proved about this model's profiles (none from a cache that fails the strict modes, or a
    damaged file: then no refusal is honoured and no lossy profile counts as proven)."""
    specs = [[s.name, s.dtype, s.config_shape()] for s in runner.specs]
    key = verdicts.spec_key(digest, specs, launch.tolerance, launch.calibration or "", launch.channels_last)
    if cache is None or not cache.trusted():
        return verdicts.Verdicts(launch.model, key, {}, {})
    try:
        if launch.build_only:  # the weights, spec, tolerance or calibration changed: older verdicts do not hold
            verdicts.forget_others(cache.root, launch.model, key)
        return verdicts.read(cache.root, key)
    except (UnsafePath, ValueError, OSError) as exc:
        log.error("verdicts_refused", key=key, error=str(exc))
        return verdicts.Verdicts(launch.model, key, {}, {})


def attempt_log(launch: LaunchSpec, context: BuildContext) -> AttemptLog:
    """The crash markers of this model's profiles, keyed like their packages (model, spec, options, torch, CPU)."""
    # What can make the profile crash, not what judges it: a validation set only changes the gate's inputs, so
    # adding one must not retry a profile that crashed the worker (the key still holds model, spec and torch).
    options = {
        "channels_last": launch.channels_last,
        "calibration": launch.calibration or "",
        **package_options(context.specs),
    }
    stems = {
        name: ArtifactCache.stem_for(name, artifact_key(context.digest, name, context.specs, options))
        for name in launch.profiles
        if name != REFERENCE_PROFILE
    }
    # Crash markers are read back as reasons: never from a cache others could have written them in.
    root = context.cache.root if context.cache is not None and context.cache.trusted() else None
    return AttemptLog(root, stems, launch.recent_exits, launch.compile_timeout_s)


def start_model(launch: LaunchSpec, link: Link, progress: LinkProgress) -> Started | int:
    """Load, select, (re-exec after a build,) warm: the runner and its READY, or the exit code of a start that ends
    here (build-only, or a load failure told to the supervisor as LOAD_ERROR)."""
    first = reexec.carried()
    started = first.started if first is not None else time.perf_counter()
    progress.phase(StartPhase.LOADING, "", "" if first is None else "restarted after building: loading from the cache")
    try:
        chosen = _load_and_select(launch, link, progress, started)
        if isinstance(chosen, int):
            return chosen
        runner, selection, attempts = chosen
        # What only the selection used (the eager module a package replaced, the gate's inputs and outputs) is
        # garbage now: collected and handed back to the kernel before the worker serves for days (memory.py).
        release_unused_memory()
        if first is not None:
            selection.notes.extend([*first.notes, first.note()])
        load_ms = timed_ms(started)
        warm_started = time.perf_counter()
        progress.phase(StartPhase.WARMING, selection.profile)
        with attempts.attempting(selection.profile, "warming up"):
            runner.warm_up(max(1, launch.warmup_iterations))
        warmup_ms = timed_ms(warm_started)
        adopt_library_handlers()  # a model's libraries (transformers, ...) may have installed handlers while loading
    except ModelLoadError as exc:
        log.error("model_load_failed", error=str(exc))
        return _load_failed(link, progress, str(exc))
    except Exception as exc:  # noqa: BLE001 - a model that cannot run its declared inputs failed to load
        error = hinted(f"{type(exc).__name__}: {exc}", lambda: _eager_runner(launch))
        log.error("model_warmup_failed", error=error)
        return _load_failed(link, progress, error)
    return Started(runner, _ready(launch, selection, load_ms, warmup_ms))


def load_candidate(launch: LaunchSpec, link: Link, send_timeout_s: float) -> tuple[ModelRunner, Selection]:
    """The shadow process's runner: the model with the one profile of its chain loaded from what the background
    builder built (ready_only: nothing is built here) and gated as a worker gates it; ModelLoadError when that
    profile did not come up (the shadow never judges eager in its place)."""
    progress = LinkProgress(link, launch.profiles, send_timeout_s)
    chosen = _load_and_select(launch, link, progress, time.perf_counter())
    if isinstance(chosen, int):
        raise ModelLoadError(f"the shadow of {launch.profiles[0]} ended its start ({chosen})")
    runner, selection, _ = chosen
    if selection.profile != launch.profiles[0]:
        raise ModelLoadError(f"{launch.profiles[0]} did not load for the shadow: {'; '.join(selection.skipped)}")
    return runner, selection


def _eager_runner(launch: LaunchSpec) -> ModelRunner:
    """The model loaded again as eager: a load failure's hint runs it (the serving module may be a package)."""
    return ModelRunner(load_model(launch.source, launch.inputs), launch.inputs, None)


def _load_failed(link: Link, progress: LinkProgress, error: str) -> int:
    """Tell the supervisor why the model cannot load (status shows it, not only this log), then exit LOAD_FAILED."""
    try:
        link.send(wm.encode(wm.LoadError(clip(error, MAX_MESSAGE_LEN))))
        if link.wants_write:
            link.flush_blocking(progress.send_timeout_s)
    except LinkClosed as exc:
        log.warning("load_error_not_sent", error=str(exc))
    return WorkerExitCode.LOAD_FAILED


def _load_and_select(
    launch: LaunchSpec, link: Link, progress: LinkProgress, started: float
) -> tuple[ModelRunner, Selection, AttemptLog] | int:
    """Load the model and install the profile that serves (an exit code for build-only); restarts after a build.

    Its own frame, so that the eager module, the build context and the validation set are unreferenced once
    it returns: a packaged profile serves without them.
    """
    module = load_model(launch.source, launch.inputs)
    names = launch.output_names or default_output_names(launch.source)
    runner = ModelRunner(module, launch.inputs, names, launch.channels_last)
    try:
        refuse_stateful(runner)  # before warm-up and the gate advance a state that every client would share
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that cannot run its declared inputs cannot load
        eager = runner.module
        raise ModelLoadError(
            hinted(f"{type(exc).__name__}: {exc}", lambda: ModelRunner(eager, launch.inputs, None))
        ) from exc
    del module  # the runner and the context hold it while they need it
    context = build_context(launch, runner, progress)
    if context.cache is not None:
        context.cache.ready_only = launch.ready_only
    attempts = attempt_log(launch, context)
    validation = validation_samples(launch, runner, context.sequences)
    tolerance = Tolerance.from_dict(launch.tolerance)
    caps = read_caps()
    selection = select_profile(
        runner,
        launch.profiles,
        tolerance,
        caps,
        context,
        launch.pick,
        validation,
        attempts,
        progress,
        ready_only=launch.ready_only,
    )
    if context.verdicts is not None:  # the key the supervisor records what live traffic shows about it under
        selection.notes.append(f"{verdicts.SPEC_KEY_NOTE}{context.verdicts.key}")
        shadowed = context.verdicts.passed.get(selection.profile)
        if shadowed is not None:
            selection.notes.append(f"{verdicts.SHADOW_PASSED_NOTE}{shadowed.get('why', '')}")
    if selection.profile != REFERENCE_PROFILE:
        # The profile serves only the input shapes where it answers as eager does (coverage.Covered). With a dim
        # other than the batch open, each new shape is checked against eager, so the worker keeps the eager
        # module; with only the batch open, eager is loaded again if the profile ever refuses a shape.
        open_dims = any(None in spec.shape[1:] for spec in launch.inputs)
        eager = context.module if open_dims else Reloaded(lambda: load_model(launch.source, launch.inputs))
        runner.module = Covered(runner.module, eager, selection.profile, check_shapes=open_dims)
    if launch.build_only:
        # The selection built what a worker would; the rest of the chain's packages too, for a later fallback.
        rest = [p for p in launch.profiles if PROFILES[p].packaged and p not in progress.outcomes]
        check_profiles(runner, rest, tolerance, caps, context, validation, attempts, progress)
        log.info(
            "worker_built",
            profile=selection.profile,
            outcomes={k: v[0].value for k, v in progress.outcomes.items()},
        )
        # What a worker of this config would serve now, so the background builder knows whether to switch.
        try:
            link.send(wm.encode(_ready(launch, selection, timed_ms(started), 0.0, announce=False)))
            link.flush_blocking(progress.send_timeout_s)
        except LinkClosed as exc:  # nobody listens (`infervisor build` gone): the cache is filled all the same
            log.warning("pick_not_sent", error=str(exc))
        return WorkerExitCode.OK
    builds = context.cache.builds if context.cache is not None else 0
    # A fresh fastest pick built and timed every profile of the chain; its decision is remembered, so a
    # restarted image builds the winner alone.
    passed = sum(1 for phase, _ in progress.outcomes.values() if phase is StartPhase.PASSED)
    if (builds or passed > 1) and not reexec.restarted():
        # The builder's memory would stay for the worker's life: start over from the cache (reexec.py).
        progress.phase(StartPhase.LOADING, "", "built into the cache: restarting the process to drop the build")
        rejected = tuple(note for note in selection.notes if note.startswith(REJECTED_NOTE))
        reexec.restart(link, launch.link_fd, started, builds, passed, progress.send_timeout_s, rejected)
    return runner, selection, attempts


def _ready(
    launch: LaunchSpec, selection: Selection, load_ms: float, warmup_ms: float, announce: bool = True
) -> wm.Ready:
    ready = wm.Ready(
        launch.worker_id,
        os.getpid(),
        load_ms,
        warmup_ms,
        torch.get_num_threads(),
        sorted(os.sched_getaffinity(0)),
        selection.profile,
        list(selection.skipped),
        list(selection.notes),
    )
    if not announce:  # the background builder's pick: it serves nothing itself
        return ready
    log.info(
        "worker_ready",
        load_ms=round(load_ms, 1),
        warmup_ms=round(warmup_ms, 1),
        threads=torch.get_num_threads(),
        profile=selection.profile,
    )
    return ready
