"""The supervisor's ends of the worker links: attached to the event loop, written without blocking, read to EOF."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.worker_link import Link, LinkClosed
from infervisor.supervisor.host.event_loop import POLLIN, POLLOUT, READABLE, WORKERS, EventLoop
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.workers.slot import WorkerSlot

#: Whole messages read from one link per call, so one chatty worker cannot hold the loop.
_BATCH = 256

#: Gets every whole message a worker's link held, in order.
MessageHandler = Callable[[WorkerSlot, list[list[memoryview]]], None]
#: Told when a link's byte stream lost its framing: the worker must be replaced.
BrokenHandler = Callable[[WorkerSlot, str], None]


class WorkerLinks:
    """Owns link I/O for every slot with a process: polling, outboxes, reading; never decides a slot's fate."""

    def __init__(self, loop: EventLoop, anomalies: Anomalies) -> None:
        self.loop = loop
        self.anomalies = anomalies
        self.on_messages: MessageHandler = lambda slot, messages: None
        self.on_broken: BrokenHandler = lambda slot, reason: None
        #: Descriptors polled for POLLOUT too: their outbox holds what the socket could not take yet.
        self.writing: set[int] = set()
        self.watched: dict[int, WorkerSlot] = {}

    def deliver_to(self, on_messages: MessageHandler, on_broken: BrokenHandler) -> None:
        """Where the messages read from every link go, and who hears of a link that lost its framing."""
        self.on_messages, self.on_broken = on_messages, on_broken

    def attach(self, slot: WorkerSlot) -> None:
        """Listen to the link of the slot's new process."""
        if slot.proc.link is None:
            return
        fd = slot.proc.link.fileno()
        self.watched[fd] = slot
        self.loop.register(fd, WORKERS, lambda flags: self.on_event(slot, flags))

    def detach(self, slot: WorkerSlot) -> None:
        """Close the link of the slot's old process: nothing more from it (a late reply must not be delivered twice)."""
        link, slot.proc.link = slot.proc.link, None
        if link is not None:
            self.unwatch(link)
            link.close()

    def unwatch(self, link: Link) -> None:
        """Stop polling a link (closed by the worker, or broken); the process exit is reaped as usual."""
        fd = link.fileno()
        if self.watched.pop(fd, None) is not None:
            self.loop.unregister(fd)
            self.writing.discard(fd)

    def send(self, slot: WorkerSlot, frames: list[Any]) -> bool:
        """Send one message on a worker's link (what the socket cannot take now waits in its outbox)."""
        link = slot.proc.link
        if link is None:
            return False
        try:
            link.send(frames)
        except LinkClosed:
            # Not unwatched: replies the worker wrote before it went are read up to EOF.
            return False
        self.watch_writes(link)
        return True

    def lost(self, slot: WorkerSlot, reason: str) -> None:
        """A sender found the slot's link closed: tell whoever replaces workers (the pool)."""
        self.on_broken(slot, reason)

    def send_control(self, slot: WorkerSlot, message: wm.WorkerMessage) -> bool:
        """Send a heartbeat, drain, stop, canary or profile message; False if the link is closed."""
        return self.send(slot, wm.encode(message))

    def watch_writes(self, link: Link) -> None:
        """Poll a link for room to write exactly while its outbox holds bytes."""
        fd = link.fileno()
        if link.wants_write != (fd in self.writing) and fd in self.watched:
            self.writing ^= {fd}
            self.loop.modify(fd, POLLIN | (POLLOUT if link.wants_write else 0))

    def on_event(self, slot: WorkerSlot, flags: int) -> None:
        """Write what the link could not take before; read every whole message it holds."""
        link = slot.proc.link
        if link is None:
            return
        if flags & POLLOUT:
            try:
                link.flush()
            except LinkClosed:
                pass  # the worker is gone; what it wrote before going is still read below, up to EOF
            self.watch_writes(link)
        if flags & READABLE:
            self.read(slot)

    def read(self, slot: WorkerSlot) -> bool:
        """Hand on the whole messages the link holds now; False when there were none (or EOF, or garbage)."""
        link = slot.proc.link
        if link is None:
            return False
        try:
            messages = link.receive()
        except LinkClosed:
            self.unwatch(link)  # the process exited or is exiting: reaping settles the slot
            return False
        except ProtocolError as exc:
            # A byte stream that lost its framing cannot be trusted again.
            self.anomalies.count("worker_message_malformed", f"{slot.name}: {exc.message}")
            self.unwatch(link)
            self.on_broken(slot, f"garbled link: {exc.message}")
            return False
        if messages:
            self.on_messages(slot, messages)
        return bool(messages)

    def drain(self, slot: WorkerSlot) -> None:
        """Take what an exited worker wrote before it went (a reply it sent is delivered, not re-run)."""
        link = slot.proc.link
        if link is None:
            return
        link.sendable = False  # nothing new goes to a process that is gone
        # The process is dead, so everything it wrote is already in the socket: read until EOF.
        for _ in range(_BATCH):
            if not self.read(slot):
                return
