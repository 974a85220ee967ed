"""What a monitor reports, and what the daemon should do about it (core/responses.py does it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from infervisor.supervisor.workers.slot import WorkerSlot


class Action(enum.Enum):
    """The response to a finding (core/responses.py: RESPONSES)."""

    RECORD = "record"  # show it in status only: a passing check, too frequent to log
    NOTE = "note"  # log it and show it in status
    CANARY = "canary"  # send the worker its golden inputs; the answer is judged when it comes back
    RECYCLE = "recycle"  # rolling replacement: the worker finishes what it holds first
    KILL = "kill"  # SIGKILL now; its requests are re-dispatched
    #: Move the worker's model one step down its chain (all its workers, rolling); recycle it when nothing is below.
    FALLBACK = "fallback"
    #: About the box: route to half of each model's workers while `detail["shed"]` (less heat, same answers).
    SHED = "shed"


@dataclass(frozen=True)
class Finding:
    """One monitor firing about one worker (or about the box when slot is None)."""

    monitor: str
    action: Action
    slot: WorkerSlot | None
    detail: dict[str, object] = field(default_factory=dict)
