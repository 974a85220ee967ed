"""Worker logs: one JSON object per line on stderr, beside the supervisor's."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging() -> None:
    """Render structlog events as JSON lines on stderr."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
