"""Who sent a message: the uid and groups a worker checks a shared-memory object against, and who owns a stream.

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
    ids = _peer_ids(frame)
    return None if ids is None else list(_groups_of(*ids))


def peer_owner(frame: Any, from_ipc: bool, routing_id: bytes) -> str:
    """Who a stream started by this message belongs to: the sender's uid on ipc, its CURVE key on tcp.

    Both come from below the client's reach (the kernel's SO_PEERCRED; the ZAP handler's User-Id, the z85 of
    the key the CURVE handshake proved). Without either (tcp without CURVE, a libzmq without the property),
    the owner is the connection alone, as its routing id names it.
    """
    if from_ipc:
        ids = _peer_ids(frame)
        if ids is not None:
            return f"uid {ids[0]}"
    else:
        try:
            user: str = frame.get("User-Id")
        except Exception:  # noqa: BLE001 - no ZAP handler on this socket: no User-Id
            user = ""
        if user:
            return f"curve key {user}"
    return f"{'ipc' if from_ipc else 'tcp'} connection {routing_id.hex()}"


def _peer_ids(frame: Any) -> tuple[int, int] | None:
    """`(uid, gid)` of the process that sent `frame` over ipc, from libzmq's Peer-Address; None when it gave none."""
    try:
        address: str = frame.get("Peer-Address")
    except Exception:  # noqa: BLE001 - a libzmq without the property (or a non-Frame) means no credentials
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1]), int(parts[2])


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
