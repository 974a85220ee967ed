"""Watches config.json and model files with watchdog; the main loop acts once a file has been quiet a moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

#: Editors and deploy tools write in several steps (truncate, write, rename); act once the burst is over.
DEBOUNCE_S = 0.3


class FileWatcher(FileSystemEventHandler):
    """Notices in-place writes and write-temp-then-rename of a set of files (their directories are watched)."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self.lock = threading.Lock()
        self.keys: dict[str, set[str]] = {}
        self.changed: dict[str, float] = {}
        self.observer = Observer()
        self.observer.daemon = True

    def watch(self, files: Mapping[str, Path]) -> None:
        """Watch exactly these files (key -> path); a change is reported under every key of that file.

        Paths are resolved once, so re-pointing a symlink is not seen; write or rename the file itself.
        """
        keys: dict[str, set[str]] = {}
        for key, path in files.items():
            keys.setdefault(str(path.resolve()), set()).add(key)
        with self.lock:
            self.keys = keys
        self.observer.unschedule_all()
        for folder in sorted({str(Path(p).parent) for p in self.keys}):
            if Path(folder).is_dir():
                self.observer.schedule(self, folder, recursive=False)

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in ("modified", "created", "moved", "closed"):
            return
        with self.lock:
            paths = (str(event.src_path), str(getattr(event, "dest_path", "") or ""))
            hits = {key for p in paths for key in self.keys.get(p, ())}
            for key in hits:
                self.changed[key] = time.monotonic()
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
        return ready

    def stop(self) -> None:
        """Stop the observer thread."""
        self.observer.stop()
        self.observer.join(timeout=5)
