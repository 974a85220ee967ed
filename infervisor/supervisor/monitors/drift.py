"""Latency drift: a worker slower than its own warm baseline while its siblings are not is recycled."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import WorkerSlot


class DriftWatch:
    """Keeps each process's warm baseline (median of its first `drift_window` requests)."""

    def __init__(self) -> None:
        self.baselines: dict[int, float] = {}

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Findings for every model's serving workers."""
        findings: list[Finding] = []
        for name, slots in view.serving.items():
            model = view.config.models.get(name)
            if model is not None and slots:
                findings.extend(self.judge_model(model, slots))
        for pid in set(self.baselines) - view.live_pids:
            del self.baselines[pid]
        return findings

    def ratio(self, slot: WorkerSlot, window: int) -> float | None:
        """Recent median over baseline median, once both exist."""
        pid = slot.pid
        if pid is None or slot.proc.requests < window:
            return None
        samples = list(slot.proc.latencies_ms)
        if pid not in self.baselines:
            self.baselines[pid] = statistics.median(samples[:window])
            return None
        if slot.proc.requests < 2 * window:
            return None
        baseline = self.baselines[pid]
        return statistics.median(samples[-window:]) / baseline if baseline > 0 else None

    def judge_model(self, model: ModelConfig, slots: Sequence[WorkerSlot]) -> list[Finding]:
        """Findings for one model's serving workers."""
        factor = model.drift_factor
        if factor is None:
            return []
        ratios = {id(s): r for s in slots if (r := self.ratio(s, model.drift_window)) is not None}
        drifted = [s for s in slots if ratios.get(id(s), 0.0) > factor]
        if not drifted:
            return []
        # When every measured worker slowed down, the cause is the box (heat, a noisy neighbour), not a
        # worker: replacing them would not help, so it is only noted.
        if len(drifted) == len(ratios) and len(ratios) > 1:
            return [Finding("latency_drift_all", Action.NOTE, None, {"model": model.name, "factor": factor})]
        return [
            Finding("latency_drift", Action.RECYCLE, s, {"ratio": round(ratios[id(s)], 2), "factor": factor})
            for s in drifted
        ]
