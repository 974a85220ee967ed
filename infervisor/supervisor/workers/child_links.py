"""The supervisor's ends of its other children's links (background builder, audit and shadow processes) on the event
loop, as worker_links.py keeps the serving workers': read when readable, written when the socket has room, each
message decoded once (worker_inbox.py `deliver_to_owner`) and handed to the child's owner.

A link that reaches EOF or loses its framing is closed here and the record's `link` is None: the owner then ends
the process if it still lives, and the reaper (reaper.py) notices its end like any other.
"""

from __future__ import annotations

from typing import Any

from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.worker_link import Link, LinkClosed
from infervisor.supervisor.host.event_loop import POLLIN, POLLOUT, READABLE, WORKERS, EventLoop
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.workers.child_record import ChildRecord
from infervisor.supervisor.workers.worker_inbox import ChildOwner, deliver_to_owner

#: Reads of one link when its process has ended (everything it wrote is in the socket by then).
_DRAIN_READS = 256


class ChildLinks:
    """Every other child's link on the loop; owns only the I/O, never what a message means."""

    def __init__(self, loop: EventLoop, anomalies: Anomalies) -> None:
        self.loop = loop
        self.anomalies = anomalies
        self.watched: dict[int, tuple[ChildRecord, ChildOwner]] = {}
        #: Descriptors polled for POLLOUT too: their outbox holds what the socket could not take yet.
        self.writing: set[int] = set()

    def attach(self, record: ChildRecord, owner: ChildOwner) -> None:
        """Listen to the link of the record's new process; its messages go to `owner`."""
        link = record.link
        if link is None:
            return
        fd = link.fileno()
        self.watched[fd] = (record, owner)
        self.loop.register(fd, WORKERS, lambda flags: self.on_event(fd, flags))
        record.on_close = lambda: self.unwatch(link)

    def unwatch(self, link: Link) -> None:
        """Stop polling a link (before it is closed: a closed descriptor must not stay in the poller)."""
        fd = link.fileno()
        if fd >= 0 and self.watched.pop(fd, None) is not None:
            self.loop.unregister(fd)
            self.writing.discard(fd)

    def send(self, record: ChildRecord, frames: list[Any]) -> bool:
        """Send one message (what the socket cannot take now waits in the outbox); False once the link is gone."""
        link = record.link
        if link is None:
            return False
        try:
            link.send(frames)
        except LinkClosed:
            return False
        self.watch_writes(link)
        return True

    def watch_writes(self, link: Link) -> None:
        """Poll a link for room to write exactly while its outbox holds bytes."""
        fd = link.fileno()
        if link.wants_write != (fd in self.writing) and fd in self.watched:
            self.writing ^= {fd}
            self.loop.modify(fd, POLLIN | (POLLOUT if link.wants_write else 0))

    def on_event(self, fd: int, flags: int) -> None:
        """Write what waited for room; read every whole message the link holds."""
        entry = self.watched.get(fd)
        if entry is None:
            return
        record, owner = entry
        link = record.link
        if link is None:
            return
        if flags & POLLOUT:
            try:
                link.flush()
            except LinkClosed:
                pass  # the process is gone; what it wrote before is still read below, up to EOF
            self.watch_writes(link)
        if flags & READABLE:
            self.read(record, owner)

    def read(self, record: ChildRecord, owner: ChildOwner) -> bool:
        """Hand on the whole messages the link holds now; False when there were none, at EOF, or on garbage."""
        link = record.link
        if link is None:
            return False
        try:
            messages = link.receive()
        except LinkClosed:
            self.lost(record)
            return False
        except ProtocolError as exc:
            # A byte stream that lost its framing cannot be trusted again: the owner ends the process.
            self.anomalies.count("worker_message_malformed", f"{record.worker_id}: {exc.message}")
            self.lost(record)
            return False
        if messages:
            deliver_to_owner(record.worker_id, messages, owner, self.anomalies)
        return bool(messages)

    def drain(self, record: ChildRecord) -> None:
        """Take what an ended child wrote before it went (its READY, its LOAD_ERROR, its last results)."""
        entry = self.watched.get(record.link.fileno()) if record.link is not None else None
        if entry is None:
            return
        for _ in range(_DRAIN_READS):
            if not self.read(record, entry[1]):
                return

    def lost(self, record: ChildRecord) -> None:
        """The link is over (EOF, garbage): unwatched, closed, and the record's link gone."""
        link, record.link = record.link, None
        if link is not None:
            self.unwatch(link)
            link.close()
