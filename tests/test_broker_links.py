"""The broker over real worker links: a dead worker's last reply is delivered, a dead link is routed around."""

from __future__ import annotations

import gc
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.client_messages import InferRequest, encode_infer, encode_result
from infervisor.protocol.tensors import TensorDesc
from infervisor.protocol.worker_link import WORKER_LINK_FRAMES, Link
from infervisor.supervisor.host.event_loop import EventLoop
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.routing.endpoints import ClientEndpoints
from infervisor.supervisor.routing.replies import client_replies
from infervisor.supervisor.routing.streams import Streams
from infervisor.supervisor.settings.config import parse_config
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot
from infervisor.supervisor.workers.worker_inbox import WorkerInbox
from infervisor.supervisor.workers.worker_links import WorkerLinks

X = np.arange(16, dtype=np.float32).reshape(1, 16)
DESC = (TensorDesc("x", "float32", (1, 16)),)


class BrokenLinks:
    """The pool's place in this rig: only records which links were reported broken."""

    def __init__(self) -> None:
        self.broken: list[tuple[str, str]] = []
        self.ready: list[str] = []
        self.drained: list[str] = []

    def worker_ready(self, slot: WorkerSlot, ready: wm.Ready) -> None:
        """Let it serve, as the pool does."""
        self.ready.append(slot.name)
        slot.state = SlotState.SERVING

    def worker_progress(self, slot: WorkerSlot, progress: wm.Progress) -> None:
        """Not expected here."""

    def worker_load_error(self, slot: WorkerSlot, error: wm.LoadError) -> None:
        """Not expected here."""

    def link_broken(self, slot: WorkerSlot, reason: str) -> None:
        """Remember the report."""
        self.broken.append((slot.name, reason))

    def worker_drained(self, slot: WorkerSlot) -> None:
        """Remember the report."""
        self.drained.append(slot.name)


