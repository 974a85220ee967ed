"""The request broker: client ROUTER in front, one socketpair link per worker behind, bounded queues between.

The broker never blocks: every send is NOBLOCK (or queued in a link's outbox), so a client that
stops reading or a worker that vanished costs a counted drop (or a re-dispatch), never a stalled loop.
"""

from __future__ import annotations

import collections
import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import zmq

from protocol import worker_messages as wm
from protocol.client_messages import RequestId, decode_infer, encode_error
from protocol.constants import CLIENT_SOCKET_NAME, ErrorCode
from protocol.errors import ProtocolError
from protocol.sockets import NOBLOCK, more_to_read, recv_frames, send_frames
from protocol.tensors import check_against_spec
from protocol.worker_link import Link, LinkClosed
from supervisor.config import Config
from supervisor.curve import ThreadAuthenticator, enable_curve_server
from supervisor.pending import Peer, PendingRequest
from supervisor.rehearsal import Rehearsal
from supervisor.slot import SlotState, WorkerSlot

log = structlog.get_logger("supervisor")

#: Messages taken from one socket per loop turn, so a flood on one side cannot starve the other.
_BATCH = 256
#: Per-peer queue limits inside ZeroMQ; our own bounded queues do the real admission control.
_HWM = 10_000
#: Poll flags as ints: bit operations on pyzmq's enum flags run Python code on every event.
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_READABLE = _POLLIN | int(zmq.POLLERR)


@dataclass
class ModelQueue:
    """Requests of one model waiting for an idle worker, plus that model's counters."""

    capacity: int
    waiting: collections.deque[PendingRequest] = field(default_factory=collections.deque)
    completed: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=4096))


