"""Counts of things that should not happen (garbage from a client, a reply nobody waits for), logged sparingly."""

from __future__ import annotations

import collections

import structlog

log = structlog.get_logger("supervisor")


class Anomalies:
    """Counts each kind for status; logs only its first occurrence, so a flood of garbage cannot flood the log."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def count(self, kind: str, detail: str = "") -> None:
        """Count one anomaly of `kind`."""
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            log.warning("anomaly_first_seen", kind=kind, detail=detail, note="later ones are only counted in status")
