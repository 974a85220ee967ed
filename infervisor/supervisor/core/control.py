"""The local control socket: msgpack commands in, msgpack documents out."""

from __future__ import annotations

import errno
import os
import pwd
import socket as unix_socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import structlog
import zmq

from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import CONTROL_SOCKET_NAME, STATUS_SOCKET_NAME, ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.supervisor.core.control_commands import read_only_commands
from infervisor.supervisor.host.socket_group import SocketGroup, bind_ipc
from infervisor.supervisor.instruments.anomalies import Anomalies

log = structlog.get_logger("supervisor")

Handler = Callable[[dict[str, Any]], dict[str, Any]]
Found = TypeVar("Found")

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
        user = _user_name(os.geteuid())
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


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"'#{uid}'"  # sudo -u takes #UID for a uid without a name


class ControlError(Exception):
    """The daemon did not answer the control command."""


class NotRunning(ControlError):
    """No daemon serves the runtime dir: its socket is missing, or left behind with nobody listening on it."""


def check_listening(path: Path) -> None:
    """Raise NotRunning unless something listens on the unix socket at `path`; a connect() tells at once.

    A daemon killed with -9 leaves its socket files behind, and ZeroMQ would retry connecting to
    them silently until the caller's timeout; the kernel refuses a connect() on them at once.
    """
    where = f"infervisor is not running on {path.parent}"
    probe = unix_socket.socket(unix_socket.AF_UNIX, unix_socket.SOCK_STREAM | unix_socket.SOCK_CLOEXEC)
    try:
        # Non-blocking: a listener whose backlog is full (EAGAIN) is busy, not gone.
        probe.setblocking(False)
        code = probe.connect_ex(str(path))
    finally:
        probe.close()
    if code in (errno.ENOENT, errno.ENOTDIR):
        raise NotRunning(
            f"{where}: no daemon control socket at {path} (is `infervisor serve` running with this --runtime-dir?)"
        )
    if code == errno.ECONNREFUSED:
        raise NotRunning(f"{where}: {path.name} is left from a daemon that is gone (connection refused)")
    if code == errno.EACCES:
        raise ControlError(permission_denied(path))
    if code not in (0, errno.EAGAIN, errno.EINPROGRESS):
        raise ControlError(f"cannot reach the daemon at {path}: {os.strerror(code)}")


def permission_denied(path: Path) -> str:
    """What a user the kernel refused at `path` can do about it (one line)."""
    try:
        owner = _user_name(os.stat(path).st_uid)
    except OSError:  # the runtime dir itself refused us: neither its user nor in its group
        return (
            f"permission denied on {path}: {path.parent} admits only the daemon's user and, when its config sets "
            "`socket_group`, that group's members (docs/deploy.md: The user and the groups)"
        )
    if path.name == CONTROL_SOCKET_NAME:
        return (
            f"permission denied on {path}: operator commands (restart, reload, profile) are for the daemon's "
            f"user; run them as {owner} (sudo -u {owner} infervisor ...) or as root"
        )
    return f"permission denied on {path}: it admits the daemon's user {owner} and its socket_group's members"


def control_socket(runtime_dir: Path, command: dict[str, Any]) -> Path:
    """control.sock, or status.sock for a read-only command when the daemon has one (a socket_group's one)."""
    if command.get("cmd") in read_only_commands():
        status = runtime_dir / STATUS_SOCKET_NAME
        # lexists: False, not an error, when the runtime dir does not let us look inside.
        if os.path.lexists(status):
            return status
    return runtime_dir / CONTROL_SOCKET_NAME


def control_request(runtime_dir: Path, command: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """Send one command to a running daemon and return its answer; NotRunning at once when none is there."""
    path = control_socket(runtime_dir, command)
    check_listening(path)
    context: zmq.Context[Any] = zmq.Context.instance()
    socket: zmq.Socket[Any] = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(f"ipc://{path}")
        socket.send_multipart([b"", pack(command)])
        if not socket.poll(int(timeout * 1000)):
            raise ControlError(f"no answer from the daemon within {timeout:.1f} s")
        frames = socket.recv_multipart()
        # The answer comes from the daemon over a socket only it can bind here, and may exceed header limits.
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


class DaemonNotReady(ControlError):
    """A daemon this process started exited, or did not reach the awaited state in time."""


def await_status(
    process: subprocess.Popen[bytes],
    runtime_dir: Path,
    found: Callable[[dict[str, Any]], Found | None],
    timeout: float,
    awaited: str,
) -> Found:
    """Poll the status of a daemon this process started until `found` returns something, and return that.

    DaemonNotReady when the daemon exits first or `timeout` seconds pass (`awaited` says what was waited for).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DaemonNotReady(f"the daemon exited with {process.returncode}")
        try:
            result = found(control_request(runtime_dir, {"cmd": "status"}, timeout=2.0))
        except ControlError:  # not listening yet, or busy starting
            result = None
        if result is not None:
            return result
        time.sleep(0.05)
    raise DaemonNotReady(f"{awaited} within {timeout:.0f} s")