class Rig:
    """A broker with serving slots (two unless told) whose far link ends the test holds, and a DEALER client."""

    def __init__(self, tmp: Path, workers: int = 2, batching: dict[str, Any] | None = None, prefetch: int = 1) -> None:
        model = {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}]}
        entry = {**model, "workers": workers, "prefetch": prefetch, "batching": batching}
        config = parse_config(json.dumps({"models": {"tiny": entry}}), tmp)
        self.context: zmq.Context[Any] = zmq.Context()
        self.loop = EventLoop()
        anomalies = Anomalies()
        self.links = WorkerLinks(self.loop, anomalies)
        self.events = BrokenLinks()
        self.endpoints = ClientEndpoints(self.context, config, tmp)
        serving = ServingConfig(config)
        replies = client_replies(self.endpoints.sockets, serving, anomalies)
        streams = Streams(replies.queues, replies.finish)
        self.broker = Broker(self.endpoints, self.loop, self.links, serving, anomalies, replies, streams)
        inbox = WorkerInbox(anomalies, self.broker, self.events, lambda slot, result: None)
        self.links.deliver_to(inbox.deliver, self.events.link_broken)
        self.slots: list[WorkerSlot] = []
        self.workers: list[Link] = []
        for index in range(workers):
            slot = WorkerSlot(config.models["tiny"], Assignment("tiny", index, (index,), 0, 1, False))
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            slot.proc.link = Link(ours, WORKER_LINK_FRAMES, 2**30)
            slot.state = SlotState.SERVING
            slot.proc.worker_id = f"tiny.{index}.1"
            self.slots.append(slot)
            self.workers.append(Link(theirs, WORKER_LINK_FRAMES, 2**30))
        self.broker.route_to({"tiny": self.slots}.get)
        for slot in self.slots:
            self.links.attach(slot)
        self.client = self.context.socket(zmq.DEALER)
        self.client.setsockopt(zmq.LINGER, 0)
        self.client.connect(self.endpoints.ipc_endpoint)

    def held(self, slot: WorkerSlot) -> int:
        """How many requests the slot's worker holds."""
        return self.broker.pipelines.of(slot).size

    def send_request(self, request_id: int) -> None:
        """One infer request from the client, taken in by the broker."""
        self.client.send_multipart([b"", encode_infer(InferRequest(request_id, "tiny", DESC)), X])
        assert self.endpoints.ipc.poll(5000)
        self.broker.handle_clients(self.endpoints.ipc)

    def message_at(self, worker: int) -> wm.WorkerMessage:
        """The one message the broker sent to worker `worker` since the last look."""
        link = self.workers[worker]
        assert link.wait_readable(5.0)
        (frames,) = link.receive()
        return wm.decode(frames[0])

    def request_at(self, worker: int) -> wm.Request:
        """The REQUEST the broker sent to worker `worker`."""
        message = self.message_at(worker)
        assert isinstance(message, wm.Request)
        return message

    def reply(self, worker: int, request: wm.Request, client_id: int) -> None:
        """Worker `worker` answers `request` with the echo result."""
        header = encode_result(client_id, "tiny", DESC, {"model_ms": 0.1})
        self.workers[worker].send(wm.encode(wm.Reply(request.request_id, None, ""), [header, X]))

    def answer_and_read(self, worker: int, request: wm.Request, client_id: int) -> None:
        """Worker `worker` answers `request`, and the broker reads the answer (dispatching what may follow)."""
        self.reply(worker, request, client_id)
        link = self.slots[worker].proc.link
        assert link is not None and link.wait_readable(5.0) and self.links.read(self.slots[worker])

    def batch_at(self, worker: int) -> wm.Batch:
        """The BATCH the broker sent to worker `worker`."""
        message = self.message_at(worker)
        assert isinstance(message, wm.Batch)
        return message

    def client_reply(self) -> dict[str, Any]:
        """The next reply header the client receives."""
        assert self.client.poll(5000)
        header: dict[str, Any] = msgpack.unpackb(self.client.recv_multipart()[1])
        return header

    def close(self) -> None:
        """Close every socket and link."""
        for slot in self.slots:
            self.links.detach(slot)
        for link in self.workers:
            link.close()
        self.client.close()
        self.broker.close()
        self.loop.close()
        self.context.term()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A broker with two linked slots."""
    made = Rig(tmp_path)
    yield made
    made.close()


def test_a_reply_written_just_before_the_worker_died_is_delivered_not_rerun(rig: Rig) -> None:
    """The worker answers and exits before the broker reads: draining at reap delivers the answer once."""
    rig.send_request(41)
    busy = next(i for i, slot in enumerate(rig.slots) if rig.held(slot))
    request = rig.request_at(busy)
    rig.reply(busy, request, 41)
    rig.workers[busy].close()  # the process exits; nothing of it was read yet
    rig.links.drain(rig.slots[busy])
    header = rig.client_reply()
    assert (header["type"], header["id"]) == ("result", 41)
    assert not rig.held(rig.slots[busy]), "answered, so nothing is left to re-dispatch"
    assert rig.broker.queues["tiny"].completed == 1


def test_a_request_for_a_worker_whose_link_died_goes_to_another_at_once(rig: Rig) -> None:
    """The most recently busy worker died unnoticed: the send fails, and the same request goes to its sibling."""
    rig.send_request(1)
    first = next(i for i, slot in enumerate(rig.slots) if rig.held(slot))
    rig.reply(first, rig.request_at(first), 1)
    assert rig.slots[first].proc.link is not None
    assert rig.slots[first].proc.link.wait_readable(5.0)
    rig.links.read(rig.slots[first])
    assert rig.client_reply()["id"] == 1
    rig.workers[first].close()  # dies idle; the broker has not read the EOF yet
    rig.send_request(2)  # ties go to the most recently busy worker: the dead one is tried first
    other = 1 - first
    assert rig.request_at(other).request_id > 0
    assert rig.held(rig.slots[other]) and not rig.held(rig.slots[first])
    assert not rig.broker.queues["tiny"].waiting
    assert rig.events.broken == [(rig.slots[first].name, "worker link closed")], "reported, not acted on"


def test_idle_workers_never_wait_for_companions_and_only_a_busy_workers_next_batch_does(tmp_path: Path) -> None:
    """10 s of delay, prefetch 2: each idle worker takes a request at once; with both busy the next waits."""
    batching = {"max_batch_size": 8, "max_queue_delay_us": 10_000_000}
    rig = Rig(tmp_path, workers=2, batching=batching, prefetch=2)
    try:
        rig.send_request(1)
        first = next(i for i, slot in enumerate(rig.slots) if rig.held(slot))
        lone = rig.request_at(first)
        rig.send_request(2)
        assert rig.request_at(1 - first).request_id > 0, "the other idle worker took it at once"
        rig.send_request(3)  # both run one: a second batch in a worker's hands waits for companions or its delay
        assert len(rig.broker.queues["tiny"].waiting) == 1 and rig.broker.dispatcher.next_batch_due is not None
        rig.answer_and_read(first, lone, 1)
        assert rig.request_at(first).request_id > 0, "a worker with nothing in hand takes the line at once"
        assert not rig.broker.queues["tiny"].waiting
    finally:
        rig.close()


def test_a_long_line_is_cut_at_its_fair_share_so_one_worker_never_takes_it_all(tmp_path: Path) -> None:
    """Two workers, 10 waiting: the first to free up takes 6 (11 requests over 2), the other the remaining 4."""
    rig = Rig(tmp_path, workers=2, batching={"max_batch_size": 32, "max_queue_delay_us": 0})
    try:
        rig.send_request(1)
        first = next(i for i, slot in enumerate(rig.slots) if rig.held(slot))
        lone = rig.request_at(first)
        rig.send_request(2)
        second = rig.request_at(1 - first)
        for client_id in range(3, 13):
            rig.send_request(client_id)
        assert len(rig.broker.queues["tiny"].waiting) == 10
        rig.answer_and_read(first, lone, 1)
        assert len(rig.batch_at(first).frame_counts) == 6, "its share, not the whole line"
        assert len(rig.broker.queues["tiny"].waiting) == 4
        rig.answer_and_read(1 - first, second, 2)
        assert len(rig.batch_at(1 - first).frame_counts) == 4
        assert not rig.broker.queues["tiny"].waiting
    finally:
        rig.close()


def test_a_ready_read_from_a_link_goes_to_the_pool_and_the_worker_then_gets_what_waits(tmp_path: Path) -> None:
    """READY is handed to the pool by the worker inbox (no relay); the broker then dispatches the line to it."""
    rig = Rig(tmp_path, workers=1)
    try:
        slot = rig.slots[0]
        slot.state = SlotState.STARTING
        rig.send_request(7)
        assert len(rig.broker.queues["tiny"].waiting) == 1, "nobody serves yet: it waits in line"
        rig.workers[0].send(wm.encode(wm.Ready(slot.proc.worker_id, 1, 1.0, 1.0, 1, [0], "eager", [], [])))
        assert slot.proc.link is not None and slot.proc.link.wait_readable(5.0) and rig.links.read(slot)
        assert rig.events.ready == [slot.name]
        assert rig.request_at(0).request_id > 0 and rig.held(slot) == 1
        assert not rig.broker.queues["tiny"].waiting
    finally:
        rig.close()


def test_a_draining_workers_last_reply_tells_the_pool_it_may_go(rig: Rig) -> None:
    """The client gets its answer, and the pool hears the draining worker holds nothing any more."""
    rig.send_request(3)
    busy = next(i for i, slot in enumerate(rig.slots) if rig.held(slot))
    request = rig.request_at(busy)
    rig.slots[busy].state = SlotState.DRAINING
    rig.answer_and_read(busy, request, 3)
    assert rig.client_reply()["id"] == 3
    assert rig.events.drained == [rig.slots[busy].name]


def _frames_alive() -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, zmq.Frame))


@pytest.mark.parametrize(
    ("header", "tensor", "code"),
    [
        (encode_infer(InferRequest(4, "tiny", DESC)), b"\0" * 2**20, "INVALID_INPUT"),  # frame and header disagree
        (encode_infer(InferRequest(5, "tiny", (TensorDesc("x", "float32", (1, 8)),))), b"\0" * 32, "INVALID_INPUT"),
        (encode_infer(InferRequest(6, "nope", DESC)), X.tobytes(), "UNKNOWN_MODEL"),
        (b"\x93not a header", X.tobytes(), "BAD_REQUEST"),
    ],
)
def test_a_refused_message_is_freed_at_once_not_by_a_garbage_collection(
    rig: Rig, header: bytes, tensor: bytes, code: str
) -> None:
    """No frame of a refused message outlives its refusal with the garbage collector off (no cycle holds them)."""
    gc.collect()
    gc.disable()
    try:
        before = _frames_alive()
        rig.client.send_multipart([b"", header, tensor])
        assert rig.endpoints.ipc.poll(5000)
        rig.broker.handle_clients(rig.endpoints.ipc)
        assert rig.client_reply()["code"] == code
        assert _frames_alive() == before
    finally:
        gc.enable()
