"""Planned recycling: after a maximum age or number of requests, each with jitter so workers do not all go at once."""

from __future__ import annotations

import random

from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import WorkerSlot

#: The settings a process's limits were drawn from, and the drawn age and request limits.
_Limits = tuple[tuple[float | None, int | None, float], float | None, float | None]


class AgeWatch:
    """Draws each process's own age and request limits once, within +-jitter of the configured ones."""

    def __init__(self, seed: int | None = None) -> None:
        self.random = random.Random(seed)
        self.limits: dict[int, _Limits] = {}

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """A finding for each serving worker that reached its age or request limit."""
        findings = [f for slot in view.all_serving() if (f := self.judge(slot, view.model_of(slot), now))]
        for pid in set(self.limits) - view.live_pids:
            del self.limits[pid]
        return findings

    def judge(self, slot: WorkerSlot, model: ModelConfig, now: float) -> Finding | None:
        """A finding when this worker reached its age or request limit."""
        pid = slot.pid
        if pid is None or (model.max_age_s is None and model.max_requests is None):
            return None
        settings = (model.max_age_s, model.max_requests, model.recycle_jitter)
        if pid not in self.limits or self.limits[pid][0] != settings:  # drawn again after a live change
            jitter = model.recycle_jitter

            def draw(limit: float | None) -> float | None:
                return None if limit is None else limit * (1.0 + self.random.uniform(-jitter, jitter))

            self.limits[pid] = (settings, draw(model.max_age_s), draw(model.max_requests))
        _, max_age, max_requests = self.limits[pid]
        age = now - slot.proc.ready_at
        if max_age is not None and age >= max_age:
            return Finding("max_age", Action.RECYCLE, slot, {"age_s": round(age, 1), "limit_s": round(max_age, 1)})
        if max_requests is not None and slot.proc.requests >= max_requests:
            detail: dict[str, object] = {"requests": slot.proc.requests, "limit": round(max_requests)}
            return Finding("max_requests", Action.RECYCLE, slot, detail)
        return None
