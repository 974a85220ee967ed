"""Multipart sends with plain-int flags: pyzmq's send_multipart ORs enum flags once per frame in Python."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

#: The flags as ints: `zmq.SNDMORE | flags` on the enum costs about a microsecond a frame.
SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


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
