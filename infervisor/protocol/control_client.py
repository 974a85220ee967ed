"""The control socket's client: one msgpack command to a running daemon, its answer, and why there is none.

What the CLI, the toolkit, the bench scripts and the tests use to talk to a daemon over control.sock (or
status.sock, for the read-only commands, when the daemon has one); the daemon's side is
infervisor/supervisor/core/control.py. It needs nothing of the daemon, so every layer above the protocol may use it.
"""

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
import zmq

from infervisor.protocol.codec import pack
from infervisor.protocol.constants import CONTROL_SOCKET_NAME, STATUS_SOCKET_COMMANDS, STATUS_SOCKET_NAME

Found = TypeVar("Found")


def user_name(uid: int) -> str:
    """The name of `uid`, or the `'#UID'` sudo -u takes when it has none."""
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
        owner = user_name(os.stat(path).st_uid)
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
    if command.get("cmd") in STATUS_SOCKET_COMMANDS:
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
