"""JSON log lines, the same shape in the supervisor (on stdout) and in its workers (on stderr).

Besides our own structlog events, two other Python sources write to a process's console: the `warnings` module
(torch and torchao deprecations, a TracerWarning) and stdlib `logging` records of libraries (inductor, torchao,
watchdog), some through console handlers of their own (torch installs one on `torch`, `torch._inductor`, ...).
Both are routed through the same JSON renderer here. Native code that writes to the file descriptor itself
(c10's `[W ...]` lines, oneDNN verbose) bypasses Python and still reaches stderr as plain text.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

#: The one root handler this module installs (kept to replace it when the level or stream changes).
_root_handler: logging.Handler | None = None


def _library_event(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """A library's record keeps its text under `message` and becomes event `library_log`: events stay identifiers."""
    record = event_dict.get("_record")
    event_dict["message"] = event_dict.pop("event", "")
    event_dict["event"] = "library_log"
    if isinstance(record, logging.LogRecord):
        event_dict["logger"] = record.name
    return event_dict


def _shared() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


def json_formatter() -> logging.Formatter:
    """A stdlib formatter that renders a record as the same JSON object our own events are."""
    return structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        foreign_pre_chain=[*_shared(), _library_event],
    )


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """`warnings.showwarning` as one event, instead of the two plain lines Python prints by default."""
    structlog.get_logger("py.warnings").warning(
        "python_warning", category=category.__name__, message=str(message), source=f"{filename}:{lineno}"
    )


def adopt_library_handlers() -> None:
    """Give the console handlers libraries installed on their own loggers (torch's, ...) the JSON formatter.

    Called again after an import that installs one (torch at import time, transformers on first use): handlers
    added later would print plain text until then. Levels and propagation stay as the library set them.
    """
    consoles = {id(stream) for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    formatter = json_formatter()
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in consoles:
                handler.setFormatter(formatter)


def configure_json_logs(stream: TextIO, level: int) -> None:
    """Our events, Python warnings and library records: one JSON object per line on `stream`, from `level` up."""
    global _root_handler
    structlog.configure(
        processors=[*_shared(), structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (PrintLogger writes the newline separately): the supervisor and its workers share
        # one output, and a long line written in two parts lets another process's line land inside it.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    if _root_handler is not None:
        root.removeHandler(_root_handler)
    _root_handler = logging.StreamHandler(stream)
    _root_handler.setFormatter(json_formatter())
    root.addHandler(_root_handler)
    # A library's info chatter is not ours to publish: its records count from WARNING up, or all at debug.
    root.setLevel(level if level <= logging.DEBUG else max(level, logging.WARNING))
    warnings.showwarning = _show_warning
    adopt_library_handlers()
