"""The request broker: admits client requests into bounded per-model queues, routes them to workers
with room, and sends each one exactly one final reply.

The broker never blocks: every send is NOBLOCK (or queued in a link's outbox), so a client that
stops reading or a worker that vanished costs a counted drop (or a re-dispatch), never a stalled
loop. It never changes a slot's state or kills a process either: a link it finds closed it reports
to the worker links (whose listener, the pool, replaces the worker), and it tells the worker inbox
when a draining worker holds nothing any more. Which worker gets what waits, and when, its dispatcher
(dispatcher.py) and the batcher decide.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog
import zmq

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.client_messages import InferRequest
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.sockets import NOBLOCK, more_to_read, recv_frames
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.host.event_loop import CLIENTS, EventLoop
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.routing.admission import Refused, SpecServed, admit
from infervisor.supervisor.routing.dispatcher import Dispatcher, Members
from infervisor.supervisor.routing.endpoints import ClientEndpoints
from infervisor.supervisor.routing.model_queue import ModelQueue
from infervisor.supervisor.routing.peer_credentials import peer_owner, peer_reader
from infervisor.supervisor.routing.pending import Peer, PendingRequest
from infervisor.supervisor.routing.pipeline import Pipelines, PipelineView
from infervisor.supervisor.routing.replies import Replies
from infervisor.supervisor.routing.streams import Streams
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot
from infervisor.supervisor.workers.worker_links import WorkerLinks

__all__ = ["Broker", "Members", "ModelQueue"]

log = structlog.get_logger("supervisor")

#: Messages taken from one client socket per loop turn, so a flood on one side cannot starve the other.
_BATCH = 256
#: The states of a worker that serves a spec now, or will again (a rollout's spec is alive while one does).
_SERVING = (SlotState.SERVING,)
_ALIVE = (SlotState.SERVING, SlotState.STARTING, SlotState.BACKOFF)

#: Offered every successful answer (slot, request, the worker's result frames): the live audit's sampler.
AuditTap = Callable[[WorkerSlot, PendingRequest, list[Any]], None]


class LostWork(Protocol):
    """What the broker reads of the exit decision's order on a dead worker's requests (exit_decision.RequestOrder)."""

    @property
    def split(self) -> bool:
        """The running batch is split in two halves, nobody charged; else the head alone is charged a retry."""

    @property
    def slot_failed(self) -> bool:
        """The slot failed for good: if no member of its model can serve any more, what waits is answered now."""


def _has_capacity(slots: Sequence[WorkerSlot] | None) -> bool:
    """False when every slot of a model has FAILED: queueing would only delay an error.

    An empty pool (a drain-first rollout of a one-worker model) has capacity on its way.
    """
    return not slots or any(s.state is not SlotState.FAILED for s in slots)


def _has_spec(slots: Sequence[WorkerSlot] | None, spec: tuple[TensorSpec, ...], states: Sequence[SlotState]) -> bool:
    """True while some slot of a model built with `spec` is in one of `states`."""
    return any(s.model.inputs == spec and s.state in states for s in slots or ())


def _pending(
    internal_id: int,
    client: Peer,
    request: InferRequest,
    frames: list[Any],
    spec: tuple[TensorSpec, ...] | None,
    cost: int,
    reader: list[int] | None,
    model: ModelConfig,
) -> PendingRequest:
    """An admitted request as the broker holds it until its final reply (`frames`: its header and tensors)."""
    now = time.monotonic()
    pending = PendingRequest(
        internal_id=internal_id,
        client=client,
        request_id=request.request_id,
        model=request.model,
        frames=frames,
        accepted_at=now,
        deadline=now + request.deadline_ms / 1000.0 if request.deadline_ms else None,
        spec=spec,
        cost=cost,
        rows=request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1,
        reader=reader,
    )
    if model.batching is not None:
        pending.shape_key = tuple((d.name, d.dtype, d.shape[1:]) for d in request.inputs)
    return pending


class Broker:
    """Routes client requests to pinned workers with room and their replies back."""

    def __init__(
        self,
        endpoints: ClientEndpoints,
        loop: EventLoop,
        links: WorkerLinks,
        serving: ServingConfig,
        anomalies: Anomalies,
        replies: Replies,
        streams: Streams,
    ) -> None:
        self.endpoints = endpoints
        self.links = links
        self.serving = serving
        self.anomalies = anomalies
        for client_socket in endpoints.sockets:
            loop.register(client_socket, CLIENTS, functools.partial(self.handle_clients, client_socket))
        #: Sends every final reply; an accepted request's through `streams` (client_replies, wired by assembly).
        self.replies = replies
        self.ledger = replies.ledger
        #: False once the daemon stops: new requests are refused SHUTTING_DOWN.
        self.accepting = True
        #: The workers each model routes to: asked of the pool, changed only by the pool.
        self.members_of: Members = lambda model: None
        #: A rollout's new inputs are admitted once a worker built with them serves.
        self.spec_served: SpecServed = lambda model, spec: _has_spec(self.members_of(model), spec, _SERVING)
        #: Each model's line and counters; queue wait, service and total time of every successful request, per model
        #: (instruments/recorders.py).
        self.queues: dict[str, ModelQueue] = replies.queues
        #: Requests refused before they named a served model (malformed, wrong version, unknown model), per code.
        self.refused: collections.Counter[str] = replies.refused
        # Read as they come too, not only before a reply: libzmq blocks its I/O thread on a full monitor.
        for monitor in self.replies.connections.monitor_sockets:
            loop.register(monitor, CLIENTS, lambda flags: self.replies.forget_departed())
        #: Streams of stateful models: their committed state, their steps waiting their turn (streams.py); every
        #: final reply of an accepted request passes through it (a step's commits its stream's state).
        self.streams = streams
        #: What each worker process holds; the pool reads it through `load_of`.
        self.pipelines = Pipelines()
        self.next_id = 1
        #: Hands each model's line to its workers with room (dispatcher.py).
        self.dispatcher = Dispatcher(self.queues, serving, links, self.pipelines, streams.fail)
        #: The live audit's sampler (lifecycle/audit_runner.py: AuditRunner.offer), wired by core/assembly.py.
        self.audit_tap: AuditTap = lambda slot, request, frames: None
        self.sync_queues()

    def stop_accepting(self) -> None:
        """The daemon stops: refuse new requests; what is in hand still gets its answer."""
        self.accepting = False

    def shed_load(self, shed: bool) -> None:
        """While the CPU throttles, route to half of each model's workers only (core/responses.py decides)."""
        self.dispatcher.shed = shed

    def route_to(self, members_of: Members) -> None:
        """Route each model's requests to the workers `members_of` names (the pool's, kept current by the pool)."""
        self.members_of = self.dispatcher.members_of = members_of

    def sync_queues(self) -> None:
        """One queue per model of the serving config, sized as configured now (and the clients' budget).

        The streams whose state pairs the new config changes end here, at once (section 4.1).
        """
        self.streams.end_changed(self.serving.desired)
        self.ledger.budget_bytes = self.serving.current.client_budget_mb * 2**20
        self.ledger.total_budget_bytes = self.serving.current.clients_budget_mb * 2**20
        for name, model in self.serving.current.models.items():
            queue = self.queues.setdefault(name, ModelQueue(model.queue_size))
            queue.capacity = model.queue_size

    def remove_model(self, model: str) -> None:
        """A model left the config: end its streams (their waiting steps STREAM_ENDED), answer what still waits
        for it, then drop its queue."""
        self.streams.end_model(model)
        self.fail_queued(model, ErrorCode.UNKNOWN_MODEL, f"model {model!r} was removed from the config")
        self.queues.pop(model, None)

    @property
    def unanswered(self) -> int:
        """Requests accepted and not yet answered: waiting in a queue, or in a worker's hands."""
        return sum(len(q.waiting) for q in self.queues.values()) + self.pipelines.held_count

    def load_of(self, slot: WorkerSlot) -> PipelineView:
        """What the slot's process holds, read-only: whether it is busy, what runs, since when its head moved."""
        return self.pipelines.of(slot)

    def hold_progress_until(self, slot: WorkerSlot, when: float) -> None:
        """Time the slot's running requests from `when` at the earliest (what waited behind a profiler's start)."""
        self.pipelines.of(slot).hold_progress_until(when)

    # ---- client side ------------------------------------------------------------------------

    def handle_clients(self, socket: zmq.Socket[Any], flags: int = 0) -> None:
        """Take up to a batch of client messages from one client-facing socket (the event loop's handler)."""
        for _ in range(_BATCH):
            try:
                frames = recv_frames(socket, NOBLOCK)
            except zmq.Again:
                return
            client = (socket, frames[0].bytes)
            try:
                self.accept(client, frames)
            except Exception:  # a bug on one message must cost that message, not the daemon
                log.exception("client_message_crashed")
                self.anomalies.count("internal_error")
                self.replies.error(client, None, ErrorCode.INTERNAL, "the broker failed on this message")
            if not more_to_read(socket):
                return

    def accept(self, client: Peer, frames: list[Any]) -> None:
        """Admit one client message into its model's line and dispatch, or answer with an error at once."""
        try:
            request, model, spec = admit(frames, client[0] is self.endpoints.ipc, self.serving, self.spec_served)
        except Refused as refused:
            # Only the except block's own name may hold the refusal: Python unbinds it when the block ends. Bound to
            # another local it would outlive the block in this frame, which its traceback (and its context's) holds:
            # a cycle keeping `frames` (a client's tensors, up to max_frame_bytes each) until a rare full GC pass.
            if refused.stream is not None:  # a step on a stream of a removed model: STREAM_ENDED (section 4.1)
                owner = peer_owner(frames[2], client[0] is self.endpoints.ipc, client[1])
                refused = self.streams.removed_refusal(refused, owner, client)
            self.anomalies.count(refused.anomaly, refused.message)
            self.replies.refuse(client, refused.request_id, refused.model, refused.code, refused.message)
            return
        name, request_id = request.model, request.request_id
        reader = None
        if any(d.shm is not None for d in request.inputs):
            reader = peer_reader(frames[2])
            if reader is None:
                why = "inputs in shared memory need the client's credentials, which this connection did not give"
                self.replies.refuse(client, request_id, name, ErrorCode.INVALID_INPUT, why)
                return
        tensor_frames = frames[3:]
        cost = sum(len(f) for f in tensor_frames) + sum(d.nbytes for d in request.inputs if d.shm is not None)
        queue = self.queues[name]
        over = self.ledger.over_budget(client, cost)
        if over is not None:
            self.replies.refuse(client, request_id, name, ErrorCode.OVERLOADED, over)
            return
        if not self.accepting:
            self.replies.refuse(client, request_id, name, ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            return
        if not _has_capacity(self.members_of(name)):
            why = f"model {name!r} has no live worker slot"
            self.replies.refuse(client, request_id, name, ErrorCode.UNAVAILABLE, why)
            return
        pending = _pending(self.next_id, client, request, frames[2:], spec, cost, reader, model)
        pending.connection = self.replies.connection_of(client, frames[0])
        self.next_id += 1
        if request.stream is not None:  # streams.py: the stream's state goes in, its steps take turns
            self.ledger.take(client, cost)
            owner = peer_owner(frames[2], client[0] is self.endpoints.ipc, client[1])
            try:
                self.streams.admit(pending, request, model, self.serving.target(name), self.spec_served, owner)
            except Refused as refused:
                self.ledger.give_back(client, cost)
                self.anomalies.count(refused.anomaly, refused.message)
                self.replies.refuse(client, request_id, name, refused.code, refused.message)
                return
            self.streams.dispatch_released(self.dispatcher.dispatch)
            return
        if len(queue.waiting) >= queue.capacity:
            why = f"queue of {name!r} is full ({queue.capacity})"
            self.replies.refuse(client, request_id, name, ErrorCode.OVERLOADED, why)
            return
        self.ledger.take(client, cost)
        queue.waiting.append(pending)
        self.dispatcher.dispatch(name)

    # ---- workers lost -----------------------------------------------------------------------

    def worker_lost(self, slot: WorkerSlot, reason: str, order: LostWork) -> None:
        """Carry out the pool's order on what a dead or hung worker held: re-dispatch it (oldest first in line),
        or give up after max_retries; if the slot failed and the model has no slot left, answer what waits.

        A worker serves its pipeline in order, so only the head was running when it died: the one request
        charged a retry, or the batch split in two halves, nobody charged (`order.split`).
        The ones waiting behind it go back in line as they were; a request that lost more than `max_retries`
        workers is answered WORKER_LOST.
        """
        model = self.serving.model(slot.model.name) or slot.model
        running = self.pipelines.of(slot).running()
        held = self.pipelines.take_all(slot)
        split = order.split
        if split:
            half = (len(running) + 1) // 2
            for index, request in enumerate(running):
                request.batch_limit = half if index < half else len(running) - half
            log.warning("batch_split", model=slot.model.name, size=len(running), reason=reason)
        for index in range(len(held) - 1, -1, -1):
            request = held[index]
            charged = index == 0 and not split
            if charged:
                request.losses += 1
            queue = self.queues.get(request.model)
            if request.losses > model.max_retries:
                log.error(
                    "request_lost_worker",
                    model=request.model,
                    request_id=str(request.request_id),
                    losses=request.losses,
                )
                why = f"request {request.request_id!r} lost {request.losses} workers ({reason}); not retried again"
                self.streams.fail(request, ErrorCode.WORKER_LOST, why)
            elif queue is None:
                why = f"model {request.model!r} was removed from the config"
                self.streams.fail(request, ErrorCode.UNKNOWN_MODEL, why)
            else:
                log.warning(
                    "request_redispatched",
                    model=request.model,
                    request_id=str(request.request_id),
                    losses=request.losses,
                    charged=charged,
                )
                queue.waiting.appendleft(request)
                self.streams.requeued(request)  # streams.py: counted as resumed; its state was never committed
        self.dispatcher.dispatch(slot.model.name)
        if order.slot_failed and not _has_capacity(self.members_of(slot.model.name)):
            self.fail_queued(slot.model.name, ErrorCode.UNAVAILABLE, "every worker slot of the model failed")
        self.streams.dispatch_released(self.dispatcher.dispatch)

    def expire(self, now: float) -> None:
        """Answer queued requests whose deadline passed, or whose spec no worker of the model has any more.

        Streams idle past their model's `stream_idle_s`, or whose model's state pairs changed, end here too.
        """
        self.streams.upkeep(now, self.serving.desired)
        for name, queue in self.queues.items():
            expired = any(r.expired(now) for r in queue.waiting)
            specs = {r.spec for r in queue.waiting if r.spec is not None}
            gone = {spec for spec in specs if not _has_spec(self.members_of(name), spec, _ALIVE)}
            if not expired and not gone:
                continue
            keep: collections.deque[PendingRequest] = collections.deque()
            for request in queue.waiting:
                if request.expired(now):
                    self.streams.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                elif request.spec in gone:
                    # A rollout of new inputs was rolled back, or finished: nothing can run this request's spec.
                    why = "the model no longer serves the inputs spec that admitted this request"
                    self.streams.fail(request, ErrorCode.UNAVAILABLE, why)
                else:
                    keep.append(request)
            queue.waiting = keep
        self.streams.dispatch_released(self.dispatcher.dispatch)

    def fail_queued(self, model: str, code: ErrorCode, message: str) -> None:
        """Answer every queued request of one model with `code`."""
        queue = self.queues.get(model)
        while queue is not None and queue.waiting:
            self.streams.fail(queue.waiting.popleft(), code, message)

    def fail_all(self, code: ErrorCode, message: str, slots: Sequence[WorkerSlot]) -> None:
        """Answer every queued request, and every request these workers hold, with `code` (end of a bounded stop)."""
        self.streams.fail_waiting(code, message)
        for model in self.queues:
            self.fail_queued(model, code, message)
        for slot in slots:
            for request in self.pipelines.take_all(slot):
                self.streams.fail(request, code, message)

    # ---- what workers sent (handed here by the worker inbox) ----------------------------------

    def worker_ready(self, slot: WorkerSlot) -> None:
        """A worker became ready: open its pipeline and give it what waits."""
        self.pipelines.open(slot, time.monotonic())
        self.dispatcher.dispatch(slot.model.name)

    def on_reply(self, slot: WorkerSlot, reply: wm.Reply | None, frames: list[Any], why: str = "") -> bool:
        """Forward a worker's answer to the client that asked, exactly once; True when a draining worker is now empty.

        `reply` None: the worker sent a reply too garbled to read (`why`); workers answer in order, so
        it answers the oldest request in hand, which fails.
        """
        pipeline = self.pipelines.of(slot)
        now = time.monotonic()
        request = pipeline.pop_oldest(now) if reply is None else pipeline.pop(reply.request_id, now)
        if request is None:
            if reply is not None:
                self.anomalies.count("reply_stale")
            return False
        if reply is None:
            self.streams.fail(request, ErrorCode.INTERNAL, f"the worker sent a malformed reply: {why}")
        else:
            self.answer(slot, request, reply, frames, now)
        self.streams.dispatch_released(self.dispatcher.dispatch)
        if slot.state is SlotState.DRAINING:
            return not pipeline.held
        self.dispatcher.dispatch(slot.model.name)
        return False

    def answer(self, slot: WorkerSlot, request: PendingRequest, reply: wm.Reply, frames: list[Any], now: float) -> None:
        """Send the client its result (or the worker's error), and count the reply on the slot."""
        service_ms = (now - request.dispatched_at) * 1000.0
        slot.notes.requests += 1
        slot.proc.requests += 1
        if reply.error_code is not None:  # errors are fast and would fake a baseline
            code = ErrorCode(reply.error_code) if reply.error_code in ErrorCode.__members__ else ErrorCode.INTERNAL
            self.streams.fail(request, code, reply.message)
            return
        slot.proc.latencies_ms.append(service_ms)
        if not frames:
            self.anomalies.count("worker_message_malformed", f"{slot.name}: a successful reply without a result header")
            self.streams.fail(request, ErrorCode.INTERNAL, "the worker sent a reply without a result header")
        elif request.expired(now):
            # The client asked for no answer after its deadline; a late result would be one.
            self.streams.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while the model ran")
        else:
            # The worker wrote the client's result header itself: forwarded as is, never re-encoded.
            self.audit_tap(slot, request, frames)
            self.streams.finish(request, None, frames[0], frames[1:])

    def close(self) -> None:
        """Close the client sockets (the pool closes worker links as it stops their processes)."""
        self.replies.connections.close()
        self.endpoints.close()
