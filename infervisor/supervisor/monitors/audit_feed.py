"""What the live audit's runner (lifecycle/audit_runner.py) hands the audit monitor: verdicts, and its figures.

Declared here, below the runner, so the monitor reads the runner through this protocol and never imports the
lifecycle it would otherwise sit under; the runner satisfies it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.workers.audit_process import AuditState
from infervisor.supervisor.workers.slot import WorkerSlot


@dataclass(frozen=True)
class AuditVerdict:
    """One sample's verdict from its model's audit process, with the worker and profile that served it."""

    model: str
    profile: str
    slot: WorkerSlot
    #: The slot's process when the verdict came in (the report's `served_by_pid`).
    pid: int | None
    result: wm.AuditResult
    #: How many changes of the model (file, source, spec, tolerance) the runner had seen when it collected this.
    changes: int


@dataclass(frozen=True)
class AuditRunFacts:
    """What one model's audit runner shows now: its samples and their cost, its changes seen, its process."""

    held: int
    dropped: int
    cost_ms_per_row: float | None
    changes: int
    state: AuditState
    pid: int | None
    restarts: int
    last_exit: str | None
    error: str | None


#: The facts of a model the runner never sampled.
NO_RUN = AuditRunFacts(0, 0, None, 0, AuditState.OFF, None, 0, None, None)


class AuditFeed(Protocol):
    """The read side of the audit runner: the verdicts collected since the last hand-over, and each model's facts."""

    def hand_over(self) -> list[AuditVerdict]:
        """The verdicts collected since the last call, in the order they came (each is handed over once)."""
        ...

    def facts(self, name: str) -> AuditRunFacts | None:
        """The model's figures now (None when it was never sampled)."""
        ...


class NoFeed:
    """The feed before the runner is wired (core/assembly.py): nothing collected, no model sampled."""

    def hand_over(self) -> list[AuditVerdict]:
        """No verdicts."""
        return []

    def facts(self, name: str) -> AuditRunFacts | None:
        """No model was sampled."""
        return None
