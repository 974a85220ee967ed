"""CURVE key files checked when config.json is read: a bad one is a config problem (exit 78 at start, a refused
reload), never a daemon that starts and locks every tcp client out, nor a traceback.

A key file is ZeroMQ's certificate format (what `zmq.auth.create_certificates` writes): `public-key = "..."`
and, in the server's file, `secret-key = "..."`, each a 40-character Z85 text. Each file, and the folders
above it, must pass the strict modes; the server's file, which holds its secret key, must also be readable by its
owner alone, as sshd wants its host keys (anyone who reads it can pose as the daemon to every CURVE client).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from infervisor.common.strict_modes import UnsafePath, folders_problem, read_small_file, strict_modes_on

#: A CURVE key in Z85: 32 bytes as 40 characters.
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
#: How many client keys the authorized_clients folder may hold (each is read at start and on every reload).
MAX_CLIENT_KEYS = 10_000


def _keys_in(text: str) -> dict[str, str]:
    """`public-key` and `secret-key` of a certificate's text, as pyzmq's load_certificate reads them."""
    found: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        for name in ("public-key", "secret-key"):
            if line.startswith(name) and "=" in line and name not in found:
                found[name] = line.split("=", 1)[1].strip(" \t'\"")
    return found


def _exposed_secret(path: Path) -> str | None:
    """Why a secret key file is readable by more than its owner (its group's or others' read bit), or None."""
    if not strict_modes_on():
        return None
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as exc:
        return f"cannot read key file {path}: {exc.strerror}"
    if not mode & 0o044:
        return None
    who = "group and others" if mode & 0o044 == 0o044 else "its group" if mode & 0o040 else "others"
    return f"secret key file {path} is readable by {who} (mode {mode:04o}): make it 0600 or 0400, the daemon's own"


def key_file_problems(path: Path, needs_secret: bool) -> list[str]:
    """What is wrong with one key file: unsafe, unreadable, or missing a key it must hold ([] when it is fine)."""
    try:
        text = read_small_file(path, "key file", limit=64 * 1024).decode("utf-8", "replace")
    except UnsafePath as exc:
        return [str(exc)]
    if needs_secret and (exposed := _exposed_secret(path)) is not None:
        return [exposed]
    keys = _keys_in(text)
    wanted = ("public-key", "secret-key") if needs_secret else ("public-key",)
    problems = []
    for name in wanted:
        if name not in keys:
            problems.append(f"{path} has no {name} line")
        elif not _Z85_KEY.fullmatch(keys[name]):
            problems.append(f"{path}: its {name} is not a 40-character Z85 key")
    return problems


def curve_problems(server_secret_key: Path, authorized_clients: Path) -> list[str]:
    """Every problem of the server's key file and of the authorized clients' folder and its `*.key` files."""
    problems = key_file_problems(server_secret_key, needs_secret=True)
    unsafe = folders_problem(authorized_clients)
    if unsafe is not None:
        return [*problems, f"authorized_clients refused: {unsafe}"]
    clients = sorted(authorized_clients.glob("*.key"))
    if len(clients) > MAX_CLIENT_KEYS:
        return [*problems, f"{authorized_clients} holds {len(clients)} keys, over {MAX_CLIENT_KEYS}"]
    for client in clients:
        problems += key_file_problems(client, needs_secret=False)
    if not clients:
        problems.append(f"{authorized_clients} holds no *.key file: no tcp client could connect")
    return problems
