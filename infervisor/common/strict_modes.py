"""Strict modes, as sshd's StrictModes and sudo apply them: what the daemon loads must be out of other users' reach.

A file the daemon reads code, config, packages or keys from, and every folder above it, must be owned by
the daemon's uid or root and writable by neither group nor others. One exception, for the folders above
the one that holds the file only: a sticky folder (`/tmp`, mode 1777) owned by root or us, because there
nobody may rename or remove an entry they do not own, so the next folder down (owned by us or root, and
checked in turn) cannot be swapped. The folder that holds the file gets no such exception: in it another
user could add a name (a package that shadows a module, a package named like a cache key).

A read-only mount is no pass by itself: a bind mount's `ST_RDONLY` says nothing of its source, which others may
write through another path, and the source cannot be found, let alone checked, from inside a mount namespace (a
container). Mode bits are waived only below a read-only mount point the operator names in
`INFERVISOR_TRUSTED_MOUNTS` (a Kubernetes ConfigMap volume: 0777 folders, its source under the kubelet's
root-only folders), and never the owner.

`INFERVISOR_STRICT_MODES=off` turns the checks off, for development on a shared checkout only; the
supervisor passes its environment to the workers, so both sides then agree.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from importlib.machinery import ModuleSpec
from pathlib import Path

#: The environment variable that turns the strict modes off ("off", "0", "no" or "false").
STRICT_ENV = "INFERVISOR_STRICT_MODES"
_OFF = frozenset({"off", "0", "no", "false"})
#: Read-only mount points whose source the operator vouches for (`:`-separated): their mode bits are waived.
TRUSTED_MOUNTS_ENV = "INFERVISOR_TRUSTED_MOUNTS"
#: The largest config or key file read (a config past it is refused, not read): 1 MB.
MAX_CONFIG_BYTES = 1 << 20


class UnsafePath(Exception):
    """A path another user could write, or a file that is not what it must be; the message says which and why."""


def strict_modes_on() -> bool:
    """False only when INFERVISOR_STRICT_MODES says off."""
    return os.environ.get(STRICT_ENV, "").strip().lower() not in _OFF


def _trusted_uids() -> tuple[int, int]:
    return (os.geteuid(), 0)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _vouched_mount(path: Path) -> bool:
    """Whether `path` is on a read-only mount, at or below a mount point named in INFERVISOR_TRUSTED_MOUNTS that
    is itself a read-only mount point (a name that is not one vouches for nothing)."""
    for entry in os.environ.get(TRUSTED_MOUNTS_ENV, "").split(":"):
        if not entry.strip():
            continue
        mount = Path(os.path.realpath(entry.strip()))
        if (path == mount or mount in path.parents) and _is_mount_point(mount) and _read_only(mount):
            return _read_only(path)
    return False


def _is_mount_point(path: Path) -> bool:
    """Whether `path` is a mount point in this mount namespace (/proc/self/mountinfo: a bind mount within one file
    system has the same st_dev as its parent, so `os.path.ismount` misses it)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return False
    wanted = str(path)
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4 and _unescape(fields[4]) == wanted:
            return True
    return False


