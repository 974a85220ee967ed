"""The request broker: admits client requests into bounded per-model queues, routes them to idle workers,
and sends each one exactly one final reply.

The broker never blocks: every send is NOBLOCK (or queued in a link's outbox), so a client that
stops reading or a worker that vanished costs a counted drop (or a re-dispatch), never a stalled
loop. It never changes a slot's state or kills a process either: what it sees of a worker (READY,
a broken link, a drained pipeline, a canary result) it reports to its `WorkerEvents`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import zmq

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.client_messages import RequestId, decode_infer, encode_error
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.sockets import NOBLOCK, more_to_read, recv_frames
from infervisor.protocol.tensors import TensorDesc, TensorSpec, check_against_spec
from infervisor.supervisor.core.event_loop import CLIENTS, EventLoop
from infervisor.supervisor.lifecycle.slot import SlotState, WorkerSlot
from infervisor.supervisor.lifecycle.worker_links import WorkerLinks
from infervisor.supervisor.observe.anomalies import Anomalies
from infervisor.supervisor.observe.recorders import ModelTimes
from infervisor.supervisor.routing import batcher
from infervisor.supervisor.routing.client_ledger import ClientLedger
from infervisor.supervisor.routing.endpoints import ClientEndpoints
from infervisor.supervisor.routing.pending import Peer, PendingRequest
from infervisor.supervisor.settings.config import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig

log = structlog.get_logger("supervisor")

#: Messages taken from one client socket per loop turn, so a flood on one side cannot starve the other.
_BATCH = 256


def _batches_in(slot: WorkerSlot) -> int:
    """How many dispatches (batches, or lone requests) a worker holds."""
    return len({request.batch_id or -request.internal_id for request in slot.inflight.values()})


class WorkerEvents(Protocol):
    """Where the broker reports what it saw of a worker; the pool and the monitors decide what it means."""

    def worker_ready(self, slot: WorkerSlot, ready: wm.Ready) -> None:
        """A starting worker said READY."""

    def worker_progress(self, slot: WorkerSlot, progress: wm.Progress) -> None:
        """A starting worker entered a phase (loading, building profile i of n, checking, warming up)."""

    def worker_load_error(self, slot: WorkerSlot, error: wm.LoadError) -> None:
        """A starting worker cannot load its model and says why (it exits LOAD_FAILED next)."""

    def link_broken(self, slot: WorkerSlot, reason: str) -> None:
        """A worker's link cannot be written or lost its framing: its process must be replaced."""

    def worker_drained(self, slot: WorkerSlot) -> None:
        """A draining worker answered its last request."""

    def canary_result(self, slot: WorkerSlot, result: wm.CanaryResult) -> None:
        """A worker's answer to a golden-input check."""

    def profile_result(self, slot: WorkerSlot, result: wm.ProfileResult) -> None:
        """A worker's torch.profiler report."""


@dataclass
class ModelQueue:
    """Requests of one model waiting for an idle worker, plus that model's counters."""

    capacity: int
    waiting: collections.deque[PendingRequest] = field(default_factory=collections.deque)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Its successful requests: how many and how long (dropped with the queue when the model leaves).
    times: ModelTimes = field(default_factory=ModelTimes)
    #: With batching: how many batches of each size (rows) were sent, and how long requests waited to be batched.
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    batch_wait_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=4096))

    @property
    def completed(self) -> int:
        """Requests of the model answered with a result."""
        return self.times.completed


