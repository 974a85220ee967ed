"""Multipart send and receive without pyzmq's per-frame Python overhead (hot path of broker and worker).

pyzmq's send_multipart ORs enum flags once per frame, and recv_multipart asks getsockopt(RCVMORE)
after every frame, which builds a SocketOption enum each time; together they cost more than half
of a small message's round trip through a Python broker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

#: The flags as ints: `zmq.SNDMORE | flags` on the enum costs about a microsecond a frame.
SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(socket: zmq.Socket[Any], frames: Sequence[Any], flags: int = 0) -> None:
    """Send `frames` (bytes, zmq.Frame or C-contiguous buffers) as one message; large ones are not copied.

    Every frame must already be a buffer: a frame refused half-way would leave the first ones queued
    as the start of a message the next send would complete. Callers here only pass bytes, received
    Frames and arrays made C-contiguous, and libzmq refuses whole messages (EAGAIN, EHOSTUNREACH)
    on the first frame, before anything is queued.
    """
    more = flags | SNDMORE
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        socket.send(frame, more if index < last else flags, copy=False)


def recv_frames(socket: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """Receive one whole message as zero-copy Frames; raises zmq.Again when NOBLOCK finds nothing.

    A message is delivered atomically, so once its first frame arrived the rest is already here:
    only the first receive can block or fail with Again. `Frame.more` reads the received message
    itself instead of asking the socket.
    """
    frame: zmq.Frame = socket.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = socket.recv(flags, copy=False)
        frames.append(frame)
    return frames


def more_to_read(socket: zmq.Socket[Any]) -> bool:
    """Whether another message waits: a getsockopt (~1 us) is cheaper than a receive failing with Again (~3 us)."""
    events: int = socket.getsockopt(_EVENTS)  # type: ignore[assignment]  # an int option
    return bool(events & _POLLIN)
