"""Worker logs: JSON lines on stderr, with the worker's stdout pointed there too."""

from __future__ import annotations

import logging
import os
import sys

from infervisor.common.json_logs import configure_json_logs


def configure_logging() -> None:
    """Worker logs on stderr; the worker's stdout is pointed there too, so only the supervisor writes stdout."""
    sys.stdout.flush()
    # A print() in model code or a library (or native code writing fd 1) would put a plain line among the
    # supervisor's JSON on the stdout the two share; on stderr it sits with what native code prints anyway.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    configure_json_logs(sys.stderr, logging.INFO)
