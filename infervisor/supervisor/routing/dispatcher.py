"""Dispatch: each model's line handed to its workers with room, oldest first, in the batches the batcher decides.

It picks the worker (the least loaded serving one with room in its pipeline), sends the requests as one
forward pass, and adds them to that worker's pipeline; a worker found unreachable gets its requests put
back first in line and its link reported lost. While the CPU throttles it routes to half of each model's
workers only. It never admits, answers a result or judges a worker: the broker does the first two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.routing import batcher
from infervisor.supervisor.routing.model_queue import ModelQueue
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.routing.pipeline import Pipelines
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot
from infervisor.supervisor.workers.worker_links import WorkerLinks

#: Answers an accepted request with an error: (the request, its code, a message).
Fail = Callable[[PendingRequest, ErrorCode, str], None]
#: The workers a model routes to (the pool's members; None once the model left the config).
Members = Callable[[str], Sequence[WorkerSlot] | None]


def _encode_dispatch(requests: list[PendingRequest], now: float) -> list[Any]:
    """One worker message for requests run as one forward pass: a lone REQUEST, or a BATCH of them."""
    encoded: list[Any] = []
    for request in requests:
        queue_ms = (now - request.accepted_at) * 1000.0
        message = wm.Request(request.internal_id, request.deadline, request.accepted_at, queue_ms, request.reader)
        encoded += wm.encode(message, request.frames)
    if len(requests) == 1:
        return encoded
    return wm.encode(wm.Batch([len(r.frames) + 1 for r in requests]), encoded)


class Dispatcher:
    """Sends each model's waiting requests to its workers with room, as the batcher decides."""

    def __init__(
        self,
        queues: dict[str, ModelQueue],
        serving: ServingConfig,
        links: WorkerLinks,
        pipelines: Pipelines,
        fail: Fail,
    ) -> None:
        self.queues = queues
        self.serving = serving
        self.links = links
        self.pipelines = pipelines
        #: Answers an accepted request with an error (through the streams' stage: Streams.fail).
        self.fail = fail
        #: The workers each model routes to (the broker's `route_to` sets it).
        self.members_of: Members = lambda model: None
        #: While the CPU throttles, route to half of each model's workers only (less heat, same answers).
        self.shed = False
        #: Models whose head request waits for batch companions, and until when.
        self.batch_due: dict[str, float] = {}
        self.batches_sent = 0

    def pick_worker(self, config: ModelConfig, spec: tuple[TensorSpec, ...] | None) -> WorkerSlot | None:
        """The least loaded serving worker of the model with room in its pipeline; ties go to the most recently busy.

        Most recently busy, not longest idle: that worker's core is awake and its caches hold the
        model, so at low load one warm worker answers sooner than a rotation through cold ones
        (tiny model, 1 client: 0.31 ms round trip on one worker, 0.38 ms alternating between two).
        Under load every worker is busy anyway.
        """
        best: WorkerSlot | None = None
        best_key = (0, 0.0)
        slots = self.members_of(config.name) or ()
        if self.shed:  # half of the workers that can serve, so shedding never routes to a dead one
            serving = [s for s in slots if s.state is SlotState.SERVING]
            slots = serving[: (len(serving) + 1) // 2]
        batched = config.batching is not None
        for slot in slots:
            if slot.state is not SlotState.SERVING or slot.proc.link is None or not slot.proc.link.sendable:
                continue
            if spec is not None and slot.model.inputs != spec:
                continue
            pipeline = self.pipelines.of(slot)
            held = len(pipeline.held)
            batches = pipeline.batches() if held and batched else 0
            if not batcher.has_room(config.batching, config.prefetch, held, batches):
                continue
            key = (held, -pipeline.progress_at)
            if best is None or key < best_key:
                best, best_key = slot, key
        return best

    def dispatch(self, model: str) -> None:
        """Hand the model's line to its workers with room, oldest first, as the batcher decides."""
        queue = self.queues.get(model)
        config = self.serving.model(model)
        if queue is None or config is None:
            return
        waiting = queue.waiting
        while waiting:
            slot = self.pick_worker(config, waiting[0].spec)
            if slot is None:
                return
            now = time.monotonic()
            self.batch_due.pop(model, None)
            busy = bool(self.pipelines.of(slot).held)
            decision = batcher.decide(waiting, config.batching, now, lambda: self.line_share(model), worker_busy=busy)
            if decision.wait_until is not None:
                self.batch_due[model] = decision.wait_until
                return
            # A worker found gone is no longer picked (its link is closed): the next one is tried.
            self.send_batch(slot, decision.batch, now, config.batching is not None)

    def line_share(self, model: str) -> int | None:
        """The batcher's cap on the next batch of `model`, from how busy its workers are (batcher.share_of_line)."""
        slots = self.members_of(model) or ()
        serving = [slot for slot in slots if slot.state is SlotState.SERVING]
        held = [self.pipelines.of(slot).size for slot in serving]
        idle = sum(
            1 for slot, n in zip(serving, held, strict=True) if not n and slot.proc.link and slot.proc.link.sendable
        )
        return batcher.share_of_line(len(self.queues[model].waiting), idle, held)

    def dispatch_due(self, now: float) -> None:
        """Send the batches whose oldest request has waited its model's `max_queue_delay_us`."""
        for model in [m for m, due in self.batch_due.items() if batcher.is_due(due, now)]:
            self.dispatch(model)

    @property
    def next_batch_due(self) -> float | None:
        """When the earliest waiting batch must go, if any waits."""
        return min(self.batch_due.values(), default=None)

    def send_batch(self, slot: WorkerSlot, batch: list[PendingRequest], now: float, batched: bool) -> None:
        """Send requests to one worker as one forward pass (a lone one as itself); each keeps its id, deadline, reply.

        If the worker is unreachable, they go back first in line and the link is reported lost.
        """
        live = []
        for request in batch:
            if request.expired(now):
                self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
            else:
                live.append(request)
        if not live:
            return
        queue = self.queues[live[0].model]
        if batched:
            queue.batch_sizes[sum(r.rows for r in live)] += 1
            queue.batch_wait_ms.extend((now - request.accepted_at) * 1000.0 for request in live)
        frames = _encode_dispatch(live, now)
        if not self.links.send(slot, frames):
            # Its process is gone or going; the pool settles the slot. The requests keep their place.
            queue.waiting.extendleft(reversed(live))
            self.links.lost(slot, "worker link closed")
            return
        if len(live) > 1:
            self.batches_sent += 1
            for request in live:
                request.batch_id = self.batches_sent
        self.pipelines.add(slot, live, time.monotonic())