class Broker:
    """Routes client requests to idle pinned workers and their replies back."""

    def __init__(self, context: zmq.Context[Any], config: Config, runtime_dir: Path) -> None:
        self.config = config
        self.client_endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
        self.frontend = self._router(context, config.max_frame_bytes)
        self.frontend.bind(self.client_endpoint)
        (runtime_dir / CLIENT_SOCKET_NAME).chmod(0o600)
        # TCP gets its own socket so CURVE (when configured) guards it without touching the ipc endpoint.
        self.tcp_frontend: zmq.Socket[Any] | None = None
        self.authenticator: ThreadAuthenticator | None = None
        if config.tcp_endpoint:
            self.tcp_frontend = self._router(context, config.max_frame_bytes)
            if config.curve is not None:
                self.authenticator = enable_curve_server(context, self.tcp_frontend, config.curve)
            self.tcp_frontend.bind(config.tcp_endpoint)
        #: Everything the main loop waits on: client sockets and worker links here, the arbiter adds its own.
        self.poller = zmq.Poller()
        for client_socket in self.client_sockets:
            self.poller.register(client_socket, zmq.POLLIN)
        self.accepting = True
        self.slots: dict[str, list[WorkerSlot]] = {}
        #: Worker links by descriptor: each belongs to one process of one slot.
        self.links: dict[int, WorkerSlot] = {}
        #: Links polled for POLLOUT too: their outbox holds what the socket could not take yet.
        self.writing: set[int] = set()
        self.queues: dict[str, ModelQueue] = {}
        self.next_id = 1
        self.inflight_count = 0
        self.counters: collections.Counter[str] = collections.Counter()
        #: Set by the arbiter: where canary results go.
        self.on_canary: Callable[[WorkerSlot, wm.CanaryResult], None] | None = None
        #: Set by the arbiter: where profiling reports go.
        self.on_profile: Callable[[WorkerSlot, wm.ProfileResult], None] | None = None
        #: While the CPU throttles, route to half of each model's workers only (less heat, same answers).
        self.shed = False
        #: Held exactly while `keep_warm_ms` is set (reconcile_rehearsal); runs of it, and why it stopped.
        self.rehearsal: Rehearsal | None = None
        self.rehearsals = 0
        self.rehearsal_error: str | None = None

    @staticmethod
    def _router(context: zmq.Context[Any], max_message: int) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, _HWM)
        socket.setsockopt(zmq.RCVHWM, _HWM)
        socket.setsockopt(zmq.LINGER, 0)
        if max_message > 0:
            socket.setsockopt(zmq.MAXMSGSIZE, max_message)
        return socket

    def count(self, kind: str, detail: str = "") -> None:
        """Count an anomaly for status; log only its first occurrence, so a flood of garbage cannot flood the log."""
        self.counters[kind] += 1
        if self.counters[kind] == 1:
            log.warning("anomaly_first_seen", kind=kind, detail=detail, note="later ones are only counted in status")

    # ---- membership -------------------------------------------------------------------------

    def set_pools(self, slots: dict[str, list[WorkerSlot]]) -> None:
        """Adopt the model pools (and their queue sizes) the arbiter manages."""
        self.slots = slots
        for name, model in self.config.models.items():
            queue = self.queues.setdefault(name, ModelQueue(model.queue_size))
            queue.capacity = model.queue_size

    def remove_model(self, model: str) -> None:
        """A model left the config: answer what still waits for it, then drop its queue."""
        self.fail_queued(model, ErrorCode.UNKNOWN_MODEL, f"model {model!r} was removed from the config")
        self.queues.pop(model, None)

    def register(self, slot: WorkerSlot) -> None:
        """Listen to the link of the slot's new process."""
        if slot.link is not None:
            self.links[slot.link.fileno()] = slot
            self.poller.register(slot.link.fileno(), zmq.POLLIN)

    def forget(self, slot: WorkerSlot) -> None:
        """Close the link of the slot's old process: nothing more from it (a late reply must not be delivered twice)."""
        link, slot.link = slot.link, None
        if link is not None:
            self.unwatch(link)
            link.close()

    def unwatch(self, link: Link) -> None:
        """Stop polling a link (closed by the worker, or broken); the process exit is reaped as usual."""
        if self.links.pop(link.fileno(), None) is not None:
            self.poller.unregister(link.fileno())
            self.writing.discard(link.fileno())

    @property
    def queued_count(self) -> int:
        """Requests accepted but not yet dispatched."""
        return sum(len(q.waiting) for q in self.queues.values())

    # ---- client side ------------------------------------------------------------------------

    @property
    def client_sockets(self) -> list[zmq.Socket[Any]]:
        """The client-facing sockets: ipc, and tcp when configured."""
        return [self.frontend] if self.tcp_frontend is None else [self.frontend, self.tcp_frontend]

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
                self.count("internal_error")
                self.reply_error(client, None, ErrorCode.INTERNAL, "the broker failed on this message")
            if not more_to_read(socket):
                return

    def accept(self, client: Peer, frames: list[Any]) -> None:
        """Validate one client message and queue or dispatch it, or answer with an error at once."""
        if len(frames) < 3 or len(frames[1]) != 0:
            self.count("malformed_envelope")
            self.reply_error(client, None, ErrorCode.BAD_REQUEST, "expected frames: empty delimiter, header, tensors")
            return
        tensor_frames = frames[3:]
        try:
            request = decode_infer(frames[2].buffer, [len(f) for f in tensor_frames], self.config.max_frame_bytes)
        except ProtocolError as exc:
            self.count(f"rejected_{exc.code.value}", exc.message)
            self.reply_error(client, exc.request_id, exc.code, exc.message)
            return
        model = self.config.models.get(request.model)
        try:
            if model is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_MODEL, f"no model {request.model!r}; serving {sorted(self.config.models)}"
                )
            # NaN/Inf are the worker's to find: it reads the frames anyway, right before the model.
            check_against_spec(request.inputs, model.inputs)
            if client[0] is not self.frontend and any(d.shm is not None for d in request.inputs):
                # A worker opens what a shared-memory input names: only a client of this box may name it.
                raise ProtocolError(ErrorCode.BAD_REQUEST, "inputs in shared memory are for the ipc endpoint only")
        except ProtocolError as exc:
            self.count(f"rejected_{exc.code.value}", exc.message)
            self.reply_error(client, request.request_id, exc.code, exc.message)
            return
        queue = self.queues[request.model]
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
        )
        self.next_id += 1
        slot = self.pick_worker(request.model)
        if slot is not None and not queue.waiting:
            if not self.send_to_worker(slot, pending):
                self.dispatch(request.model)  # that worker is gone; it went back in line for another
        elif len(queue.waiting) >= queue.capacity:
            queue.errors[ErrorCode.OVERLOADED.value] += 1
            self.reply_error(
                client,
                request.request_id,
                ErrorCode.OVERLOADED,
                f"queue of {request.model!r} is full ({queue.capacity})",
            )
        else:
            queue.waiting.append(pending)

    def has_capacity(self, model: str) -> bool:
        """False when every slot of the model has FAILED: queueing would only delay an error.

        An empty pool (a drain-first rollout of a one-worker model) has capacity on its way.
        """
        slots = self.slots.get(model, [])
        return not slots or any(s.state is not SlotState.FAILED for s in slots)

    def reply_error(self, client: Peer, request_id: RequestId | None, code: ErrorCode, message: str) -> None:
        """Send an error reply to a client connection."""
        self.send_to_client(client, [encode_error(request_id, code, message)])

    def send_to_client(self, client: Peer, frames: list[Any]) -> None:
        """Deliver one reply; a client that left or stopped reading is counted, never waited for."""
        socket, identity = client
        try:
            send_frames(socket, [identity, b"", *frames], NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            self.count("reply_undeliverable")

    def finish(self, request: PendingRequest, code: ErrorCode | None, header: Any, frames: list[Any]) -> None:
        """Send the one final reply of a request and count it."""
        queue = self.queues.get(request.model)  # None once a reload removed the model
        if queue is not None and code is None:
            queue.completed += 1
            queue.latencies_ms.append((time.monotonic() - request.accepted_at) * 1000.0)
        elif queue is not None and code is not None:
            queue.errors[code.value] += 1
        self.send_to_client(request.client, [header, *frames])

    def fail(self, request: PendingRequest, code: ErrorCode, message: str) -> None:
        """Finish a request with an error."""
        self.finish(request, code, encode_error(request.request_id, code, message), [])

    # ---- dispatch ---------------------------------------------------------------------------

    def pick_worker(self, model: str) -> WorkerSlot | None:
        """The least loaded serving worker of `model` with room in its pipeline; ties go to the most recently busy.

        Most recently busy, not longest idle: that worker's core is awake and its caches hold the
        model, so at low load one warm worker answers sooner than a rotation through cold ones
        (tiny model, 1 client: 0.31 ms round trip on one worker, 0.38 ms alternating between two).
        Under load every worker is busy anyway.
        """
        best: WorkerSlot | None = None
        slots = self.slots.get(model, [])
        if self.shed:  # half of the workers that can serve, so shedding never routes to a dead one
            serving = [s for s in slots if s.state is SlotState.SERVING]
            slots = serving[: (len(serving) + 1) // 2]
        for slot in slots:
            if not slot.can_take:
                continue
            if best is None or (len(slot.inflight), -slot.progress_at) < (len(best.inflight), -best.progress_at):
                best = slot
        return best

    def dispatch(self, model: str) -> None:
        """Hand queued requests of `model` to its idle workers, oldest first."""
        queue = self.queues.get(model)
        while queue is not None and queue.waiting:
            slot = self.pick_worker(model)
            if slot is None:
                return
            request = queue.waiting.popleft()
            if request.deadline is not None and time.monotonic() >= request.deadline:
                self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                continue
            # A worker found gone is no longer picked (its link is closed): the next one is tried.
            self.send_to_worker(slot, request)

    def send_to_worker(self, slot: WorkerSlot, request: PendingRequest) -> bool:
        """Give one request to an idle worker; if it is unreachable, put the request back first in line."""
        queue_ms = (time.monotonic() - request.accepted_at) * 1000.0
        message = wm.Request(request.internal_id, request.deadline, request.accepted_at, queue_ms)
        if not self.send_link(slot, wm.encode(message, request.frames)):
            # Its process is gone or going; reaping it settles the slot. The request keeps its place.
            self.queues[request.model].waiting.appendleft(request)
            slot.kill("worker link closed")
            return False
        request.dispatched_at = time.monotonic()
        if not slot.inflight:
            slot.progress_at = request.dispatched_at
        slot.inflight[request.internal_id] = request
        self.inflight_count += 1
        return True

    def take_inflight(self, slot: WorkerSlot) -> list[PendingRequest]:
        """Detach every request the slot's process holds, oldest first."""
        requests = list(slot.inflight.values())
        slot.inflight.clear()
        self.inflight_count -= len(requests)
        return requests

    def worker_lost(self, slot: WorkerSlot, reason: str) -> None:
        """Re-dispatch what a dead or hung worker held (oldest first in line), or give up after max_retries."""
        for request in reversed(self.take_inflight(slot)):
            self.requeue_or_fail(request, slot.model.max_retries, reason)
        self.dispatch(slot.model.name)

    def requeue_or_fail(self, request: PendingRequest, max_retries: int, reason: str) -> None:
        """Put a request whose worker was lost back at the head of its queue, unless it has lost too many."""
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
            "request_redispatched", model=request.model, request_id=str(request.request_id), losses=request.losses
        )
        queue.waiting.appendleft(request)

    def expire(self, now: float) -> None:
        """Answer DEADLINE_EXCEEDED for queued requests whose deadline passed."""
        for queue in self.queues.values():
            if not any(r.deadline is not None and now >= r.deadline for r in queue.waiting):
                continue
            keep: collections.deque[PendingRequest] = collections.deque()
            for request in queue.waiting:
                if request.deadline is not None and now >= request.deadline:
                    self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                else:
                    keep.append(request)
            queue.waiting = keep

    def fail_queued(self, model: str, code: ErrorCode, message: str) -> None:
        """Answer every queued request of one model with `code`."""
        queue = self.queues.get(model)
        while queue is not None and queue.waiting:
            self.fail(queue.waiting.popleft(), code, message)

    def fail_all(self, code: ErrorCode, message: str, slots: list[WorkerSlot]) -> None:
        """Answer every queued request, and every request these workers hold, with `code` (end of a bounded stop)."""
        for model in self.queues:
            self.fail_queued(model, code, message)
        for slot in slots:
            for request in self.take_inflight(slot):
                self.fail(request, code, message)

    # ---- worker side ------------------------------------------------------------------------

    def on_link_event(self, slot: WorkerSlot, events: int) -> None:
        """Write what a worker's link could not take before; read and act on every whole message it sent."""
        link = slot.link
        if link is None:
            return
        if events & _POLLOUT:
            try:
                link.flush()
            except LinkClosed:
                pass  # the worker is gone; what it wrote before going is still read below, up to EOF
            self.watch_writes(link)
        if events & _READABLE:
            self.read_link(slot)

    def read_link(self, slot: WorkerSlot) -> bool:
        """Act on the whole messages a worker's link holds now; False when there were none (or EOF, or garbage)."""
        link = slot.link
        if link is None:
            return False
        try:
            messages = link.receive()
        except LinkClosed:
            self.unwatch(link)  # the process exited or is exiting: reaping settles the slot
            return False
        except ProtocolError as exc:
            # A byte stream that lost its framing cannot be trusted again: replace the worker.
            self.count("worker_message_malformed", f"{slot.name}: {exc.message}")
            self.unwatch(link)
            slot.kill(f"garbled link: {exc.message}")
            return False
        for frames in messages:
            try:
                self.on_worker_message(slot, frames)
            except Exception:  # a bug on one message must cost that message, not the daemon
                log.exception("worker_message_crashed")
                self.count("internal_error")
        return bool(messages)

    def drain(self, slot: WorkerSlot) -> None:
        """Take what an exited worker wrote before it went (a reply it sent is delivered, not re-run)."""
        link = slot.link
        if link is None:
            return
        link.sendable = False  # nothing new goes to a process that is gone
        # The process is dead, so everything it wrote is already in the socket: read until EOF.
        for _ in range(_BATCH):
            if not self.read_link(slot):
                return

    def on_worker_message(self, slot: WorkerSlot, frames: list[memoryview]) -> None:
        """Act on one worker message; malformed headers are counted and dropped."""
        try:
            message = wm.decode(frames[0])
        except ProtocolError as exc:
            self.count("worker_message_malformed", f"{slot.name}: {exc.message}")
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
        slot.last_heard = time.monotonic()
        if isinstance(message, wm.Reply):
            self.on_reply(slot, message, frames[1:])
        elif isinstance(message, wm.Ready):
            self.on_ready(slot, message)
        elif isinstance(message, wm.Stats):
            slot.threads_seen, slot.rehearsals_seen = message.threads, message.rehearsals
        elif isinstance(message, wm.CanaryResult) and self.on_canary is not None:
            self.on_canary(slot, message)
        elif isinstance(message, wm.ProfileResult) and self.on_profile is not None:
            self.on_profile(slot, message)

    def on_ready(self, slot: WorkerSlot, ready: wm.Ready) -> None:
        """A warm worker: start routing to it."""
        if slot.state is not SlotState.STARTING:
            return
        slot.ready_ms = (time.monotonic() - slot.spawned_at) * 1000.0
        slot.progress_at = slot.ready_at = slot.last_canary_at = time.monotonic()
        slot.expected_ms = ready.warmup_ms / max(1, slot.model.warmup_iterations)
        slot.threads_seen = ready.threads
        slot.profile, slot.profile_notes, slot.build_notes = ready.profile, ready.profile_notes, ready.build_notes
        slot.transition(
            SlotState.SERVING,
            f"ready in {slot.ready_ms:.0f} ms (load {ready.load_ms:.0f} ms, warm-up {ready.warmup_ms:.0f} ms, "
            f"profile {ready.profile})",
        )
        self.dispatch(slot.model.name)

    def on_reply(self, slot: WorkerSlot, reply: wm.Reply, frames: list[Any]) -> None:
        """Forward a worker's answer to the client that asked, exactly once."""
        request = slot.inflight.pop(reply.request_id, None)
        if request is None:
            self.count("reply_stale")
            return
        self.inflight_count -= 1
        now = time.monotonic()
        slot.progress_at = now
        service_ms = (now - request.dispatched_at) * 1000.0
        slot.requests += 1
        slot.process_requests += 1
        if reply.error_code is None:  # errors are fast and would fake a baseline
            slot.latencies_ms.append(service_ms)
        if reply.error_code is not None:
            code = ErrorCode(reply.error_code) if reply.error_code in ErrorCode.__members__ else ErrorCode.INTERNAL
            self.fail(request, code, reply.message)
        elif not frames:
            self.count("worker_message_malformed", f"{slot.name}: a successful reply without a result header")
            self.fail(request, ErrorCode.INTERNAL, "the worker sent a reply without a result header")
        elif request.deadline is not None and now >= request.deadline:
            # The client asked for no answer after its deadline; a late result would be one.
            self.fail(request, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while the model ran")
        else:
            # The worker wrote the client's result header itself: forwarded as is, never re-encoded.
            self.finish(request, None, frames[0], frames[1:])
        self.after_reply(slot)

    def after_reply(self, slot: WorkerSlot) -> None:
        """A worker freed a place: refill it, or tell a draining one it may go once it holds nothing."""
        if slot.state is SlotState.DRAINING:
            if not slot.inflight:
                self.send_control(slot, wm.Drain())
        else:
            self.dispatch(slot.model.name)

    def send_control(self, slot: WorkerSlot, message: wm.WorkerMessage) -> bool:
        """Send a heartbeat/drain/stop to a worker; False if its link is closed."""
        return self.send_link(slot, wm.encode(message))

    def send_link(self, slot: WorkerSlot, frames: list[Any]) -> bool:
        """Send one message on a worker's link (what the socket cannot take now waits in its outbox)."""
        link = slot.link
        if link is None:
            return False
        try:
            link.send(frames)
        except LinkClosed:
            # Not unwatched: replies the worker wrote before it went are read up to EOF.
            return False
        self.watch_writes(link)
        return True

    def watch_writes(self, link: Link) -> None:
        """Poll a link for room to write exactly while its outbox holds bytes."""
        fd = link.fileno()
        if link.wants_write != (fd in self.writing) and fd in self.links:
            self.writing ^= {fd}
            self.poller.modify(fd, _POLLIN | (_POLLOUT if link.wants_write else 0))

    # ---- keeping warm -------------------------------------------------------------------------

    @property
    def rehearsal_due_ms(self) -> int | None:
        """How long the loop may idle before it rehearses: `keep_warm_ms` while a worker holds a request, else None."""
        if self.rehearsal is None or not self.inflight_count:
            return None
        return self.config.keep_warm_ms

    def reconcile_rehearsal(self) -> None:
        """Hold a rehearsal of the config's first model exactly while `keep_warm_ms` is set and none has failed."""
        model = next(iter(self.config.models.values()), None)
        wanted = self.config.keep_warm_ms is not None and model is not None and self.rehearsal_error is None
        if self.rehearsal is not None and (not wanted or self.rehearsal.model is not model):
            self.rehearsal.close()  # off, failed, or a reload replaced the model's config
            self.rehearsal = None
        if wanted and self.rehearsal is None and model is not None:
            self.rehearsal = Rehearsal(model, self.config.max_frame_bytes)

    def rehearse(self) -> None:
        """Run the rehearsal once; a failure is logged and kept for status, and rehearsing stops until a reload."""
        if self.rehearsal is None:
            return
        try:
            self.rehearsal.run()
        except Exception as exc:  # a broken rehearsal must cost the warmth, never the daemon
            log.exception("keep_warm_failed", model=self.rehearsal.model.name)
            self.rehearsal_error = f"{type(exc).__name__}: {exc}"
            self.rehearsal.close()
            self.rehearsal = None
            return
        self.rehearsals += 1

    def close(self) -> None:
        """Close the client sockets (the arbiter closes worker links as it stops their processes)."""
        for socket in self.client_sockets:
            socket.close(linger=0)
        if self.rehearsal is not None:
            self.rehearsal.close()
            self.rehearsal = None
        if self.authenticator is not None:
            self.authenticator.stop()
