"""Which connection a request came in on, and whether it is still the one its routing id names.

A client may choose its routing id, so once it disconnects another client (another local user) may
connect with the same one, and ZeroMQ would hand it every reply still owed to the first. libzmq's
ROUTER_NOTIFY would tell the broker in band, but it is a draft option the installed libzmq refuses
(EINVAL), so connections are followed by a socket monitor instead:

- each message carries the descriptor of the connection it came in on (ZMQ_SRCFD);
- libzmq emits DISCONNECTED for that descriptor before it ends the connection's pipe, and the ROUTER
  frees the routing id only once the broker has read past that pipe's end (a receive or a poll), so
  the monitor, read right before a reply goes, always knows of a disconnect that freed its routing id.

A request is stamped with its connection's descriptor and how many disconnects that descriptor has
seen (the kernel reuses descriptors); its reply goes only while that count is unchanged.
"""

from __future__ import annotations

from typing import Any, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from infervisor.supervisor.routing.pending import Peer

#: A request's connection: (its socket, descriptor) and the disconnects that descriptor had seen when it came in.
Connection = tuple[Any, int, int]


class Connections:
    """Disconnects of the client-facing sockets' connections, read from a monitor of each socket."""

    def __init__(self, sockets: list[zmq.Socket[Any]]) -> None:
        self.monitors = [(socket, socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)) for socket in sockets]
        #: Disconnects seen per (socket, descriptor); a descriptor absent has seen none.
        self.ended: dict[tuple[Any, int], int] = {}
        #: The routing id last seen on each live (socket, descriptor): whose outbox a disconnect empties.
        self.routing_ids: dict[tuple[Any, int], bytes] = {}

    @property
    def monitor_sockets(self) -> list[zmq.Socket[Any]]:
        """The sockets the disconnects arrive on."""
        return [monitor for _, monitor in self.monitors]

    def stamp(self, client: Peer, frame: zmq.Frame) -> Connection:
        """The connection a message just received came in on (after the disconnects known so far)."""
        socket = client[0]
        fd = frame.get(zmq.SRCFD)
        self.routing_ids[(socket, fd)] = client[1]
        return socket, fd, self.ended.get((socket, fd), 0)

    def is_gone(self, connection: Connection) -> bool:
        """True when the connection has disconnected: its routing id may now name another client."""
        socket, fd, seen = connection
        return self.ended.get((socket, fd), 0) != seen

    def read(self) -> list[Peer]:
        """Take the disconnects the monitors hold; the peers (socket, routing id) whose connection ended."""
        left: list[Peer] = []
        for socket, monitor in self.monitors:
            while cast(int, monitor.get(zmq.EVENTS)) & zmq.POLLIN:
                event = parse_monitor_message(monitor.recv_multipart())
                key = (socket, int(event["value"]))  # DISCONNECTED's value is the descriptor
                self.ended[key] = self.ended.get(key, 0) + 1
                routing_id = self.routing_ids.pop(key, None)
                if routing_id is not None:
                    left.append((socket, routing_id))
        return left

    def close(self) -> None:
        """Stop the monitors and close their sockets."""
        for socket, monitor in self.monitors:
            socket.disable_monitor()
            monitor.close(linger=0)
