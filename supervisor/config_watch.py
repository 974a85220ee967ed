"""Watches config.json with watchdog; the main loop reloads once the file has been quiet for a moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

#: Editors write in several steps (truncate, write, rename); reload once the burst is over.
DEBOUNCE_S = 0.3


class ConfigWatcher(FileSystemEventHandler):
    """Notices in-place writes and write-temp-then-rename of one file (the directory is what is watched)."""

    def __init__(self, path: Path, wake: Callable[[], None]) -> None:
        self.path = str(path.resolve())
        self.wake = wake
        # Written by the observer thread, read by the main loop: a float assignment is atomic in CPython.
        self.changed_at: float | None = None
        self.observer = Observer()

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = {str(event.src_path), str(getattr(event, "dest_path", "") or "")}
        if self.path in paths and event.event_type in ("modified", "created", "moved", "closed"):
            self.changed_at = time.monotonic()
            self.wake()

    def start(self) -> None:
        """Begin watching the file's directory."""
        self.observer.schedule(self, str(Path(self.path).parent), recursive=False)
        self.observer.daemon = True
        self.observer.start()

    def due(self, now: float) -> bool:
        """True (once) when a change is older than the debounce window."""
        changed = self.changed_at
        if changed is None or now - changed < DEBOUNCE_S:
            return False
        self.changed_at = None
        return True

    def stop(self) -> None:
        """Stop the observer thread."""
        self.observer.stop()
        self.observer.join(timeout=5)
