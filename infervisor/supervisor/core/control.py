"""The local control socket, the daemon's side: msgpack commands in, msgpack documents out.

The client's side (control_request and its errors) is infervisor/protocol/control_client.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq

from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import CONTROL_SOCKET_NAME, STATUS_SOCKET_NAME, ErrorCode
from infervisor.protocol.control_client import user_name
from infervisor.protocol.errors import ProtocolError
from infervisor.supervisor.core.control_commands import read_only_commands
from infervisor.supervisor.host.socket_group import SocketGroup, bind_ipc
from infervisor.supervisor.instruments.anomalies import Anomalies

log = structlog.get_logger("supervisor")

Handler = Callable[[dict[str, Any]], dict[str, Any]]

#: Commands answered per loop turn: a flood of them must not hold the loop that routes requests.
_BATCH = 16


class ControlServer:
    """A ROUTER on ipc://RUNTIME_DIR/control.sock (0600), answered from the main loop.

    Built by `status_server` instead, it is status.sock: 0660 in the socket group, read-only commands only.
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        runtime_dir: Path,
        anomalies: Anomalies,
        name: str = CONTROL_SOCKET_NAME,
        group: SocketGroup | None = None,
        commands: frozenset[str] | None = None,
    ) -> None:
        self.anomalies = anomalies
        self.path = runtime_dir / name
        self.endpoint = f"ipc://{self.path}"
        #: The commands this socket answers; None: all of them.
        self.commands = commands
        self.socket: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        bind_ipc(self.socket, self.path, group)

    def handle(self, handler: Handler) -> None:
        """Answer up to a batch of pending commands; the rest wait for the next turn."""
        for _ in range(_BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                continue
            try:
                command = unpack(frames[2])
                if not isinstance(command, dict):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "command must be a map")
                answer = self._refusal(command) or handler(command)
            except ProtocolError as exc:
                answer = {"ok": False, "error": exc.message}
            except Exception as exc:  # a failing command must not stop the daemon
                log.exception("control_command_failed")
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                self.socket.send_multipart([frames[0], b"", pack(answer)], zmq.NOBLOCK)
            except zmq.ZMQError:
                self.anomalies.count("control_reply_undeliverable", "a control client left before its answer")

    def _refusal(self, command: dict[str, Any]) -> dict[str, Any] | None:
        """The answer to a command this socket does not take (an operator's, on status.sock), else None."""
        name = command.get("cmd")
        if self.commands is None or name in self.commands:
            return None
        user = user_name(os.geteuid())
        return {
            "ok": False,
            "error": f"{str(name)[:64]!r} is not answered on {self.path.name}, which takes only "
            f"{', '.join(sorted(self.commands))}: send it to {CONTROL_SOCKET_NAME} as the daemon's user "
            f"(sudo -u {user} infervisor ...) or as root",
        }

    def close(self) -> None:
        """Close the socket and remove its file, so a client finds no socket rather than a dead one."""
        self.socket.close(linger=0)
        # Ours to remove: the daemon holds the runtime dir's lock (infervisor/supervisor/host/instance_lock.py)
        # until after this.
        self.path.unlink(missing_ok=True)


def status_server(
    context: zmq.Context[Any], runtime_dir: Path, anomalies: Anomalies, group: SocketGroup | None
) -> ControlServer | None:
    """status.sock for the socket group's members (status, ping, metrics), or None without a socket_group.

    control.sock stays 0600: restart, reload and profile change what every client is served, so
    they are the daemon user's (or root's), and a client application gets only what it reads.
    """
    if group is None:
        # We hold the runtime dir's lock: one is left from an earlier daemon's socket_group, killed with -9,
        # and would send `infervisor status` to a socket nobody listens on.
        (runtime_dir / STATUS_SOCKET_NAME).unlink(missing_ok=True)
        return None
    return ControlServer(context, runtime_dir, anomalies, STATUS_SOCKET_NAME, group, read_only_commands())