def _unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (`\\040` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _owner_problem(path: Path, info: os.stat_result, what: str) -> str | None:
    """Why `info` (of `path`) is not ours to trust, or None."""
    if info.st_uid not in _trusted_uids():
        return f"{what} {path} is owned by uid {info.st_uid}, not by the daemon's uid {os.geteuid()} or root"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not _vouched_mount(path):
        who = "group and others" if mode & 0o022 == 0o022 else "its group" if mode & 0o020 else "others"
        return f"{what} {path} is writable by {who} (mode {mode:04o})"
    return None


def _folder_problem(folder: Path, holder: bool) -> str | None:
    """Why one folder on the way to a file is unsafe; `holder` is the folder the file is in (no sticky exception)."""
    try:
        info = os.lstat(folder)
    except OSError as exc:
        return f"folder {folder} cannot be checked: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder"
    if info.st_uid not in _trusted_uids():
        return f"folder {folder} is owned by uid {info.st_uid}, not by the daemon's uid {os.geteuid()} or root"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and (holder or not mode & stat.S_ISVTX) and not _vouched_mount(folder):
        return _owner_problem(folder, info, "folder")
    return None


def folders_problem(folder: Path) -> str | None:
    """Why `folder` (the one holding what is loaded) or any folder above it is unsafe, or None."""
    if not strict_modes_on():
        return None
    folder = Path(os.path.realpath(folder))
    holder = True
    for each in (folder, *folder.parents):
        problem = _folder_problem(each, holder)
        if problem is not None:
            return problem
        holder = False
    return None


def check_file(path: Path, what: str = "file") -> os.stat_result:
    """The file's lstat when it (a symlink followed: its target, and the link's own folder) and its folders are
    safe to load from; UnsafePath saying why not. Only regular files pass."""
    path = Path(os.path.abspath(path))
    try:
        link = os.lstat(path)
    except OSError as exc:
        raise UnsafePath(f"cannot read {what} {path}: {exc.strerror}") from exc
    if not strict_modes_on():
        return link
    if stat.S_ISLNK(link.st_mode):
        # The link lives in one folder (someone there could repoint it), the file in another: both must be safe.
        problem = folders_problem(path.parent)
        if problem is not None:
            raise UnsafePath(f"{what} {path} is a symbolic link in an unsafe place: {problem}")
        path = Path(os.path.realpath(path))
        try:
            link = os.lstat(path)
        except OSError as exc:
            raise UnsafePath(f"cannot read {what} {path}: {exc.strerror}") from exc
    check_stat(path, link, what)
    problem = folders_problem(path.parent)
    if problem is not None:
        raise UnsafePath(f"{what} {path} is in an unsafe place: {problem}")
    return link


def check_stat(path: Path, info: os.stat_result, what: str = "file") -> None:
    """UnsafePath unless `info` is a regular file owned by us or root that group and others cannot write."""
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePath(f"{what} {path} is {describe_kind(info.st_mode)}, not a regular file")
    if strict_modes_on():
        problem = _owner_problem(path, info, what)
        if problem is not None:
            raise UnsafePath(problem)


def check_tree(root: Path, what: str = "folder") -> None:
    """UnsafePath unless `root`, the folders above it and everything below it are safe to load from.

    Nothing below may be a symbolic link (it could lead out of the tree) or anything but files and folders.
    A root that does not exist yet is checked through the nearest folder above it that does (it will be made
    there, owned by us).
    """
    if not strict_modes_on():
        return
    root = Path(os.path.abspath(root))
    if not os.path.lexists(root):
        existing = root.parent
        while not os.path.lexists(existing) and existing.parent != existing:
            existing = existing.parent
        problem = folders_problem(existing)  # where it will be made: nothing of it to walk yet
        if problem is not None:
            raise UnsafePath(f"{what} refused: {problem}")
        return
    problem = folders_problem(root)
    if problem is not None:
        raise UnsafePath(f"{what} refused: {problem}")
    for folder, folders, files in os.walk(root, followlinks=False):
        for name in (*folders, *files):
            path = Path(folder) / name
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # removed meanwhile (a sibling's temp file)
            except OSError as exc:
                raise UnsafePath(f"{what} refused: {path} cannot be checked: {exc.strerror}") from exc
            if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
                raise UnsafePath(f"{what} refused: {path} is {describe_kind(info.st_mode)}")
            problem = _owner_problem(path, info, "folder" if stat.S_ISDIR(info.st_mode) else "file")
            if problem is not None:
                raise UnsafePath(f"{what} refused: {problem}")


def read_small_file(path: Path, what: str = "file", limit: int = MAX_CONFIG_BYTES, follow: bool = True) -> bytes:
    """The bytes of a small regular file, read without ever blocking: UnsafePath for anything else.

    Opened non-blocking (a FIFO or a device returns at once and is refused by its fstat), checked by the
    descriptor it was opened as (so what was checked is what is read), refused past `limit` bytes before
    a byte is read. With `follow`, a symbolic link is followed once its own folder and its target are checked.
    """
    checked = check_file(path, what) if follow else None
    target = Path(os.path.realpath(path)) if follow else Path(os.path.abspath(path))
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        handle = os.open(target, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{what} {target} is a symbolic link (not followed here)") from exc
        raise UnsafePath(f"cannot read {what} {target}: {exc.strerror}") from exc
    try:
        info = os.fstat(handle)
        check_stat(target, info, what)
        if checked is not None and (info.st_dev, info.st_ino) != (checked.st_dev, checked.st_ino) and strict_modes_on():
            raise UnsafePath(f"{what} {target} changed while it was checked")
        if info.st_size > limit:
            raise UnsafePath(f"{what} {target} is {info.st_size:,} bytes, over the {limit:,}-byte limit")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(handle, 1 << 16):
            size += len(chunk)
            if size > limit:  # it grew while being read
                raise UnsafePath(f"{what} {target} grew past the {limit:,}-byte limit while it was read")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(handle)


def describe_kind(mode: int) -> str:
    """`a FIFO`, `a symbolic link`, ... for a file's mode."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a device or other special file"


def spec_problem(spec: ModuleSpec) -> str | None:
    """Why the file a module (or a package's `__init__`) would run from, or a folder it is looked up in, is out of
    the daemon's hands (another user owns it or may write it, or a folder above it), or None."""
    try:
        if spec.has_location and spec.origin and os.path.isfile(spec.origin):
            check_file(Path(spec.origin), "module file")
        for folder in spec.submodule_search_locations or ():
            problem = folders_problem(Path(folder))
            if problem is not None:
                return f"refused {spec.name!r}: {problem}"
    except UnsafePath as exc:
        return f"refused {spec.name!r}: {exc}"
    return None
