"""Where torch unpacks a compiled package it loads: a folder of this load's own, removed once the package is loaded.

torch's C++ package loader unpacks the package (its shared library and data) into a fresh folder under TMPDIR
and removes it only in its destructor, which a worker never reaches: it ends by `os._exit`, SIGTERM or SIGKILL.
Each start that loads a package then leaves a copy of it in /tmp (1.5 MB for the tiny model, the weights'
size for a real one): a box whose workers recycle for days fills /tmp, which is RAM where /tmp is tmpfs. Once
loaded, the library is mapped and the constants are in memory, so the unpacked files are not needed again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def unpacked_in_scratch() -> Iterator[str]:
    """TMPDIR points at a new private folder for the block (the loader reads it), which is removed after it."""
    scratch = tempfile.mkdtemp(prefix="infervisor-package-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch
    try:
        yield scratch
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)
