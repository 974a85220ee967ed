"""The main loop's one poller: every socket and descriptor it waits on, each with the handler that reads it."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import zmq

#: Poll flags as ints: bit operations on pyzmq's enum flags run Python code on every event.
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
READABLE = POLLIN | int(zmq.POLLERR)

#: Called with the poll flags that fired.
Handler = Callable[[int], None]

#: Handlers run in this order within one turn: a worker's reply frees the place a client's request may
#: take, and the control socket comes last so a flood of commands cannot delay either.
WORKERS, CLIENTS, CONTROL, WAKE = 0, 1, 2, 3


class EventLoop:
    """A zmq.Poller plus a registry (socket or fd -> handler, rank); `poll` dispatches what fired, by rank."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.handlers: dict[Any, tuple[int, Handler]] = {}
        #: A byte on this socketpair makes the poll return at once (signals, the file watcher's thread).
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.register(self.wake_r.fileno(), WAKE, self._drain_wakeup)

    def register(self, item: Any, rank: int, handler: Handler, events: int = POLLIN) -> None:
        """Wait on a zmq socket or a file descriptor; `handler` gets the flags when it fires."""
        self.handlers[item] = (rank, handler)
        self.poller.register(item, events)

    def modify(self, item: Any, events: int) -> None:
        """Change what a registered item is polled for (POLLOUT only while there is something to write)."""
        self.poller.modify(item, events)

    def unregister(self, item: Any) -> None:
        """Stop waiting on an item (closed, or its process is gone)."""
        if self.handlers.pop(item, None) is not None:
            self.poller.unregister(item)

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` and run the handlers of what fired, lowest rank first; returns how many fired."""
        events = self.poller.poll(timeout_ms)
        if len(events) > 1:
            events.sort(key=lambda event: self.handlers[event[0]][0] if event[0] in self.handlers else WAKE)
        for item, flags in events:
            entry = self.handlers.get(item)
            if entry is not None:  # a handler earlier in this turn may have unregistered it
                entry[1](flags)
        return len(events)

    def wake(self) -> None:
        """Make the current or next poll return (safe from any thread and from a signal handler's wake-up fd)."""
        try:
            self.wake_w.send(b"\0")
        except BlockingIOError:
            pass  # the pair is full: the poll will return anyway

    def _drain_wakeup(self, flags: int) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the wake-up pair."""
        self.wake_r.close()
        self.wake_w.close()
