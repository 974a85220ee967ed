"""Config `socket_group`: the group whose members may use the client sockets, and handing files to it."""

from __future__ import annotations

import contextlib
import grp
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

#: The highest gid: (gid_t)-1 means "unchanged" to chown(2), so it cannot name a group.
MAX_GID = 2**32 - 2


class SocketGroupError(Exception):
    """The configured group does not exist, or the daemon cannot give its files to it."""


@dataclass(frozen=True)
class SocketGroup:
    """A group looked up once when the config is read: its gid, and its name for messages."""

    gid: int
    #: The name in the group database; None for a numeric gid that has none (a pod's supplementalGroups).
    name: str | None

    def __str__(self) -> str:
        return f"group {self.name} (gid {self.gid})" if self.name is not None else f"gid {self.gid}"


def lookup_group(value: str | int) -> SocketGroup:
    """A group name that must exist in the group database, or a numeric gid used as it is."""
    if isinstance(value, int):
        if not 0 <= value <= MAX_GID:
            raise SocketGroupError(f"gid {value} is out of range 0..{MAX_GID}")
        try:
            return SocketGroup(value, grp.getgrgid(value).gr_name)
        except KeyError:
            return SocketGroup(value, None)  # a gid without a name is still a group the kernel checks
    try:
        return SocketGroup(grp.getgrnam(value).gr_gid, value)
    except KeyError:
        raise SocketGroupError(
            f"no group named {value!r} on this box; create it (groupadd --system {value}, or with "
            "systemd/infervisor.sysusers) or give a numeric gid"
        ) from None


def check_may_use(group: SocketGroup) -> None:
    """Refuse a group the daemon's user cannot give files to: chown(2) allows only root or a member."""
    if os.geteuid() == 0 or group.gid == os.getegid() or group.gid in os.getgroups():
        return
    raise SocketGroupError(_not_a_member(group))


def give_to_group(path: Path, group: SocketGroup, mode: int) -> None:
    """Make `path` belong to the group with `mode`: the group first, so the mode never opens it to another one."""
    try:
        os.chown(path, -1, group.gid, follow_symlinks=False)
    except PermissionError:
        raise SocketGroupError(f"cannot give {path} to it: {_not_a_member(group)}") from None
    os.chmod(path, mode)


@contextlib.contextmanager
def owner_only_umask() -> Iterator[None]:
    """Files created inside (a socket a bind makes) start 0600: none is open to anyone before it gets its mode.

    The umask is the process's, not the thread's; the daemon binds its sockets at start, before its
    other threads (file watcher, CURVE authenticator) exist or create files.
    """
    previous = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(previous)


def _not_a_member(group: SocketGroup) -> str:
    user = f"the daemon's user (uid {os.geteuid()})"
    join = f"usermod -aG {group.name} USER" if group.name is not None else "the pod's supplementalGroups"
    return (
        f"{user} is not a member of {group} and not root, so it may not give files to it; add the user to "
        f"the group ({join}; under systemd, systemd/infervisor.sysusers does) and start the daemon again"
    )


def bind_ipc(socket: zmq.Socket[Any], path: Path, group: SocketGroup | None) -> None:
    """Bind `socket` at `path`, then make the file 0600, or 0660 in `group`, before anyone may connect to it."""
    with owner_only_umask():
        socket.bind(f"ipc://{path}")
    if group is None:
        os.chmod(path, 0o600)
        return
    try:
        give_to_group(path, group, 0o660)
    except SocketGroupError:
        path.unlink(missing_ok=True)  # the daemon does not start: leave no socket a client would wait on
        raise
