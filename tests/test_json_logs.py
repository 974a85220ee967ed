"""JSON log lines reach their stream whole: one write each, so processes sharing an output never split a line."""

from __future__ import annotations

import io
import json
import logging

import structlog

from infervisor.common.json_logs import configure_json_logs


class RecordingRaw(io.RawIOBase):
    """A raw stream that keeps each write call's bytes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def test_a_line_longer_than_the_buffer_is_one_write_with_its_newline() -> None:
    """A 20 KB event (past the 8 KB buffer, where print wrote the newline apart) is written in one call."""
    raw = RecordingRaw()
    stream = io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=8192), encoding="utf-8")
    configure_json_logs(stream, logging.INFO)
    try:
        structlog.get_logger("test").info("long_event", notes="x" * 20_000)
    finally:
        configure_json_logs(io.StringIO(), logging.INFO)
    lines = [w for w in raw.writes if b"long_event" in w]
    assert len(lines) == 1 and lines[0].endswith(b"\n"), [len(w) for w in raw.writes]
    assert json.loads(lines[0])["notes"] == "x" * 20_000
    assert b"".join(raw.writes) == lines[0]
