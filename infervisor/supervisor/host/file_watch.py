"""Watches config.json and model files with watchdog; the main loop acts once a file has been quiet a moment.

A watched path may be a symlink that is re-pointed rather than written: Kubernetes updates a
ConfigMap volume by writing a new timestamped folder and renaming a `..data` symlink over the old
one (config.json -> ..data/config.json), and never touches the file itself. So every folder that
holds a link on the way to the file is watched too, and an event there re-checks what the path
names now (its final target and that file's identity) instead of matching names.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

#: Editors and deploy tools write in several steps (truncate, write, rename); act once the burst is over.
DEBOUNCE_S = 0.3

#: Events that can mean the file as named now has other content (a read's open/close cannot).
_CHANGES = frozenset({"modified", "created", "moved", "closed"})
#: A folder on a symlink path also sees its old target go away (the kubelet deletes the old folder last).
_LINK_CHANGES = _CHANGES | {"deleted"}

#: The kernel's own limit on symlinks followed in one lookup (ELOOP beyond it).
_MAX_LINKS = 40

Identity = tuple[str, int, int, int, int] | None


def link_folders(path: str) -> set[str]:
    """The folder of every symlink followed to reach `path`'s file, and the folder of the file itself.

    For a ConfigMap mount that is the mount (config.json and ..data both live there) and the
    current timestamped folder; for /srv/app/current/config.json with current -> releases/7 it is
    /srv/app and /srv/app/releases/7.
    """
    folders: set[str] = set()
    pending = os.path.abspath(path)
    for _ in range(_MAX_LINKS):
        parts = Path(pending).parts
        current = parts[0]
        for index, part in enumerate(parts[1:], start=1):
            candidate = os.path.join(current, part)
            if os.path.islink(candidate):
                folders.add(current)
                # `current` holds no symlink, so normalising the joined target lexically is exact.
                pending = os.path.abspath(os.path.join(current, os.readlink(candidate), *parts[index + 1 :]))
                break
            current = candidate
        else:
            folders.add(os.path.dirname(current))
            return folders
    return folders  # a symlink loop: the folders seen so far still catch it being fixed


def identity(path: str) -> Identity:
    """What `path` names right now: its final target and that file's inode, size and mtime (None if missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileWatcher(FileSystemEventHandler):
    """Notices in-place writes, write-temp-then-rename and re-pointed symlinks of a set of files."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self.lock = threading.Lock()
        self.files: dict[str, Path] = {}
        #: Path as named and as resolved -> the keys watching it: an event on that exact name is a change.
        self.keys: dict[str, set[str]] = {}
        #: Folder -> paths (as named) with a link or their file in it: an event there re-checks those paths.
        self.folders: dict[str, set[str]] = {}
        self.named: dict[str, set[str]] = {}
        self.identities: dict[str, Identity] = {}
        self.links: dict[str, set[str]] = {}
        self.changed: dict[str, float] = {}
        #: A path now leads through other folders: they are scheduled again on the main loop's next `due`.
        self.rearm = False
        self.observer = Observer()
        self.observer.daemon = True

    def watch(self, files: Mapping[str, Path]) -> None:
        """Watch exactly these files (key -> path); a change is reported under every key of that file."""
        keys: dict[str, set[str]] = {}
        named: dict[str, set[str]] = {}
        folders: dict[str, set[str]] = {}
        identities: dict[str, Identity] = {}
        links: dict[str, set[str]] = {}
        for key, path in files.items():
            given = os.path.abspath(path)
            named.setdefault(given, set()).add(key)
            for name in (given, os.path.realpath(given)):
                keys.setdefault(name, set()).add(key)
            identities[given] = identity(given)
            links[given] = link_folders(given)
            for folder in links[given]:
                folders.setdefault(folder, set()).add(given)
        with self.lock:
            self.files = dict(files)
            self.keys, self.named, self.folders = keys, named, folders
            self.identities, self.links = identities, links
            self.rearm = False
        self.observer.unschedule_all()
        for folder in sorted(folders):
            if os.path.isdir(folder):
                self.observer.schedule(self, folder, recursive=False)

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in _LINK_CHANGES:
            return
        paths = [os.fsdecode(event.src_path), os.fsdecode(event.dest_path or b"")]
        with self.lock:
            hits: set[str] = set()
            if event.event_type in _CHANGES:
                hits = {key for p in paths if p for key in self.keys.get(p, ())}
            # Names alone miss a re-pointed link: re-check every path that leads through this folder.
            suspects = {given for p in paths if p for given in self.folders.get(os.path.dirname(p), ())}
            for given in suspects:
                now = identity(given)
                if now == self.identities.get(given):
                    continue
                self.identities[given] = now
                hits |= self.named[given]
                if link_folders(given) != self.links[given]:
                    self.rearm = True
            at = time.monotonic()
            for key in hits:
                self.changed[key] = at
        if hits:
            self.wake()

    def start(self) -> None:
        """Start the observer thread."""
        self.observer.start()

    def due(self, now: float) -> set[str]:
        """Keys whose files changed and have been quiet for the debounce window (each reported once)."""
        with self.lock:
            ready = {key for key, at in self.changed.items() if now - at >= DEBOUNCE_S}
            for key in ready:
                del self.changed[key]
            rearm, files = self.rearm, self.files
        if rearm:
            # The old target folder is gone (or no longer on the path); watch the ones the path uses now.
            self.watch(files)
        return ready

    def stop(self) -> None:
        """Stop the observer thread."""
        self.observer.stop()
        self.observer.join(timeout=5)
