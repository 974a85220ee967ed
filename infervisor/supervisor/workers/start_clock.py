"""The clock of one starting worker: which phase it is in, and the two limits that phase counts against.

A worker reports each phase it enters (PROGRESS). Building a profile (or waiting for a sibling's
build of its package) counts against the per-profile compile limit, restarted at each phase; the
rest (loading, checking, timing, warm-up) adds up against the start limit. Before its first report
a worker is loading.
"""

from __future__ import annotations

from dataclasses import dataclass

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import COMPILE_PHASES, StartPhase


@dataclass(frozen=True)
class Overrun:
    """Why a starting worker is killed, and the profile whose build overran (None: the start limit)."""

    reason: str
    profile: str | None
    limit_s: float


@dataclass
class StartClock:
    """Phases of one starting process, timed on the supervisor's clock (monotonic seconds)."""

    spawned_at: float = 0.0
    phase: StartPhase = StartPhase.LOADING
    profile: str = ""
    index: int = 0
    count: int = 0
    detail: str = ""
    #: When the current phase began.
    phase_at: float = 0.0
    #: Time spent so far in phases the start limit counts, the current one excluded.
    start_s: float = 0.0
    #: Time spent building or waiting for builds, the current phase excluded.
    build_s: float = 0.0

    @classmethod
    def started(cls, now: float) -> StartClock:
        """A process just spawned: it is loading."""
        return cls(spawned_at=now, phase_at=now)

    def enter(self, progress: wm.Progress, now: float) -> tuple[StartPhase, float] | None:
        """The worker entered a new phase: close the current one; returns it and its length (None: not a phase)."""
        try:
            phase = StartPhase(progress.phase)
        except ValueError:
            return None
        ended, took = self.phase, now - self.phase_at
        if ended in COMPILE_PHASES:
            self.build_s += took
        else:
            self.start_s += took
        self.phase, self.profile, self.index, self.count = phase, progress.profile, progress.index, progress.count
        self.detail, self.phase_at = progress.detail, now
        return ended, took

    def counted(self, now: float) -> float:
        """Seconds the start limit has counted, the current phase included when it counts."""
        return self.start_s + (0.0 if self.phase in COMPILE_PHASES else now - self.phase_at)

    def overrun(self, now: float, start_limit_s: float, compile_limit_s: float) -> Overrun | None:
        """Why this worker must be killed now, or None while it is within both limits."""
        in_phase = now - self.phase_at
        if self.phase in COMPILE_PHASES:
            if in_phase <= compile_limit_s:
                return None
            doing = "waiting for another build of" if self.phase is StartPhase.WAITING else "building"
            return Overrun(
                f"{doing} profile {self.where()} for {in_phase:.0f} s, over compile_timeout_s "
                f"({compile_limit_s:.0f} s)",
                self.profile,
                compile_limit_s,
            )
        counted = self.counted(now)
        if counted <= start_limit_s:
            return None
        return Overrun(
            f"not ready after {counted:.0f} s of loading, checking and warming up (worker_start_timeout_s "
            f"{start_limit_s:.0f} s; builds took {self.build_s:.0f} s more, not counted); it was {self.describe(now)}",
            None,
            start_limit_s,
        )

    def where(self) -> str:
        """`int8_static (2 of 3)`, or the bare name when the phase is about no place in the chain."""
        return f"{self.profile} ({self.index} of {self.count})" if self.index else self.profile

    def describe(self, now: float) -> str:
        """`building int8_static (2 of 3) for 42 s` for status and kill reasons."""
        about = f" {self.where()}" if self.profile else ""
        return f"{self.phase.value}{about} for {now - self.phase_at:.0f} s"

    def status(self, now: float) -> dict[str, object]:
        """The worker row's `starting` entry."""
        return {
            "phase": self.phase.value,
            "profile": self.profile or None,
            "index": self.index,
            "count": self.count,
            "phase_s": round(now - self.phase_at, 1),
            "elapsed_s": round(now - self.spawned_at, 1),
            "start_counted_s": round(self.counted(now), 1),
            "build_s": round(self.build_s + (now - self.phase_at if self.phase in COMPILE_PHASES else 0.0), 1),
            "detail": self.detail or None,
        }
