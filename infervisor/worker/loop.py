"""The worker's serving loop: after READY, requests, canaries and profiling sessions, with in-band heartbeats and
stats, until the supervisor says STOP or DRAIN or goes silent."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import psutil
import structlog
import torch

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.arrays import wire_dtype
from infervisor.protocol.client_messages import encode_result
from infervisor.protocol.constants import MAX_MESSAGE_LEN, ErrorCode, WorkerExitCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.tensors import TensorDesc, parse_descs
from infervisor.protocol.worker_link import Link, LinkClosed
from infervisor.worker import batching
from infervisor.worker.request_path import Prepared, prepare
from infervisor.worker.runner import ModelRunner, timed_ms
from infervisor.worker.shared_inputs import SharedInputs

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
