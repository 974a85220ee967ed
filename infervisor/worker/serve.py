"""The worker's serving loop: load, warm, READY, then requests and in-band heartbeats until told to stop."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import structlog
import torch

from infervisor.common.cpuinfo import read_caps
from infervisor.common.json_logs import adopt_library_handlers
from infervisor.common.profiles import PROFILES, REFERENCE_PROFILE
from infervisor.common.text import clip
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.arrays import wire_dtype
from infervisor.protocol.client_messages import encode_result
from infervisor.protocol.constants import MAX_HEADER_BYTES, MAX_MESSAGE_LEN, ErrorCode, StartPhase, WorkerExitCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.tensors import TensorDesc, parse_descs
from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link, LinkClosed
from infervisor.worker import batching, reexec
from infervisor.worker.loader import ModelLoadError, default_output_names, load_model
from infervisor.worker.memory import release_unused_memory
from infervisor.worker.open_dims import hinted
from infervisor.worker.process_tree import become_subreaper, end_descendants
from infervisor.worker.profiles.attempts import AttemptLog
from infervisor.worker.profiles.build import package_options
from infervisor.worker.profiles.builders import REJECTED_NOTE, BuildContext
from infervisor.worker.profiles.cache import ArtifactCache, artifact_key, model_digest
from infervisor.worker.profiles.coverage import Covered, Reloaded
from infervisor.worker.profiles.select import Selection, check_profiles, select_profile
from infervisor.worker.profiles.sequence_gate import sequence_gate_for, validation_samples
from infervisor.worker.profiles.validate import Tolerance
from infervisor.worker.progress import LinkProgress
from infervisor.worker.request_path import Prepared, prepare
from infervisor.worker.runner import ModelRunner, timed_ms
from infervisor.worker.shared_inputs import SharedInputs
from infervisor.worker.state_check import refuse_stateful

log = structlog.get_logger("worker")

#: Operators reported by a profiling session.
_PROFILE_TOP = 15


class WorkerLoop:
    """Owns the link to the supervisor and the model runner."""

    def __init__(self, launch: LaunchSpec, runner: ModelRunner, link: Link) -> None:
        self.launch = launch
        self.runner = runner
        self.link = link
        self.interval = launch.heartbeat_interval_ms / 1000.0
        self.silence_limit = self.interval * launch.heartbeat_liveness
        self.requests = 0
        self.last_sent = 0.0
        self.last_heard = time.monotonic()
        self.last_stats = 0.0
        self.process = psutil.Process()
        #: A torch.profiler session over the next `profile_request.requests` requests (the PROFILE message), or None.
        self.profiler: Any = None
        self.profile_request: wm.Profile | None = None
        #: Requests the open session has covered so far (every member of a batch counts).
        self.profiled = 0
        #: Where inputs that a client left in shared memory are copied to (infervisor/worker/shared_inputs.py).
        self.shared_inputs = SharedInputs(client_group=launch.client_gid)

    def send(self, message: wm.WorkerMessage, frames: list[Any] | None = None) -> None:
        """Send one message (any send counts as a heartbeat); LinkClosed if the supervisor stopped reading."""
        self.link.send(wm.encode(message, frames or []))
        if self.link.wants_write:
            self.link.flush_blocking(self.silence_limit)
        self.last_sent = time.monotonic()

    def run(self, ready: wm.Ready) -> int:
        """Say READY, then serve until STOP/DRAIN or the supervisor is gone or silent; returns the exit code."""
        try:
            self.send(ready)
            return self.serve_messages()
        except LinkClosed as exc:
            log.error("supervisor_lost", reason=str(exc))
            return WorkerExitCode.SUPERVISOR_LOST
        except ProtocolError as exc:  # the stream lost its framing: nothing after it can be trusted
            log.error("supervisor_link_garbled", error=exc.message)
            return WorkerExitCode.SUPERVISOR_LOST
        finally:
            # A torch.profiler session still open when the interpreter exits kills the process with SIGSEGV
            # (its collector is torn down under it): whatever ends the loop ends the session first.
            self.end_profile_quietly("ended because the worker lost its supervisor")

    def serve_messages(self) -> int:
        """Wait for messages (one wake-up each), handle them in arrival order, keep heartbeats and stats going."""
        while True:
            # Waiting at most a heartbeat interval: after a long inference the heartbeats are
            # waiting unread, and the next receive takes them, so only an empty link means silence.
            if self.link.wait_readable(self.interval):
                messages = self.link.receive()
                if messages:
                    self.last_heard = time.monotonic()
                for frames in messages:
                    outcome = self.handle(frames)
                    if outcome is not None:
                        return outcome
            else:
                silent = time.monotonic() - self.last_heard
                if silent > self.silence_limit:
                    log.error("supervisor_lost", silent_s=round(silent, 3))
                    return WorkerExitCode.SUPERVISOR_LOST
            now = time.monotonic()
            if now - self.last_stats >= self.launch.stats_interval_ms / 1000.0:
                self.send_stats()
            elif now - self.last_sent >= self.interval:
                self.send(wm.Heartbeat())

    def handle(self, frames: list[Any]) -> int | None:
        """Act on one message from the supervisor; an exit code ends the loop."""
        try:
            message = wm.decode(frames[0])
        except ProtocolError as exc:
            log.error("bad_supervisor_message", error=exc.message)
            return None
        if isinstance(message, wm.Request):
            self.serve_requests([(message, frames[1:])])  # a lone request is a batch of one
        elif isinstance(message, wm.Batch):
            self.serve_requests(self.batch_members(message, frames[1:]))
        elif isinstance(message, wm.Canary):
            started = time.perf_counter()
            try:
                error, scale = self.runner.canary()
            except Exception as exc:  # noqa: BLE001 - a model that cannot rerun its golden inputs fails the canary
                log.error("canary_crashed", error=f"{type(exc).__name__}: {exc}")
                error, scale = float("inf"), 1.0
            self.send(wm.CanaryResult(message.seq, error, scale, timed_ms(started)))
        elif isinstance(message, wm.Profile):
            self.start_profile(message)
        elif isinstance(message, (wm.Stop, wm.Drain)):
            # Requests are served one at a time, so by the time DRAIN is read nothing is in hand.
            log.info("worker_exiting", reason=type(message).__name__.lower(), requests=self.requests)
            why = "shutdown" if isinstance(message, wm.Stop) else "the worker's retirement"
            self.finish_profile(f"ended by {why}")
            return WorkerExitCode.OK
        return None

    def serve_requests(self, requests: list[tuple[wm.Request, list[Any]]]) -> None:
        """The one entry of every request, lone or batched: answer them, and count them in an open profiling session."""
        self.answer(requests)
        if self.profile_request is not None:
            self.profiled += len(requests)
            if self.profiled >= self.profile_request.requests:
                self.finish_profile(None)

    def start_profile(self, message: wm.Profile) -> None:
        """Profile the next requests (a session already open reports what it has, ended by this one)."""
        from torch.profiler import ProfilerActivity, profile

        self.finish_profile(f"ended by profile seq {message.seq}")
        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.__enter__()
        self.profile_request, self.profiled = wm.Profile(message.seq, max(1, message.requests)), 0
        # Starting the profiler takes seconds: this heartbeat tells the supervisor it is over (its hang budget
        # for the requests waiting behind it starts again from here).
        self.send(wm.Heartbeat())

    def end_profile_quietly(self, ended: str) -> None:
        """Close an open session on the way out; its report is sent if the link still carries it."""
        try:
            self.finish_profile(ended)
        except (LinkClosed, ProtocolError) as exc:
            log.warning("profile_report_not_sent", error=str(exc))

    def finish_profile(self, ended: str | None) -> None:
        """Close the open session, if any, and send the operators that took the most CPU themselves.

        `ended` is None when the session covered the requests asked for, else why it ended sooner.
        """
        profiler, request = self.profiler, self.profile_request
        if profiler is None or request is None:
            return
        self.profiler, self.profile_request = None, None
        profiler.__exit__(None, None, None)
        if ended is not None:
            ended = f"{ended} after {self.profiled} of {request.requests} requests"
            log.info("profile_ended_early", seq=request.seq, ended=ended)
        averages = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        operators = [
            {
                "name": str(e.key)[:120],
                "calls": int(e.count),
                "self_ms": round(e.self_cpu_time_total / 1000.0, 3),
                "total_ms": round(e.cpu_time_total / 1000.0, 3),
            }
            for e in averages[:_PROFILE_TOP]
        ]
        self.send(wm.ProfileResult(request.seq, self.profiled, json.dumps(operators), ended))

    def send_result(
        self,
        request: wm.Request,
        prepared: Prepared,
        outputs: list[tuple[str, np.ndarray[Any, Any]]],
        received: float,
        decode_ms: float,
        model_ms: float,
    ) -> None:
        """Answer a request with its outputs and timing (an output over the frame limit is an error instead)."""
        encode_started = time.perf_counter()
        try:
            descs = self.output_descs(outputs)
        except ProtocolError as exc:
            self.reply_error(request.request_id, exc.code, exc.message)
            return
        queue_ms = request.queue_ms
        # Rounded to 0.001 ms as docs/protocol.md section 6 says: finer digits are noise, and cost header bytes.
        timing = {
            "queue_ms": round(queue_ms, 3),
            # Broker dispatch to this worker's receive, including any wait behind earlier requests in its pipeline.
            "dispatch_ms": round((received - request.accepted_at) * 1000.0 - queue_ms, 3),
            "decode_ms": round(decode_ms, 3),
            "model_ms": round(model_ms, 3),
            "encode_ms": round(timed_ms(encode_started), 3),
            "total_ms": round((time.monotonic() - request.accepted_at) * 1000.0, 3),
            # The broker's accept on the host's CLOCK_MONOTONIC: a same-host client splits its round trip with it.
            "accepted_clock_ms": round(request.accepted_at * 1000.0, 3),
        }
        header = encode_result(prepared.infer.request_id, prepared.infer.model, descs, timing)
        self.send(wm.Reply(request.request_id, None, ""), [header, *[array for _, array in outputs]])

    def batch_members(self, batch: wm.Batch, frames: list[Any]) -> list[tuple[wm.Request, list[Any]]]:
        """The REQUESTs a BATCH holds, each with its frames (a member that cannot be read is only logged)."""
        requests: list[tuple[wm.Request, list[Any]]] = []
        offset = 0
        for count in batch.frame_counts:
            header, member_frames = frames[offset], frames[offset + 1 : offset + count]
            offset += count
            try:
                request = wm.decode(header)
            except ProtocolError as exc:
                log.error("bad_batch_member", error=exc.message)
                continue
            if not isinstance(request, wm.Request):
                log.error("bad_batch_member", error=f"a {type(request).__name__} inside a batch")
                continue
            requests.append((request, member_frames))
        return requests

    def answer(self, requests: list[tuple[wm.Request, list[Any]]]) -> None:
        """Check each request alone, run the good ones as one forward pass, answer each with its own rows.

        A lone request is a batch of one, run as it is (nothing joined or split). A request past its
        deadline or with a bad input gets its own error reply and leaves the batch; a failing forward
        pass is every remaining request's error, never a crash.
        """
        received = time.monotonic()
        started = time.perf_counter()
        members: list[tuple[wm.Request, Prepared]] = []
        for request, frames in requests:
            if request.deadline is not None and received >= request.deadline:
                # It waited in this worker's pipeline past its deadline: running it would be wasted work.
                why = "deadline passed before the model ran"
                self.reply_error(request.request_id, ErrorCode.DEADLINE_EXCEEDED, why)
                continue
            try:
                members.append((request, prepare(self.launch, self.runner, self.shared_inputs, frames, request.reader)))
            except ProtocolError as exc:
                self.reply_error(request.request_id, exc.code, exc.message)
        if not members:
            return
        self.requests += len(members)
        decode_ms = timed_ms(started)
        try:
            model_started = time.perf_counter()
            if len(members) == 1:
                parts = [self.runner.forward(members[0][1].inputs)]
                model_ms = timed_ms(model_started)
            else:
                rows = [next(iter(prepared.inputs.values())).shape[0] for _, prepared in members]
                outputs = self.runner.forward(batching.join([prepared.inputs for _, prepared in members]))
                model_ms = timed_ms(model_started)
                parts = batching.split(outputs, rows)
        except ProtocolError as exc:
            for request, _ in members:
                self.reply_error(request.request_id, exc.code, exc.message)
            return
        except Exception as exc:  # noqa: BLE001 - the model itself failed: every request is answered, the worker serves on
            ids = [request.request_id for request, _ in members]
            log.warning("model_error", request_ids=ids, error=f"{type(exc).__name__}: {exc}")
            for request, _ in members:
                self.reply_error(request.request_id, ErrorCode.INTERNAL, f"model raised {type(exc).__name__}: {exc}")
            return
        for (request, prepared), own in zip(members, parts, strict=True):
            self.send_result(request, prepared, own, received, decode_ms, model_ms)

    def output_descs(self, outputs: list[tuple[str, np.ndarray[Any, Any]]]) -> list[TensorDesc]:
        """The outputs' descriptors; ProtocolError for an output over a link frame's limit or of no wire dtype."""
        limit = self.launch.max_frame_bytes
        descs: list[TensorDesc] = []
        for name, array in outputs:
            if array.nbytes > limit:
                # The supervisor reads a longer frame as a garbled link; the request gets a clear error instead.
                raise ProtocolError(ErrorCode.INTERNAL, f"output {name!r} is {array.nbytes} bytes, limit {limit}")
            dtype = wire_dtype(array.dtype)
            if dtype is None:  # the runner refuses these already (runner.wire_array); never send a name off the list
                raise ProtocolError(ErrorCode.INTERNAL, f"output {name!r} has dtype {array.dtype}, not a wire dtype")
            descs.append(TensorDesc(name, dtype, array.shape))
        try:
            # docs/protocol.md section 5's descriptor checks, here: the broker forwards this header unread.
            parse_descs([d.to_wire() for d in descs], "outputs", allow_empty_dims=True)
        except ProtocolError as exc:
            why = f"the model's outputs fail the descriptor checks: {exc.message}"
            raise ProtocolError(ErrorCode.INTERNAL, why) from exc
        return descs

    def reply_error(self, request_id: int, code: ErrorCode, message: str) -> None:
        """Answer a request with an error code."""
        self.send(wm.Reply(request_id, code.value, message[:MAX_MESSAGE_LEN]))

    def send_stats(self) -> None:
        """Report what this process really runs with, so status can prove the pinning."""
        self.last_stats = time.monotonic()
        self.send(
            wm.Stats(
                self.requests,
                torch.get_num_threads(),
                torch.get_num_interop_threads(),
                sorted(os.sched_getaffinity(0)),
                self.process.memory_info().rss,
            )
        )


def build_context(launch: LaunchSpec, runner: ModelRunner, progress: LinkProgress | None = None) -> BuildContext:
    """What profile building needs: the example inputs, and for cached artifacts the model's digest."""
    example = tuple(runner.example_inputs()[s.name] for s in runner.specs)
    if launch.channels_last:
        example = tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in example)
    # Hashing every weight costs ~0.2 s on ResNet-50: only paid when something is kept under the digest (a
    # package, a fastest pick, or the crash markers of any profile but the eager reference).
    cached = launch.pick == "fastest" or any(p != REFERENCE_PROFILE for p in launch.profiles)
    return BuildContext(
        module=runner.module,
        example=example,
        specs=runner.specs,
        digest=model_digest(runner.module, launch.source) if cached else "",
        channels_last=launch.channels_last,
        cache=ArtifactCache(Path(launch.cache_dir), progress) if launch.cache_dir else None,
        calibration=Path(launch.calibration) if launch.calibration else None,
        validation=Path(launch.validation) if launch.validation else None,
        served_batches=tuple(launch.served_batches),
        typical_shape=launch.typical_shape,
        sequences=sequence_gate_for(launch, runner),
    )


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


