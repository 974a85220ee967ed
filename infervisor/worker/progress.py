"""What a starting worker tells the supervisor before READY: each phase it enters, and each profile's outcome.

Sent by the worker's main thread at every phase change, never by a side thread: a compile is one
long phase with no message while it runs (the supervisor times it from the message that began it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import MAX_MESSAGE_LEN, OUTCOME_PHASES, StartPhase
from infervisor.protocol.worker_link import Link, LinkClosed

log = structlog.get_logger("worker")


class Progress(Protocol):
    """Told of each phase a starting worker enters (selection, building, the cache's lock)."""

    def phase(self, phase: StartPhase, profile: str = "", detail: str = "") -> None:
        """The worker enters `phase`, about `profile` of the chain when it names one."""

    def waiting(self) -> None:
        """The profile being built waits for another process's build of the same package."""

    def resumed(self) -> None:
        """The wait is over: this process builds (or loads) the package itself now."""


class NoProgress:
    """Progress told to nobody: in-process builds (bench, tests)."""

    def phase(self, phase: StartPhase, profile: str = "", detail: str = "") -> None:
        """Nothing to tell."""

    def waiting(self) -> None:
        """Nothing to tell."""

    def resumed(self) -> None:
        """Nothing to tell."""


@dataclass
class LinkProgress:
    """Progress sent to the supervisor as PROGRESS messages, each profile numbered by its place in the chain."""

    link: Link
    chain: Sequence[str]
    #: How long a send may wait for room on the link before the supervisor counts as gone.
    send_timeout_s: float
    started: float = field(default_factory=time.perf_counter)
    #: Each profile's outcome phase and its detail, in the order they were decided.
    outcomes: dict[str, tuple[StartPhase, str]] = field(default_factory=dict)
    #: The profile of the last BUILDING phase, for the cache's wait and resume.
    building: str = ""

    def phase(self, phase: StartPhase, profile: str = "", detail: str = "") -> None:
        """Send the phase (a supervisor that stopped reading ends the worker at its next send, as READY would)."""
        if phase is StartPhase.BUILDING:
            self.building = profile
        if phase in OUTCOME_PHASES:
            self.outcomes[profile] = (phase, detail)
        index = self.chain.index(profile) + 1 if profile in self.chain else 0
        elapsed_ms = (time.perf_counter() - self.started) * 1000.0
        message = wm.Progress(
            phase.value, profile, index, len(self.chain) if index else 0, elapsed_ms, detail[:MAX_MESSAGE_LEN]
        )
        log.info("worker_phase", phase=phase.value, profile=profile or None, elapsed_ms=round(elapsed_ms, 1))
        try:
            self.link.send(wm.encode(message))
            if self.link.wants_write:
                self.link.flush_blocking(self.send_timeout_s)
        except LinkClosed as exc:
            # Nobody hears it; the worker finds out for good when it says READY.
            log.warning("progress_not_sent", phase=phase.value, error=str(exc))

    def waiting(self) -> None:
        """The package being built is locked by another process."""
        self.phase(StartPhase.WAITING, self.building, "another process is building this package")

    def resumed(self) -> None:
        """This process holds the package's lock now: its build time starts again."""
        self.phase(StartPhase.BUILDING, self.building, "the other build ended; building or loading it here")
