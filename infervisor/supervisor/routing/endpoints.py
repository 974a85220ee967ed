"""The client-facing sockets: the ipc endpoint in the runtime dir, and the opt-in tcp one (CURVE when configured)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from infervisor.protocol.constants import CLIENT_SOCKET_NAME, MAX_HEADER_BYTES
from infervisor.supervisor.host.socket_group import bind_ipc
from infervisor.supervisor.routing.client_ledger import PEER_SNDHWM
from infervisor.supervisor.routing.curve import ThreadAuthenticator, enable_curve_server
from infervisor.supervisor.settings.config import Config

#: Requests ZeroMQ may queue per connection before reading; the broker's bounded queues do admission control.
_RCVHWM = 10_000


def _router(context: zmq.Context[Any], max_frame_bytes: int) -> zmq.Socket[Any]:
    socket: zmq.Socket[Any] = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # Few replies wait inside ZeroMQ per connection: the rest wait in the broker's outbox, counted per client.
    socket.setsockopt(zmq.SNDHWM, PEER_SNDHWM)
    socket.setsockopt(zmq.RCVHWM, _RCVHWM)
    socket.setsockopt(zmq.LINGER, 0)
    # The broker answers a frame a little over max_frame_bytes with an error and keeps the connection; past
    # 64 KB over, ZeroMQ closes it before buffering the frame: each connection can make the daemon hold
    # no more than about one frame of the limit before admission sees it.
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + MAX_HEADER_BYTES)
    return socket


class ClientEndpoints:
    """Binds the ROUTER sockets clients connect to; the broker reads and writes them."""

    def __init__(self, context: zmq.Context[Any], config: Config, runtime_dir: Path) -> None:
        self.ipc_endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
        self.ipc = _router(context, config.max_frame_bytes)
        # 0600, or 0660 in config `socket_group`: the kernel checks who connects (docs/protocol.md section 1).
        bind_ipc(self.ipc, runtime_dir / CLIENT_SOCKET_NAME, config.socket_group)
        # TCP gets its own socket so CURVE (when configured) guards it without touching the ipc endpoint.
        self.tcp: zmq.Socket[Any] | None = None
        self.authenticator: ThreadAuthenticator | None = None
        if config.tcp_endpoint:
            self.tcp = _router(context, config.max_frame_bytes)
            if config.curve is not None:
                self.authenticator = enable_curve_server(context, self.tcp, config.curve)
            self.tcp.bind(config.tcp_endpoint)

    @property
    def sockets(self) -> list[zmq.Socket[Any]]:
        """The client-facing sockets: ipc, and tcp when configured."""
        return [self.ipc] if self.tcp is None else [self.ipc, self.tcp]

    def close(self) -> None:
        """Close the sockets and stop the CURVE authenticator."""
        for socket in self.sockets:
            socket.close(linger=0)
        Path(self.ipc_endpoint.removeprefix("ipc://")).unlink(missing_ok=True)  # no stale socket left for clients
        if self.authenticator is not None:
            self.authenticator.stop()