def serve(launch: LaunchSpec) -> int:
    """Load and warm the model (telling the supervisor each phase), announce READY, then run the serving loop."""
    structlog.contextvars.bind_contextvars(worker_id=launch.worker_id, model=launch.model)
    torch.set_num_threads(launch.threads)
    # Ours alone: a process this worker starts (a compiler) must not hold the link open past the worker's exit.
    os.set_inheritable(launch.link_fd, False)
    # Open from the start, so the supervisor hears what a long start is doing (PROGRESS) before READY.
    link = Link(
        socket.socket(fileno=launch.link_fd),
        WORKER_LINK_FRAMES,
        max(launch.max_frame_bytes, MAX_HEADER_BYTES),
    )
    first = reexec.carried()
    progress = LinkProgress(link, launch.profiles, launch.heartbeat_interval_ms / 1000.0 * launch.heartbeat_liveness)
    become_subreaper()
    if first is not None:  # a restarted image: its start began in the image that built
        progress.started = first.started
    try:
        return _start_and_serve(launch, link, progress)
    finally:
        # Nothing the model started outlives the worker (a recycle, a stop, a failed load).
        end_descendants()
        link.close()


def _start_and_serve(launch: LaunchSpec, link: Link, progress: LinkProgress) -> int:
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
    return WorkerLoop(launch, runner, link).run(_ready(launch, selection, load_ms, warmup_ms))


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
