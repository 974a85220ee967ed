"""Shared-memory inputs for clients on the daemon's own box: a region this process creates and the tensors in it."""

from __future__ import annotations

import errno
import grp
import math
import mmap
import os
import secrets
import stat
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from infervisor.protocol.arrays import wire_dtype
from infervisor.protocol.constants import MAX_SHM_OFFSET, SHM_DIR, SHM_NAME_PATTERN
from infervisor.protocol.tensors import ShmRef, TensorDesc

#: Where `SharedRegion.tensor` places each next tensor: a cache line, so no two share one.
_ALIGNMENT = 64


@dataclass(frozen=True, slots=True)
class SharedTensor:
    """An input tensor in a `SharedRegion`: write `array`, pass this to `Client.infer`, and wait for the reply."""

    region: str
    offset: int
    array: np.ndarray[Any, Any]

    def desc(self, name: str) -> TensorDesc:
        """The descriptor that sends this tensor as input `name`."""
        wire = wire_dtype(self.array.dtype)
        if wire is None:  # SharedRegion.tensor only makes wire dtypes; this guards hand-made ones
            raise ValueError(f"dtype {self.array.dtype} is not supported on the wire")
        return TensorDesc(name, wire, tuple(int(d) for d in self.array.shape), ShmRef(self.region, self.offset))


def _gid(group: int | str) -> int:
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r}") from None


def _give_to(fd: int, gid: int, group: int | str) -> None:
    try:
        os.fchown(fd, -1, gid)
    except PermissionError as exc:
        raise PermissionError(
            exc.errno, f"cannot give the shared-memory object to group {group!r}: this process is not in it"
        ) from exc


def _unlink_if_creator(path: str, creator: int) -> None:
    """Unlink a region's object left open at exit or garbage collection, in the process that made it only.

    A forked child inherits the region object: its exit must not take the parent's object away.
    """
    if os.getpid() != creator:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the object's pages now: growing a tmpfs file reserves nothing, and a write to a page
    that /dev/shm has no room for later kills the process with SIGBUS instead of raising."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        free = os.statvfs(os.path.dirname(path))
        raise OSError(
            errno.ENOSPC,
            f"no space left on device for a {size}-byte shared-memory region at {path}: "
            f"{os.path.dirname(path)} has {free.f_bavail * free.f_frsize} bytes free (close other regions, "
            "or grow the tmpfs)",
        ) from exc


class SharedRegion:
    """A POSIX shared-memory object (`/dev/shm/NAME`) that inputs are written into instead of sent as frames.

    The daemon's worker copies a tensor out of the region once, instead of it crossing two sockets:
    for a 600 KB image that removes two of the round trip's three copies of the input. The region
    is only read while a request that names it is in flight: do not write a tensor again until its
    reply (or error) is back. The daemon reads an object of its own user (`mode` 0600 will do), or
    one of its config `socket_group` that the group may read: a client of another user passes
    `group` (the group of the daemon's infer.sock) and gets 0640. Closing unlinks it, and so does a
    normal interpreter exit or the collection of the last array viewing it (a finalizer); a process
    killed before then leaves it in /dev/shm, named after its pid. Its pages are reserved when it
    is made: a /dev/shm without room raises OSError (ENOSPC) here, not SIGBUS at a later write.
    """

    def __init__(
        self, size: int, name: str | None = None, mode: int | None = None, group: int | str | None = None
    ) -> None:
        """Create the object, `size` bytes; `name` defaults to a fresh `infervisor-PID-RANDOM`.

        `group` (a gid or a group name this process is a member of) is given the object before
        `mode` (default 0600, or 0640 with a group) applies: it is never open to another group.
        """
        if not 0 < size <= MAX_SHM_OFFSET:
            raise ValueError(f"size must be 1..{MAX_SHM_OFFSET} bytes")
        self.name = name if name is not None else f"infervisor-{os.getpid()}-{secrets.token_hex(6)}"
        if SHM_NAME_PATTERN.fullmatch(self.name) is None:
            raise ValueError(f"shared-memory name {self.name!r} must match {SHM_NAME_PATTERN.pattern}")
        gid = None if group is None else _gid(group)
        mode = (0o600 if gid is None else 0o640) if mode is None else mode
        if gid is not None and not mode & stat.S_IRGRP:
            raise ValueError(f"mode {mode:04o} does not let group {group!r} read the object: the daemon reads it so")
        self.size = size
        self._path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if group is not None and gid is not None:
                _give_to(fd, gid, group)
            os.fchmod(fd, mode)  # the umask must not narrow what the caller chose for the daemon's user
            _reserve(fd, size, self._path)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self._end = 0
        # Never closed: the object goes at a normal exit (atexit), or once nothing can write into it any
        # more (the mapping collected: the region and every array viewing it gone), not while a tensor
        # made from it is still being written and sent.
        self._finalizer = weakref.finalize(self._map, _unlink_if_creator, self._path, os.getpid())

    def tensor(self, dtype: Any, shape: tuple[int, ...], offset: int | None = None) -> SharedTensor:
        """A tensor at `offset` (default: after the last one made, 64-byte aligned) whose array views the region."""
        if self._map is None:
            raise ValueError(f"shared-memory region {self.name!r} is closed")
        dtype = np.dtype(dtype)
        if wire_dtype(dtype) is None:
            raise ValueError(f"dtype {dtype} is not supported on the wire")
        dtype = dtype.newbyteorder("<")
        start = -(-self._end // _ALIGNMENT) * _ALIGNMENT if offset is None else offset
        nbytes = math.prod(shape) * dtype.itemsize
        if start < 0 or start + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at offset {start} do not fit the region's {self.size}")
        self._end = max(self._end, start + nbytes)
        array = np.frombuffer(self._map, dtype, math.prod(shape), start).reshape(shape)
        return SharedTensor(self.name, start, array)

    def close(self) -> None:
        """Unlink the object; the mapping goes when the last array viewing it does."""
        if self._map is None:
            return
        mapping, self._map = self._map, None
        self._finalizer.detach()
        os.unlink(self._path)
        try:
            mapping.close()
        except BufferError:
            pass  # arrays still view it: the mapping is freed with the last of them

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
