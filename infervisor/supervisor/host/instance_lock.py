"""One daemon per runtime dir: an exclusive flock on RUNTIME_DIR/infervisor.lock, held for the daemon's life."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

from infervisor.common.processes import pid_alive

#: The lock file's name in the runtime dir; while locked it holds the pid of the daemon that locked it.
LOCK_NAME = "infervisor.lock"

#: How long a refused daemon waits for the holder to write its pid (it locks first, then writes).
_PID_WAIT_S = 1.0


class InstanceLockError(Exception):
    """Another daemon holds the runtime dir, or its lock file cannot be used."""

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class InstanceLock:
    """The runtime dir's lock, taken before any socket is bound or worker spawned.

    The kernel drops a flock when its last descriptor closes, so a daemon killed with -9 leaves no
    stale lock behind. The descriptor is close-on-exec (and workers are started with close_fds), so
    no worker holds the lock after its supervisor is gone. The file is never unlinked: unlinking a
    lock file lets a third daemon lock a fresh inode while a second still holds the old one.
    """

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / LOCK_NAME
        try:
            # O_NOFOLLOW: the runtime dir is ours (0700, or 0750 with a socket_group: its members may only look),
            # but a link planted there must not redirect our write. 0600: nobody else needs to read the pid.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise InstanceLockError(f"cannot open the lock file {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            holder = _holder_pid(fd) if busy else None
            os.close(fd)
            if not busy:
                raise InstanceLockError(f"cannot lock {self.path}: {exc.strerror}") from exc
            who = f"pid {holder}" if holder is not None else "pid unknown"
            raise InstanceLockError(
                f"another infervisor ({who}) is serving {runtime_dir}: it holds {self.path}; "
                "stop it first, or give this one another --runtime-dir",
                holder,
            ) from exc
        self._fd: int | None = fd
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)  # one made by hand, or by an older daemon: the socket group may list it, not read it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Let go of the lock (closing the descriptor drops it); a second call does nothing."""
        if self._fd is None:
            return
        try:
            # Emptied while still held, so a pid found in the file is (nearly always) a live holder's.
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # the lock is dropped below all the same, and the next holder overwrites the pid
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def _holder_pid(fd: int) -> int | None:
    """The pid the holder wrote, waiting briefly for it: the holder writes it just after it locks."""
    deadline = time.monotonic() + _PID_WAIT_S
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        # A dead pid is one a daemon killed with -9 left behind, before the new holder overwrote it.
        if text.isdigit() and pid_alive(int(text)):
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
