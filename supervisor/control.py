"""The local control socket: msgpack commands in, msgpack documents out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import structlog
import zmq

from protocol.codec import pack, unpack
from protocol.constants import CONTROL_SOCKET_NAME, ErrorCode
from protocol.errors import ProtocolError
from supervisor.anomalies import Anomalies

log = structlog.get_logger("supervisor")

Handler = Callable[[dict[str, Any]], dict[str, Any]]

#: Commands answered per loop turn: a flood of them must not hold the loop that routes requests.
_BATCH = 16


class ControlServer:
    """A ROUTER on ipc://RUNTIME_DIR/control.sock (0600), answered from the main loop."""

    def __init__(self, context: zmq.Context[Any], runtime_dir: Path, anomalies: Anomalies) -> None:
        self.anomalies = anomalies
        self.endpoint = f"ipc://{runtime_dir / CONTROL_SOCKET_NAME}"
        self.socket: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        self.socket.bind(self.endpoint)
        (runtime_dir / CONTROL_SOCKET_NAME).chmod(0o600)

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
                answer = handler(command)
            except ProtocolError as exc:
                answer = {"ok": False, "error": exc.message}
            except Exception as exc:  # a failing command must not stop the daemon
                log.exception("control_command_failed")
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                self.socket.send_multipart([frames[0], b"", pack(answer)], zmq.NOBLOCK)
            except zmq.ZMQError:
                self.anomalies.count("control_reply_undeliverable", "a control client left before its answer")

    def close(self) -> None:
        """Close the socket."""
        self.socket.close(linger=0)


class ControlError(Exception):
    """The daemon did not answer the control command."""


def control_request(runtime_dir: Path, command: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one command to a running daemon and return its answer."""
    path = runtime_dir / CONTROL_SOCKET_NAME
    if not path.exists():
        raise ControlError(
            f"no daemon control socket at {path} (is `infervisor serve` running with this --runtime-dir?)"
        )
    context: zmq.Context[Any] = zmq.Context.instance()
    socket: zmq.Socket[Any] = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"ipc://{path}")
        socket.send_multipart([b"", pack(command)])
        if not socket.poll(int(timeout * 1000)):
            raise ControlError(f"no answer from the daemon within {timeout:.1f} s")
        frames = socket.recv_multipart()
        # The answer comes from our own daemon over a 0600 socket and may exceed header limits.
        answer = msgpack.unpackb(frames[-1], raw=False)
        if not isinstance(answer, dict):
            raise ControlError("the daemon's answer is not a map")
        return answer
    finally:
        socket.close()


def model_status(runtime_dir: Path, model: str) -> dict[str, Any]:
    """The status entry of one served model; ControlError when the daemon or the model is not there."""
    models: dict[str, Any] = control_request(runtime_dir, {"cmd": "status"})["models"]
    if model not in models:
        raise ControlError(f"no model {model!r}; serving {sorted(models)}")
    entry: dict[str, Any] = models[model]
    return entry
