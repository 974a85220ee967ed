"""A cache file written whole or not at all: a 0600 temporary file beside it, fsynced, then renamed over it.

A reader (another process, the next start) sees the old file or the new one, never a part; a crash leaves at most
the temporary file, whose name the readers never open.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def write_whole(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` as the file at `path` (its folder made 0700 if missing), replacing any old one at once."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(handle, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
