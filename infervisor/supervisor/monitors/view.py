"""The one interface every monitor has: `check(now, view) -> findings`, over a read-only view of the workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from infervisor.supervisor.monitors.findings import Finding
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import WorkerSlot


@dataclass(frozen=True)
class MonitorView:
    """What monitors may look at on one turn: the serving config, the workers and the queues' ages, never the pool or
    the broker themselves."""

    config: Config
    #: Per model, the pool's workers that serve now.
    serving: Mapping[str, Sequence[WorkerSlot]]
    #: Workers outside the pools that still finish requests (retired, draining).
    draining: Sequence[WorkerSlot]
    #: Every live worker pid: a monitor drops what it keeps about any other.
    live_pids: frozenset[int]
    #: Per model with requests waiting for a worker, how long (s) the oldest of them has waited.
    queue_ages: Mapping[str, float]

    def model_of(self, slot: WorkerSlot) -> ModelConfig:
        """The serving config of the slot's model (live keys apply at once), or what it was built from."""
        return self.config.models.get(slot.model.name, slot.model)

    def all_serving(self) -> list[WorkerSlot]:
        """Every serving worker of every model."""
        return [slot for slots in self.serving.values() for slot in slots]


class Monitor(Protocol):
    """Looks at the workers (or the box) once per monitor interval and reports findings; it never acts."""

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """What this monitor finds now."""
        ...
