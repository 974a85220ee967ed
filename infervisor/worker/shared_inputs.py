"""Inputs a local client left in POSIX shared memory instead of frames: copied out with pread, never mapped."""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from infervisor.protocol.constants import SHM_DIR, ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.tensors import TensorDesc

#: First the name is only looked up (O_PATH: no open for reading, so a FIFO's blocked writer is not
#: released and a device is not opened) without following a link (O_NOFOLLOW: a link is then the
#: link itself, seen by fstat). Only an object that passes fstat's checks is opened for reading.
_LOOKUP_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: The read open of what the O_PATH descriptor names (through /proc, a link that must be followed).
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


class SharedInputs:
    """Copies inputs out of shared memory into one buffer per input name, reused once nothing else holds it."""

    def __init__(self, client_group: int | None = None) -> None:
        """`client_group`: a gid whose group-readable objects are read although another uid owns them.

        The one place a configured client group is accepted: config `socket_group`, the ipc socket's
        group (LaunchSpec.client_gid); None: only objects owned by the daemon's own uid are read.
        """
        self._buffers: dict[str, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        self.client_group = client_group

    def buffers_in_order(
        self, descs: Sequence[TensorDesc], frames: Sequence[Any], reader: Sequence[int] | None = None
    ) -> Sequence[Any]:
        """One buffer per descriptor, in order: its frame, or its bytes read out of shared memory.

        `frames` are those of the descriptors without `shm`, already counted against them (check_frames).
        `reader`: `[uid, gid, *groups]` of the requesting client; an object it could not read is refused.
        """
        if len(frames) == len(descs):
            return frames
        remaining = iter(frames)
        return [next(remaining) if desc.shm is None else self.read(desc, reader) for desc in descs]

    def read(self, desc: TensorDesc, reader: Sequence[int] | None = None) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The input's bytes in a private buffer, or INVALID_INPUT saying why they cannot be read."""
        buffer = self._buffers.get(desc.name)
        # Held only here (the dict, this name, getrefcount's argument): the last request's tensors, its
        # outputs (a model may return its input) and its reply's queued frames are all gone. A fresh
        # 600 KB buffer each time would fault its pages in again whenever malloc gives them back.
        if buffer is None or buffer.nbytes != desc.nbytes or sys.getrefcount(buffer) > 3:
            # numpy's buffer, not a bytearray: aligned, so the kernel copies ~40% faster (600 KB: 47 vs 85 us).
            buffer = np.empty(desc.nbytes, np.uint8)
            self._buffers[desc.name] = buffer
        read_shared(desc, buffer, self.client_group, reader)
        return buffer


def read_shared(
    desc: TensorDesc,
    into: np.ndarray[Any, np.dtype[np.uint8]],
    client_group: int | None = None,
    reader: Sequence[int] | None = None,
) -> None:
    """Copy the input's bytes into `into` (desc.nbytes long), or raise INVALID_INPUT saying why they cannot be read.

    `reader` is `[uid, gid, *groups]` of the client that named the object: the daemon reads it only
    when that client could read it itself (None: nobody is known to have asked, so nothing is read).

    Mapping the object would save this copy, but a client that shrinks a mapped object kills the
    reader with SIGBUS; a shrunk file only makes pread come up short, which is an error reply.
    """
    ref = desc.shm
    if ref is None:
        raise ValueError(f"input {desc.name!r} has no shared-memory reference")
    where = f"input {desc.name!r}: shared-memory object {ref.name!r}"
    try:
        found = os.open(os.path.join(SHM_DIR, ref.name), _LOOKUP_FLAGS)
    except OSError as exc:
        raise ProtocolError(ErrorCode.INVALID_INPUT, f"{where} {_why_not_opened(exc)}") from exc
    try:
        info = os.fstat(found)
        refusal = _refusal(info, client_group) or _reader_refusal(info, reader)
        if refusal is not None:
            raise ProtocolError(ErrorCode.INVALID_INPUT, f"{where} {refusal}")
        fd = _open_for_reading(found, where)
    finally:
        os.close(found)
    try:
        end = ref.offset + desc.nbytes
        if info.st_size < end:
            raise ProtocolError(
                ErrorCode.INVALID_INPUT,
                f"{where} is {info.st_size} bytes; {desc.dtype}{list(desc.shape)} at offset {ref.offset} needs {end}",
            )
        view = memoryview(into.data)
        done = 0
        while done < desc.nbytes:
            got = os.preadv(fd, [view[done:]], ref.offset + done)
            if got == 0:
                raise ProtocolError(ErrorCode.INVALID_INPUT, f"{where} shrank while it was read")
            done += got
    finally:
        os.close(fd)


def _refusal(info: os.stat_result, client_group: int | None) -> str | None:
    """Why the daemon must not read this object, or None when it may.

    A root daemon could read anything; so only what the object's owner meant for the daemon is
    read (and then only for a client that could read it itself, _reader_refusal): a regular file owned
    by the daemon's uid and readable by its owner, or one of the client group that the group may read.
    The mode bits are honoured even where the kernel would let the daemon override them.
    """
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    mode = f"mode {stat.S_IMODE(info.st_mode):04o}"
    uid = os.geteuid()
    if info.st_uid == uid:
        if info.st_mode & stat.S_IRUSR:
            return None
        return f"is not readable by the daemon's user (uid {uid}): {mode}"
    if client_group is not None and info.st_gid == client_group:
        if info.st_mode & stat.S_IRGRP:
            return None
        return f"is not readable by the client group (gid {client_group}): {mode}"
    refusal = f"belongs to uid {info.st_uid}, not to the daemon's user (uid {uid})"
    return refusal if client_group is None else f"{refusal}, nor to the client group (gid {client_group})"


def _reader_refusal(info: os.stat_result, reader: Sequence[int] | None) -> str | None:
    """Why the client that named this object could not read it itself, or None when it could.

    The kernel's own rule on the mode bits: the owner's bits if the client is the owner, else the
    group's if it is in the object's group, else the others'. A root client gets no override here:
    what it means the daemon to read, it makes readable by mode.
    """
    if not reader:
        return "cannot be read for a client whose credentials are unknown"
    uid, groups = reader[0], reader[1:]
    if info.st_uid == uid:
        allowed = bool(info.st_mode & stat.S_IRUSR)
    elif info.st_gid in groups:
        allowed = bool(info.st_mode & stat.S_IRGRP)
    else:
        allowed = bool(info.st_mode & stat.S_IROTH)
    if allowed:
        return None
    return (
        f"is not readable by the client that named it (uid {uid}, groups {list(groups)}): owner uid {info.st_uid}, "
        f"group gid {info.st_gid}, mode {stat.S_IMODE(info.st_mode):04o}"
    )


def _open_for_reading(found: int, where: str) -> int:
    """A read descriptor of the inode the O_PATH descriptor `found` names, whatever the name is by now."""
    try:
        # /proc/self/fd/N reaches the looked-up inode itself: a name swapped for a FIFO since is not opened.
        return os.open(f"/proc/self/fd/{found}", _READ_FLAGS)
    except OSError as exc:
        raise ProtocolError(ErrorCode.INVALID_INPUT, f"{where} {_why_not_opened(exc)}") from exc


def _why_not_opened(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "does not exist"
    if exc.errno == errno.ELOOP:
        return "is a symbolic link"
    if exc.errno == errno.EACCES:
        return f"is not readable by the daemon's user (uid {os.geteuid()})"
    return f"cannot be opened: {exc.strerror}"
