"""Supervisor logs: structlog events, Python warnings and library records, one JSON object per line on stdout."""

from __future__ import annotations

import sys

from infervisor.common.json_logs import LEVELS, configure_json_logs


def configure_logging(level: str = "info") -> None:
    """(Re)configure the process-wide logger; calling it again applies a new level live."""
    configure_json_logs(sys.stdout, LEVELS[level])
