"""What the live audit of one model has found: rows audited and below tolerance, the worst row, the last finding."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infervisor.common.accuracy import cosine_text
from infervisor.protocol import worker_messages as wm


@dataclass(frozen=True)
class AuditFinding:
    """A served request with a row below tolerance: which profile and process answered it, and the gate's words."""

    at: float
    profile: str
    pid: int | None
    rows: int
    rows_below: int
    row: int
    cosine: float
    relative_error: float
    relative_output: str
    max_abs_error: float
    failure: str
    shapes: str

    def reason(self, min_cosine: float) -> str:
        """One sentence for the fallback and the logs."""
        return (
            f"live audit: {self.profile} answered row {self.row} of a request of {self.shapes} off eager fp32 "
            f"({self.failure}; {self.rows_below} of {self.rows} rows below tolerance, min_cosine {min_cosine})"
        )

    def report(self) -> dict[str, object]:
        return {
            "at": round(self.at, 3),
            "profile": self.profile,
            "served_by_pid": self.pid,
            "row": self.row,
            "rows": self.rows,
            "rows_below": self.rows_below,
            "cosine": self.cosine,
            "relative_error": self.relative_error if self.relative_output else None,
            "relative_output": self.relative_output or None,
            "max_abs_error": self.max_abs_error,
            "failure": self.failure,
            "input_shape": self.shapes,
        }


@dataclass
class AuditTally:
    """One model's audit counters and worst figures (since the daemon started), from the verdicts judged."""

    requests: int = 0
    rows: int = 0
    rows_below: int = 0
    #: Samples the audit process could not read back (never a verdict on the profile).
    unreadable: int = 0
    worst: dict[str, Any] = field(default_factory=dict)
    last_finding: AuditFinding | None = None
    findings: int = 0
    cpu_ms: float = 0.0

    def take(self, result: wm.AuditResult, profile: str, pid: int | None) -> AuditFinding | None:
        """Count one result; the finding when some row is below tolerance."""
        self.cpu_ms += result.cpu_ms
        if result.rows == 0:
            self.unreadable += 1
            return None
        self.requests += 1
        self.rows += result.rows
        self.rows_below += result.rows_below
        if not self.worst or result.cosine < float(self.worst["cosine"]):
            self.worst = {"cosine": result.cosine, "row": result.worst_row, "max_abs_error": result.max_abs_error,
                          "relative_error": result.relative_error if result.relative_output else None,
                          "relative_output": result.relative_output or None, "input_shape": result.shapes,
                          "profile": profile}  # fmt: skip
        if not result.rows_below:
            return None
        finding = AuditFinding(
            time.time(), profile, pid, result.rows, result.rows_below, result.worst_row, result.cosine,
            result.relative_error, result.relative_output, result.max_abs_error, result.failure or "", result.shapes,
        )  # fmt: skip
        self.last_finding = finding
        self.findings += 1
        return finding

    def line(self, dropped: int) -> str:
        """`412 rows audited, 3 below tolerance, worst cosine 0.9987 (x[1, 8]), 2 dropped` (`dropped`: the samples
        the runner let go unaudited)."""
        text = f"{self.rows} rows audited, {self.rows_below} below tolerance"
        if self.worst:
            text += f", worst cosine {cosine_text(float(self.worst['cosine']))} ({self.worst['input_shape']})"
        if dropped:
            text += f", {dropped} dropped"
        return text
