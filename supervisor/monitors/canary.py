"""Canaries: each serving worker periodically reruns its golden inputs, which must still match its warm-up outputs."""

from __future__ import annotations

from protocol import worker_messages as wm
from supervisor.config import ModelConfig
from supervisor.monitors.findings import Action, Finding
from supervisor.monitors.view import MonitorView
from supervisor.slot import WorkerSlot


class CanaryWatch:
    """Says when a worker's canary is due; judges the answer when it comes back."""

    def __init__(self) -> None:
        #: pid -> when its last canary was asked for (its READY time before the first).
        self.sent_at: dict[int, float] = {}

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """A CANARY finding for each serving worker whose model's canary interval has passed."""
        findings: list[Finding] = []
        for slot in view.all_serving():
            interval, pid = view.model_of(slot).canary_interval_s, slot.pid
            if interval is None or pid is None:
                continue
            if now - self.sent_at.setdefault(pid, slot.ready_at) >= interval:
                self.sent_at[pid] = now
                findings.append(Finding("canary_due", Action.CANARY, slot))
        for pid in set(self.sent_at) - view.live_pids:
            del self.sent_at[pid]
        return findings

    @staticmethod
    def judge(slot: WorkerSlot, model: ModelConfig, result: wm.CanaryResult) -> Finding:
        """A mismatch recycles the worker; a match is only recorded for status."""
        limit = model.canary_tolerance * max(1.0, result.scale)
        detail: dict[str, object] = {"max_abs_error": result.max_abs_error, "limit": limit, "ms": round(result.ms, 2)}
        if result.max_abs_error > limit:
            return Finding("canary_mismatch", Action.RECYCLE, slot, detail)
        return Finding("canary_ok", Action.RECORD, slot, detail)
