"""Latency drift: a worker slower than its own warm baseline while its siblings are not is recycled."""

from __future__ import annotations

import statistics

from supervisor.monitors.findings import Action, Finding
from supervisor.slot import WorkerSlot


class DriftWatch:
    """Keeps each process's warm baseline (median of its first `drift_window` requests)."""

    def __init__(self) -> None:
        self.baselines: dict[int, float] = {}

    def ratio(self, slot: WorkerSlot) -> float | None:
        """Recent median over baseline median, once both exist."""
        window, pid = slot.model.drift_window, slot.pid
        if pid is None or slot.process_requests < window:
            return None
        samples = list(slot.latencies_ms)
        if pid not in self.baselines:
            self.baselines[pid] = statistics.median(samples[:window])
            return None
        if slot.process_requests < 2 * window:
            return None
        baseline = self.baselines[pid]
        return statistics.median(samples[-window:]) / baseline if baseline > 0 else None

    def check_model(self, slots: list[WorkerSlot]) -> list[Finding]:
        """Findings for one model's serving workers."""
        factor = slots[0].model.drift_factor if slots else None
        if factor is None:
            return []
        ratios = {id(s): r for s in slots if (r := self.ratio(s)) is not None}
        drifted = [s for s in slots if ratios.get(id(s), 0.0) > factor]
        if not drifted:
            return []
        # When every measured worker slowed down, the cause is the box (heat, a noisy neighbour), not a
        # worker: replacing them would not help, so it is only noted.
        if len(drifted) == len(ratios) and len(ratios) > 1:
            return [Finding("latency_drift_all", Action.NOTE, None, {"model": slots[0].model.name, "factor": factor})]
        return [
            Finding("latency_drift", Action.RECYCLE, s, {"ratio": round(ratios[id(s)], 2), "factor": factor})
            for s in drifted
        ]

    def forget_dead(self, live_pids: set[int]) -> None:
        """Drop baselines of processes that are gone."""
        for pid in set(self.baselines) - live_pids:
            del self.baselines[pid]
