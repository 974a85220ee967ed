"""Who sent a message on the ipc endpoint: the uid and groups a worker checks a shared-memory object against.

libzmq reads SO_PEERCRED when it accepts an ipc connection and appends `:UID:GID:PID` to the
connection's "Peer-Address" message property (stream_engine_base.cpp). The credentials are the
connecting process's at connect() time, given by the kernel: a client cannot forge them. The
supplementary groups are the group database's for that uid (what login and systemd give it).
"""

from __future__ import annotations

import os
import pwd
import time
from typing import Any

#: Distinct (uid, gid) pairs whose group lists are kept: a handful of local users, bounded anyway.
_CACHED_USERS = 256
#: How long a group list is trusted: a user taken out of a group loses its objects within this.
_GROUPS_TTL_S = 30.0
_groups: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}


def peer_reader(frame: Any) -> list[int] | None:
    """`[uid, gid, *supplementary gids]` of the process that sent `frame` over ipc; None when libzmq gave none."""
    try:
        address: str = frame.get("Peer-Address")
    except Exception:  # noqa: BLE001 - a libzmq without the property (or a non-Frame) means no credentials
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return list(_groups_of(int(parts[1]), int(parts[2])))


def _groups_of(uid: int, gid: int) -> tuple[int, ...]:
    """The uid, its primary gid, then the other groups the database gives it (none without a passwd entry)."""
    now = time.monotonic()
    cached = _groups.get((uid, gid))
    if cached is not None and now - cached[0] < _GROUPS_TTL_S:
        return cached[1]
    try:
        name = pwd.getpwuid(uid).pw_name
        others = [g for g in os.getgrouplist(name, gid) if g != gid]
    except (KeyError, OSError):
        others = []
    if len(_groups) >= _CACHED_USERS:
        _groups.clear()
    found = (uid, gid, *sorted(set(others)))
    _groups[(uid, gid)] = (now, found)
    return found
