"""The link between the supervisor and its warm template: one JSON message a datagram, descriptors beside it.

The supervisor holds one end of an AF_UNIX SOCK_SEQPACKET socketpair and the template (infervisor/worker/template.py)
the other; no path names it, so no other process on the box can ask the template for anything. The template says
READY once its imports are done; then each FORK request (the module to run, its launch spec, its environment, with
the child's link and output descriptors passed by SCM_RIGHTS) gets one answer: the new child's pid, or why not.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from typing import Any

#: A launch spec with every recent exit of a model is a few kilobytes; anything larger is a garbled link.
MAX_MESSAGE_BYTES = 1 << 20
#: The child's link to the supervisor, and where its stdout and stderr go.
MAX_PASSED_FDS = 2

READY = "ready"
FORK = "fork"
FORKED = "forked"
REFUSED = "refused"


class TemplateLinkError(Exception):
    """The other end closed the link or sent what this side cannot read."""


def template_socketpair() -> tuple[socket.socket, socket.socket]:
    """The supervisor's end and the template's end of a fresh link."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message, with `fds` passed to the other process."""
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise TemplateLinkError(f"message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    socket.send_fds(sock, [data], list(fds))


def receive_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it; TemplateLinkError at EOF or on a bad message."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES + 1, MAX_PASSED_FDS)
    if not data:
        _close_all(fds)
        raise TemplateLinkError("the link closed")
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE_BYTES:
        _close_all(fds)
        raise TemplateLinkError("a message or its descriptors were cut")
    try:
        message = json.loads(data)
    except ValueError as exc:
        _close_all(fds)
        raise TemplateLinkError(f"not JSON: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        _close_all(fds)
        raise TemplateLinkError("a message without a kind")
    return message, fds


def _close_all(fds: Sequence[int]) -> None:
    """Close descriptors that arrived with a message this side refuses."""
    for fd in fds:
        os.close(fd)
