"""Where the sockets live: a runtime directory chosen like a systemd service would, 0700 (0750 with a socket_group)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from infervisor.common.strict_modes import describe_kind
from infervisor.supervisor.host.socket_group import SocketGroup, check_may_use, give_to_group

#: The runtime dir's mode with a socket_group: its members may look up the sockets, but create nothing there.
GROUP_DIR_MODE = 0o750


class RuntimeDirError(Exception):
    """The runtime directory cannot be made private."""


def default_runtime_dir() -> Path:
    """$RUNTIME_DIRECTORY, else /run/infervisor, else $XDG_RUNTIME_DIR/infervisor, else /tmp/infervisor-UID."""
    from_systemd = os.environ.get("RUNTIME_DIRECTORY")
    if from_systemd:
        # systemd may pass several colon-separated directories; the first is ours.
        return Path(from_systemd.split(":")[0])
    run = Path("/run")
    if os.access(run / "infervisor", os.W_OK) or (not (run / "infervisor").exists() and os.access(run, os.W_OK)):
        return run / "infervisor"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "infervisor"
    return Path("/tmp") / f"infervisor-{os.getuid()}"


def prepare_runtime_dir(path: Path, group: SocketGroup | None = None) -> Path:
    """Create the directory 0700, or check an existing one is ours and that nobody else may write in it.

    Its final mode is set by `restrict_runtime_dir` once the daemon holds its lock: a second daemon,
    refused by the lock, must not change the directory the first one serves from.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except FileExistsError:
        info = path.lstat()  # something else has the name: said below
    except OSError as exc:  # a parent that is a file, no permission, a read-only file system
        raise RuntimeDirError(f"cannot create runtime dir {path}: {exc.strerror}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is {describe_kind(info.st_mode)}, not a directory")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"{path} belongs to uid {info.st_uid}, not to us (uid {os.getuid()})")
    if info.st_mode & 0o022:
        # Others could swap the lock file before we hold it: closed before anything is created in it.
        os.chmod(path, 0o700)
    if group is not None:
        check_may_use(group)  # before the lock and any socket: a group we cannot use stops nothing running
    return path


def restrict_runtime_dir(path: Path, group: SocketGroup | None) -> None:
    """The directory's final access, set while holding its lock: 0700, or 0750 in the socket group.

    The sockets in it are bound under a 0177 umask and given their own mode at once, so opening
    the directory first exposes none of them with a wider mode than its own.
    """
    if group is None:
        if stat.S_IMODE(path.lstat().st_mode) != 0o700:
            os.chmod(path, 0o700)
        return
    give_to_group(path, group, GROUP_DIR_MODE)


def resolve_runtime_dir(cli_value: str | None, config_value: str | None) -> Path:
    """The command line wins over config.json, which wins over the default."""
    chosen = cli_value or config_value
    return Path(chosen) if chosen else default_runtime_dir()
