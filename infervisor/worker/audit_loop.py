"""The audit process's loop: load eager fp32 once, then judge each served answer the supervisor sends.

Loaded with another profile than eager (its launch chain), the same process is a model's shadow: it runs each
sampled request on the lossy candidate the background builder passed and judges the candidate's answer against
the exact one served, by the same measures (supervisor/lifecycle/shadow.py decides the switch).

Each AUDIT carries a request as the worker got it and the answer it gave; the reply is one AUDIT_RESULT with
the gate's figures per row (profiles/validate.py: the same `compare` and `Tolerance`, so an answer the gate
would have refused on its validation set is refused here too). The process reads nothing but its link: no
shared memory (the supervisor never samples a request whose inputs a client left there) and no files.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch

from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.arrays import from_frame
from infervisor.protocol.client_messages import decode_reply
from infervisor.protocol.constants import MAX_HEADER_BYTES, MAX_MESSAGE_LEN, WorkerExitCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link, LinkClosed
from infervisor.worker.loader import default_output_names, load_model
from infervisor.worker.memory import trim_heap
from infervisor.worker.profiles.validate import Agreement, Tolerance, compare
from infervisor.worker.request_path import prepare
from infervisor.worker.runner import ModelRunner
from infervisor.worker.shared_inputs import SharedInputs
from infervisor.worker.start import load_candidate

log = structlog.get_logger("worker")

#: How long a reply may wait for room on the link before the supervisor counts as gone.
_SEND_TIMEOUT_S = 30.0


def run(launch: LaunchSpec) -> int:
    """Load eager fp32, say READY, then answer AUDITs until STOP or the supervisor is gone."""
    structlog.contextvars.bind_contextvars(worker_id=launch.worker_id, model=launch.model)
    torch.set_num_threads(launch.threads)
    os.set_inheritable(launch.link_fd, False)
    link = Link(socket.socket(fileno=launch.link_fd), WORKER_LINK_FRAMES, max(launch.max_frame_bytes, MAX_HEADER_BYTES))
    started = time.perf_counter()
    shadow = launch.profiles != (REFERENCE_PROFILE,)
    notes: list[str] = []
    try:
        names = launch.output_names or default_output_names(launch.source)
        if shadow:  # the shadow: the candidate profile, judged against the exact answers served
            runner, selection = load_candidate(launch, link, _SEND_TIMEOUT_S)
            notes = list(selection.notes)
        else:  # the gate's reference: the module as loaded, fp32, NCHW, no profile applied
            runner = ModelRunner(load_model(launch.source, launch.inputs), launch.inputs, names)
    except Exception as exc:  # noqa: BLE001 - any load failure is this process's end, said to the supervisor
        error = f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE_LEN]
        log.error("audit_load_failed", error=error)
        _send(link, wm.LoadError(error))
        return WorkerExitCode.LOAD_FAILED
    load_ms = (time.perf_counter() - started) * 1000.0
    cpus = sorted(os.sched_getaffinity(0))
    try:
        _send(link, wm.Ready(launch.worker_id, os.getpid(), load_ms, 0.0, torch.get_num_threads(), cpus,
                             launch.profiles[0], [], notes))  # fmt: skip
        return _serve(link, launch, runner, Tolerance(**launch.tolerance), shadow)
    except (LinkClosed, ProtocolError) as exc:
        log.info("audit_link_ended", reason=str(exc))
        return WorkerExitCode.SUPERVISOR_LOST
    finally:
        link.close()


def _send(link: Link, message: wm.WorkerMessage) -> None:
    link.send(wm.encode(message))
    if link.wants_write:
        link.flush_blocking(_SEND_TIMEOUT_S)


def _serve(link: Link, launch: LaunchSpec, runner: ModelRunner, tolerance: Tolerance, shadow: bool) -> int:
    """Answer each AUDIT in turn (the process dies with the supervisor: a quiet link is only waited on)."""
    shared = SharedInputs(client_group=None)
    while True:
        if not link.wait_readable(60.0):
            continue
        for frames in link.receive():
            message = wm.decode(frames[0])
            if isinstance(message, wm.Stop):
                return WorkerExitCode.OK
            if isinstance(message, wm.Audit):
                _send(link, audit(message, frames[1:], launch, runner, shared, tolerance, shadow))
                # An eager pass leaves its activations in glibc's free lists (resnet50: 27 MB after batch-1
                # passes, 84 MB after batch 8) that the process would hold for life; the trim costs 2-12 ms
                # against a pass of 100 ms and more, off the request path.
                trim_heap()


def audit(
    message: wm.Audit,
    frames: list[Any],
    launch: LaunchSpec,
    runner: ModelRunner,
    shared: SharedInputs,
    tolerance: Tolerance,
    shadow: bool = False,
) -> wm.AuditResult:
    """One served answer against eager fp32, or (`shadow`) the candidate's answer against the served exact one: the
    gate's figures, and the rows that miss the tolerance."""
    cpu_started = time.process_time()
    inputs, answer = frames[: message.input_frames], frames[message.input_frames :]
    try:
        prepared = prepare(launch, runner, shared, inputs, None)
        shapes = ", ".join(f"{d.name}{list(d.shape)}" for d in prepared.infer.inputs)
        ran = runner.forward(prepared.inputs)
        served = _served_outputs(answer)
    except (ProtocolError, ValueError) as exc:
        # Not a verdict on the profile: the sample could not be read back (reported as such, counted nowhere).
        why = getattr(exc, "message", str(exc))
        return wm.AuditResult(message.seq, 0, 0, 1.0, 0, 0.0, "", 0.0, True, f"unreadable sample: {why}", "",
                              (time.process_time() - cpu_started) * 1000.0)  # fmt: skip
    mine = [array for _, array in ran]
    reference, judged = (served, mine) if shadow else (mine, served)
    agreement = compare(reference, judged, [name for name, _ in ran])
    failure = agreement.failure(tolerance)
    rows = max(1, agreement.rows)
    below = rows_below(agreement, tolerance)
    if failure is not None:
        below = max(below, 1)
    return wm.AuditResult(
        message.seq, rows, below, agreement.cosine, agreement.failing_row(tolerance), agreement.relative.error,
        agreement.relative.output, agreement.max_abs_error, agreement.top1_agree, failure, shapes,
        (time.process_time() - cpu_started) * 1000.0,
    )  # fmt: skip


def _served_outputs(answer: Sequence[Any]) -> list[np.ndarray[Any, Any]]:
    """The arrays of a worker's successful reply (its client result header, then one frame per output)."""
    if not answer:
        raise ValueError("the sample carries no served answer")
    result = decode_reply(answer[0], [len(frame) for frame in answer[1:]])
    if isinstance(result, ProtocolError):
        raise ValueError(f"the served answer is an error: {result.message}")
    return [from_frame(desc, frame) for desc, frame in zip(result.outputs, answer[1:], strict=True)]


def rows_below(agreement: Agreement, tolerance: Tolerance) -> int:
    """The rows whose cosine, relative error or worst element misses the tolerance (every row when the outputs are
    not finite)."""
    if not np.isfinite(agreement.max_abs_error):
        return max(1, agreement.rows)
    below = {row for row, cosine in enumerate(agreement.cosines) if cosine < tolerance.min_cosine}
    limit = tolerance.max_rel_error
    if agreement.relative.output and limit is not None:
        below |= {row for row, error in enumerate(agreement.relative.per_row) if not error <= limit}
    element = tolerance.max_element_error
    if agreement.element.output and element is not None:
        below |= {row for row, error in enumerate(agreement.element.per_row) if not error <= element}
    return len(below)