class Broker:
    """Routes client requests to idle pinned workers and their replies back."""

    def __init__(
        self,
        endpoints: ClientEndpoints,
        loop: EventLoop,
        links: WorkerLinks,
        serving: ServingConfig,
        events: WorkerEvents,
        anomalies: Anomalies,
    ) -> None:
        self.endpoints = endpoints
        self.links = links
        self.serving = serving
        self.events = events
        self.anomalies = anomalies
        links.deliver_to(self.on_worker_messages, events.link_broken)
        for client_socket in endpoints.sockets:
            loop.register(client_socket, CLIENTS, self.client_handler(client_socket))
        self.ledger = ClientLedger(anomalies, serving.current.client_budget_mb * 2**20)
        self.accepting = True
        #: The workers each model routes to: the pool's members, read here, changed only by the pool.
        self.members: Mapping[str, Sequence[WorkerSlot]] = {}
        self.queues: dict[str, ModelQueue] = {}
        #: Requests refused before they named a served model (malformed, wrong version, unknown model), per code.
        self.refused: collections.Counter[str] = collections.Counter()
        self.next_id = 1
        self.inflight_count = 0
        #: While the CPU throttles, route to half of each model's workers only (less heat, same answers).
        self.shed = False
        #: Models whose head request waits for batch companions, and until when.
        self.batch_due: dict[str, float] = {}
        self.batches_sent = 0
        self.sync_queues()

    def client_handler(self, socket: zmq.Socket[Any]) -> Callable[[int], None]:
        """The event-loop handler of one client-facing socket."""
        return lambda flags: self.handle_clients(socket)

    def route_to(self, members: Mapping[str, Sequence[WorkerSlot]]) -> None:
        """Route each model's requests to these workers (the pool's own mapping, kept current by the pool)."""
        self.members = members

    def sync_queues(self) -> None:
        """One queue per model of the serving config, sized as configured now (and the clients' budget)."""
        self.ledger.budget_bytes = self.serving.current.client_budget_mb * 2**20
        for name, model in self.serving.current.models.items():
            queue = self.queues.setdefault(name, ModelQueue(model.queue_size))
            queue.capacity = model.queue_size

    def remove_model(self, model: str) -> None:
        """A model left the config: answer what still waits for it, then drop its queue."""
        self.fail_queued(model, ErrorCode.UNKNOWN_MODEL, f"model {model!r} was removed from the config")
        self.queues.pop(model, None)

    @property
    def queued_count(self) -> int:
        """Requests accepted but not yet dispatched."""
        return sum(len(q.waiting) for q in self.queues.values())

    # ---- client side ------------------------------------------------------------------------

    def handle_clients(self, socket: zmq.Socket[Any]) -> None:
        """Take up to a batch of client messages from one client-facing socket."""
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
                self.reply_error(client, None, ErrorCode.INTERNAL, "the broker failed on this message")
            if not more_to_read(socket):
                return

    def accept(self, client: Peer, frames: list[Any]) -> None:
        """Validate one client message and queue or dispatch it, or answer with an error at once."""
        if len(frames) < 3 or len(frames[1]) != 0:
            self.anomalies.count("malformed_envelope")
            self.count_refusal(None, ErrorCode.BAD_REQUEST)
            self.reply_error(client, None, ErrorCode.BAD_REQUEST, "expected frames: empty delimiter, header, tensors")
            return
        config = self.serving.current
        tensor_frames = frames[3:]
        try:
            request = decode_infer(frames[2].buffer, [len(f) for f in tensor_frames], config.max_frame_bytes)
        except ProtocolError as exc:
            self.anomalies.count(f"rejected_{exc.code.value}", exc.message)
            self.count_refusal(None, exc.code)
            self.reply_error(client, exc.request_id, exc.code, exc.message)
            return
        if client[0] is not self.endpoints.ipc and any(d.shm is not None for d in request.inputs):
            # A worker opens what a shared-memory input names: only a client of this box may name it. A
            # descriptor check (7.1 step 4): before the model is looked up, and not one of its errors.
            why = "inputs in shared memory are for the ipc endpoint only"
            self.anomalies.count(f"rejected_{ErrorCode.BAD_REQUEST.value}", why)
            self.count_refusal(None, ErrorCode.BAD_REQUEST)
            self.reply_error(client, request.request_id, ErrorCode.BAD_REQUEST, why)
            return
        model = config.models.get(request.model)
        try:
            if model is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_MODEL, f"no model {request.model!r}; serving {sorted(config.models)}"
                )
            # NaN/Inf are the worker's to find: it reads the frames anyway, right before the model.
            spec = self.admitting_spec(request.model, model, request.inputs)
        except ProtocolError as exc:
            self.anomalies.count(f"rejected_{exc.code.value}", exc.message)
            self.count_refusal(request.model if model is not None else None, exc.code)
            self.reply_error(client, request.request_id, exc.code, exc.message)
            return
        cost = sum(len(f) for f in tensor_frames) + sum(d.nbytes for d in request.inputs if d.shm is not None)
        over = self.ledger.over_budget(client, cost)
        queue = self.queues[request.model]
        if over is not None:
            queue.errors[ErrorCode.OVERLOADED.value] += 1
            self.reply_error(client, request.request_id, ErrorCode.OVERLOADED, over)
            return
        if not self.accepting:
            queue.errors[ErrorCode.SHUTTING_DOWN.value] += 1
            self.reply_error(client, request.request_id, ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            return
        if not self.has_capacity(request.model):
            queue.errors[ErrorCode.UNAVAILABLE.value] += 1
            self.reply_error(
                client, request.request_id, ErrorCode.UNAVAILABLE, f"model {request.model!r} has no live worker slot"
            )
            return
        now = time.monotonic()
        pending = PendingRequest(
            internal_id=self.next_id,
            client=client,
            request_id=request.request_id,
            model=request.model,
            frames=frames[2:],
            accepted_at=now,
            deadline=now + request.deadline_ms / 1000.0 if request.deadline_ms else None,
            spec=spec,
            cost=cost,
            rows=request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1,
        )
        self.next_id += 1
        self.ledger.take(client, cost)
        # Straight to a worker only when nothing waits before it.
        slot = None if queue.waiting else self.pick_worker(request.model, spec)
        if model.batching is not None:
            pending.shape_key = tuple((d.name, d.dtype, d.shape[1:]) for d in request.inputs)
            if slot is None or batcher.may_wait(model.batching, bool(slot.inflight)):
                # The batcher decides: join it to those in line, or let it wait for companions.
                self.enqueue_or_refuse(queue, pending)
                self.dispatch(request.model)
            else:
                # Alone in line, for an idle worker or with no delay: the batcher would send it alone at once.
                self.send_batch(slot, [pending], now)
                if queue.waiting:
                    self.dispatch(request.model)  # that worker is gone; it went back in line for another
            return
        if slot is not None:
            if not self.send_to_worker(slot, pending):
                self.dispatch(request.model)  # that worker is gone; it went back in line for another
        else:
            self.enqueue_or_refuse(queue, pending)

    def enqueue_or_refuse(self, queue: ModelQueue, request: PendingRequest) -> None:
        """Queue an admitted request, or answer OVERLOADED when its model's queue is full."""
        if len(queue.waiting) >= queue.capacity:
            queue.errors[ErrorCode.OVERLOADED.value] += 1
            self.ledger.give_back(request.client, request.cost)
            why = f"queue of {request.model!r} is full ({queue.capacity})"
            self.reply_error(request.client, request.request_id, ErrorCode.OVERLOADED, why)
        else:
            queue.waiting.append(request)

    def admitting_spec(
        self, name: str, model: ModelConfig, inputs: Sequence[TensorDesc]
    ) -> tuple[TensorSpec, ...] | None:
        """Check a request's inputs; ProtocolError when they fit no spec the model's workers serve.

        Returns None when any worker of the model may take it. While a rollout changes the model's
        inputs, a request fitting the new spec is admitted once a worker built with it serves, and
        each request then goes only to workers of the spec that admitted it.
        """
        target = self.serving.target(name)
        if target is None or target.inputs == model.inputs:
            check_against_spec(inputs, model.inputs)
            return None
        try:
            check_against_spec(inputs, model.inputs)
            return model.inputs
        except ProtocolError:
            if not any(s.model.inputs == target.inputs and s.state is SlotState.SERVING for s in self.members[name]):
                raise
            check_against_spec(inputs, target.inputs)
            return target.inputs

    def count_refusal(self, model: str | None, code: ErrorCode) -> None:
        """Count a request answered at admission: in its model's errors when it named a served one."""
        queue = self.queues.get(model) if model is not None else None
        if queue is not None:
            queue.errors[code.value] += 1
        else:
            self.refused[code.value] += 1

    def has_capacity(self, model: str) -> bool:
        """False when every slot of the model has FAILED: queueing would only delay an error.

        An empty pool (a drain-first rollout of a one-worker model) has capacity on its way.
        """
        slots = self.members.get(model, ())
        return not slots or any(s.state is not SlotState.FAILED for s in slots)

    def reply_error(self, client: Peer, request_id: RequestId | None, code: ErrorCode, message: str) -> None:
        """Send an error reply to a client connection."""
        self.send_to_client(client, [encode_error(request_id, code, message)])

    def send_to_client(self, client: Peer, frames: list[Any]) -> None:
        """Deliver one reply; a client that left is counted, one that stops reading has it kept in its outbox."""
        self.ledger.send(client, frames)

    def finish(self, request: PendingRequest, code: ErrorCode | None, header: Any, frames: list[Any]) -> None:
        """Send the one final reply of a request and count it."""
        queue = self.queues.get(request.model)  # None once a reload removed the model
        if queue is not None and code is None:
            queue.times.request_done(request.accepted_at, request.dispatched_at, time.monotonic())
        elif queue is not None and code is not None:
            queue.errors[code.value] += 1
        self.ledger.give_back(request.client, request.cost)
        self.send_to_client(request.client, [header, *frames])

    def fail(self, request: PendingRequest, code: ErrorCode, message: str) -> None:
        """Finish a request with an error."""
        self.finish(request, code, encode_error(request.request_id, code, message), [])

    # ---- dispatch ---------------------------------------------------------------------------

    def pick_worker(self, model: str, spec: tuple[TensorSpec, ...] | None = None) -> WorkerSlot | None:
        """The least loaded serving worker of `model` with room in its pipeline; ties go to the most recently busy.

        Most recently busy, not longest idle: that worker's core is awake and its caches hold the
        model, so at low load one warm worker answers sooner than a rotation through cold ones
        (tiny model, 1 client: 0.31 ms round trip on one worker, 0.38 ms alternating between two).
        Under load every worker is busy anyway.
        """
        config = self.serving.model(model)
        if config is None:
            return None
        prefetch = config.prefetch
        best: WorkerSlot | None = None
        slots = self.members.get(model, ())
        if self.shed:  # half of the workers that can serve, so shedding never routes to a dead one
            serving = [s for s in slots if s.state is SlotState.SERVING]
            slots = serving[: (len(serving) + 1) // 2]
        batched = config.batching is not None
        for slot in slots:
            if batched:
                # With batching, `prefetch` counts batches in hand: one running and the next joined while it runs.
                if not slot.can_take(prefetch + len(slot.inflight) - _batches_in(slot)):
                    continue
            elif not slot.can_take(prefetch):
                continue
            if spec is not None and slot.model.inputs != spec:
                continue
            if best is None or (len(slot.inflight), -slot.progress_at) < (len(best.inflight), -best.progress_at):
                best = slot
        return best

    def dispatch(self, model: str) -> None:
        """Hand queued requests of `model` to its idle workers, oldest first (joined in batches when configured)."""
        queue = self.queues.get(model)
        config = self.serving.model(model)
        policy = config.batching if config is not None else None
        while queue is not None and queue.waiting:
            slot = self.pick_worker(model, queue.waiting[0].spec)
            if slot is None:
                return
            if policy is not None:
                now = time.monotonic()
                self.batch_due.pop(model, None)
                share = self.share_of_line(model, len(queue.waiting))
                decision = batcher.take(queue.waiting, policy, now, share, worker_busy=bool(slot.inflight))
                if decision.wait_until is not None:
                    self.batch_due[model] = decision.wait_until
                    return
                self.send_batch(slot, decision.batch, now)
                continue
            request = queue.waiting.popleft()
            if request.deadline is not None and time.monotonic() >= request.deadline:
                self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                continue
            # A worker found gone is no longer picked (its link is closed): the next one is tried.
            self.send_to_worker(slot, request)

    def share_of_line(self, model: str, waiting: int) -> int | None:
        """The most requests the next batch may take, so that a line is spread over the model's workers (None: all).

        With several workers idle, each takes the line divided among them. With one, a line longer
        than its fair share (the model's requests, waiting and held, divided among its serving
        workers) is cut there: otherwise under load the first worker to free up takes the whole
        line, and from then on one worker runs a huge batch while the others serve the few
        requests that come back meanwhile, one by one (a convoy: encoder int8, 2 workers, 32
        clients, batches of 30 beside batches of 1, p99 1.3 s).
        """
        slots = self.members.get(model, ())
        idle = sum(1 for slot in slots if slot.can_take(1))
        if idle > 1:
            return -(-waiting // idle)
        serving = [slot for slot in slots if slot.state is SlotState.SERVING]
        if len(serving) < 2:
            return None
        fair = -(-(waiting + sum(len(slot.inflight) for slot in serving)) // len(serving))
        return fair if fair < waiting else None

    def dispatch_due(self, now: float) -> None:
        """Send the batches whose oldest request has waited its model's `max_queue_delay_us`."""
        for model in [m for m, due in self.batch_due.items() if batcher.is_due(due, now)]:
            self.dispatch(model)

    @property
    def next_batch_due(self) -> float | None:
        """When the earliest waiting batch must go, if any waits."""
        return min(self.batch_due.values(), default=None)

    def send_batch(self, slot: WorkerSlot, batch: list[PendingRequest], now: float) -> None:
        """Send requests to one worker as one forward pass; each keeps its own id, deadline and reply."""
        live = []
        for request in batch:
            if request.deadline is not None and now >= request.deadline:
                self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
            else:
                live.append(request)
        if not live:
            return
        queue = self.queues[live[0].model]
        queue.batch_sizes[sum(r.rows for r in live)] += 1
        for request in live:
            queue.batch_wait_ms.append((now - request.accepted_at) * 1000.0)
        if len(live) == 1:
            self.send_to_worker(slot, live[0])
            return
        frames: list[Any] = []
        for request in live:
            queue_ms = (now - request.accepted_at) * 1000.0
            member = wm.Request(request.internal_id, request.deadline, request.accepted_at, queue_ms)
            frames += wm.encode(member, request.frames)
        if not self.links.send(slot, wm.encode(wm.Batch([len(r.frames) + 1 for r in live]), frames)):
            queue.waiting.extendleft(reversed(live))
            self.events.link_broken(slot, "worker link closed")
            return
        self.batches_sent += 1
        dispatched = time.monotonic()
        if not slot.inflight:
            slot.progress_at = dispatched
        for request in live:
            request.dispatched_at = dispatched
            request.batch_id = self.batches_sent
            slot.inflight[request.internal_id] = request
        self.inflight_count += len(live)

    def send_to_worker(self, slot: WorkerSlot, request: PendingRequest) -> bool:
        """Give one request to an idle worker; if it is unreachable, put the request back first in line."""
        queue_ms = (time.monotonic() - request.accepted_at) * 1000.0
        message = wm.Request(request.internal_id, request.deadline, request.accepted_at, queue_ms)
        if not self.links.send(slot, wm.encode(message, request.frames)):
            # Its process is gone or going; the pool settles the slot. The request keeps its place.
            self.queues[request.model].waiting.appendleft(request)
            self.events.link_broken(slot, "worker link closed")
            return False
        request.dispatched_at = time.monotonic()
        if not slot.inflight:
            slot.progress_at = request.dispatched_at
        slot.inflight[request.internal_id] = request
        self.inflight_count += 1
        return True

    @staticmethod
    def running(slot: WorkerSlot) -> list[PendingRequest]:
        """The requests at the head of a worker's pipeline: the one running, or every member of the batch running."""
        if not slot.inflight:
            return []
        head = next(iter(slot.inflight.values()))
        if not head.batch_id:
            return [head]
        return [r for r in slot.inflight.values() if r.batch_id == head.batch_id]

    def take_inflight(self, slot: WorkerSlot) -> list[PendingRequest]:
        """Detach every request the slot's process holds, oldest first."""
        requests = list(slot.inflight.values())
        slot.inflight.clear()
        self.inflight_count -= len(requests)
        return requests

    def worker_lost(self, slot: WorkerSlot, reason: str) -> None:
        """Re-dispatch what a dead or hung worker held (oldest first in line), or give up after max_retries.

        A worker serves its pipeline in order, so only the oldest request was running when it died: it
        alone is charged a retry. The ones waiting behind it go back in line as they were.
        """
        model = self.serving.model(slot.model.name) or slot.model
        running = self.running(slot)
        held = self.take_inflight(slot)
        if len(running) > 1:
            # A batch was running: which of its requests killed the worker is unknown. Split it in two, charge
            # nobody, and let each half run alone: halving finds a poison request in log2(size) steps.
            half = (len(running) + 1) // 2
            for index, request in enumerate(running):
                request.batch_limit = half if index < half else len(running) - half
            log.warning("batch_split", model=slot.model.name, size=len(running), reason=reason)
        for index in range(len(held) - 1, -1, -1):
            charged = index == 0 and len(running) <= 1
            self.requeue_or_fail(held[index], model.max_retries, reason, charged=charged)
        self.dispatch(slot.model.name)

    def requeue_or_fail(self, request: PendingRequest, max_retries: int, reason: str, charged: bool = True) -> None:
        """Put a request whose worker was lost back at the head of its queue, unless it has lost too many."""
        if charged:
            request.losses += 1
        if request.losses > max_retries:
            log.error(
                "request_lost_worker", model=request.model, request_id=str(request.request_id), losses=request.losses
            )
            self.fail(
                request,
                ErrorCode.WORKER_LOST,
                f"request {request.request_id!r} lost {request.losses} workers ({reason}); not retried again",
            )
            return
        queue = self.queues.get(request.model)
        if queue is None:
            self.fail(request, ErrorCode.UNKNOWN_MODEL, f"model {request.model!r} was removed from the config")
            return
        log.warning(
            "request_redispatched",
            model=request.model,
            request_id=str(request.request_id),
            losses=request.losses,
            charged=charged,
        )
        queue.waiting.appendleft(request)

    def expire(self, now: float) -> None:
        """Answer queued requests whose deadline passed, or whose spec no worker of the model has any more."""
        for name, queue in self.queues.items():
            expired = any(r.deadline is not None and now >= r.deadline for r in queue.waiting)
            specs = {r.spec for r in queue.waiting if r.spec is not None}
            gone = {spec for spec in specs if not self.spec_alive(name, spec)}
            if not expired and not gone:
                continue
            keep: collections.deque[PendingRequest] = collections.deque()
            for request in queue.waiting:
                if request.deadline is not None and now >= request.deadline:
                    self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                elif request.spec in gone:
                    # A rollout of new inputs was rolled back, or finished: nothing can run this request's spec.
                    why = "the model no longer serves the inputs spec that admitted this request"
                    self.fail(request, ErrorCode.UNAVAILABLE, why)
                else:
                    keep.append(request)
            queue.waiting = keep

    def spec_alive(self, model: str, spec: tuple[TensorSpec, ...]) -> bool:
        """True while some member of the model built with `spec` is serving or on its way."""
        alive = (SlotState.SERVING, SlotState.STARTING, SlotState.BACKOFF)
        return any(s.model.inputs == spec and s.state in alive for s in self.members.get(model, ()))

    def fail_queued(self, model: str, code: ErrorCode, message: str) -> None:
        """Answer every queued request of one model with `code`."""
        queue = self.queues.get(model)
        while queue is not None and queue.waiting:
            self.fail(queue.waiting.popleft(), code, message)

    def fail_all(self, code: ErrorCode, message: str, slots: Sequence[WorkerSlot]) -> None:
        """Answer every queued request, and every request these workers hold, with `code` (end of a bounded stop)."""
        for model in self.queues:
            self.fail_queued(model, code, message)
        for slot in slots:
            for request in self.take_inflight(slot):
                self.fail(request, code, message)

    # ---- worker side ------------------------------------------------------------------------

    def on_worker_messages(self, slot: WorkerSlot, messages: list[list[memoryview]]) -> None:
        """Act on the whole messages a worker's link held, in order."""
        for frames in messages:
            try:
                self.on_worker_message(slot, frames)
            except Exception:  # a bug on one message must cost that message, not the daemon
                log.exception("worker_message_crashed")
                self.anomalies.count("internal_error")

    def on_worker_message(self, slot: WorkerSlot, frames: list[memoryview]) -> None:
        """Act on one worker message; malformed headers are counted and dropped."""
        try:
            message = wm.decode(frames[0])
        except ProtocolError as exc:
            self.anomalies.count("worker_message_malformed", f"{slot.name}: {exc.message}")
            # Workers answer in order, so a garbled REPLY (a msgpack array whose first element is the
            # REPLY type) is the answer to the oldest request in hand; other garbage is only counted.
            header = bytes(frames[0][:2])
            looks_like_reply = len(header) > 1 and 0x90 <= header[0] <= 0x9F and header[1] == wm.Reply.TYPE
            if slot.inflight and looks_like_reply:
                request = slot.inflight.pop(next(iter(slot.inflight)))
                self.inflight_count -= 1
                slot.progress_at = time.monotonic()
                self.fail(request, ErrorCode.INTERNAL, f"the worker sent a malformed reply: {exc.message}")
                self.after_reply(slot)
            return
        slot.proc.last_heard = time.monotonic()
        if isinstance(message, wm.Reply):
            self.on_reply(slot, message, frames[1:])
        elif isinstance(message, wm.Ready):
            self.events.worker_ready(slot, message)
            self.dispatch(slot.model.name)
        elif isinstance(message, wm.Progress):
            self.events.worker_progress(slot, message)
        elif isinstance(message, wm.Stats):
            slot.proc.threads_seen = message.threads
        elif isinstance(message, wm.CanaryResult):
            self.events.canary_result(slot, message)
        elif isinstance(message, wm.ProfileResult):
            self.events.profile_result(slot, message)
        elif isinstance(message, wm.LoadError):
            self.events.worker_load_error(slot, message)

    def on_reply(self, slot: WorkerSlot, reply: wm.Reply, frames: list[Any]) -> None:
        """Forward a worker's answer to the client that asked, exactly once."""
        request = slot.inflight.pop(reply.request_id, None)
        if request is None:
            self.anomalies.count("reply_stale")
            return
        self.inflight_count -= 1
        now = time.monotonic()
        slot.progress_at = now
        service_ms = (now - request.dispatched_at) * 1000.0
        slot.notes.requests += 1
        slot.proc.requests += 1
        if reply.error_code is None:  # errors are fast and would fake a baseline
            slot.proc.latencies_ms.append(service_ms)
        if reply.error_code is not None:
            code = ErrorCode(reply.error_code) if reply.error_code in ErrorCode.__members__ else ErrorCode.INTERNAL
            self.fail(request, code, reply.message)
        elif not frames:
            self.anomalies.count("worker_message_malformed", f"{slot.name}: a successful reply without a result header")
            self.fail(request, ErrorCode.INTERNAL, "the worker sent a reply without a result header")
        elif request.deadline is not None and now >= request.deadline:
            # The client asked for no answer after its deadline; a late result would be one.
            self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while the model ran")
        else:
            # The worker wrote the client's result header itself: forwarded as is, never re-encoded.
            self.finish(request, None, frames[0], frames[1:])
        self.after_reply(slot)

    def after_reply(self, slot: WorkerSlot) -> None:
        """A worker freed a place: refill it, or report a draining one that holds nothing any more."""
        if slot.state is SlotState.DRAINING:
            if not slot.inflight:
                self.events.worker_drained(slot)
        else:
            self.dispatch(slot.model.name)

    def flush_replies(self) -> None:
        """Send replies that waited for room at their clients."""
        if self.ledger.waiting:
            self.ledger.flush()

    def close(self) -> None:
        """Close the client sockets (the pool closes worker links as it stops their processes)."""
        self.endpoints.close()
