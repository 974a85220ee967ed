"""Canaries: each serving worker periodically reruns its golden inputs, which must still match its warm-up outputs.

A mismatch recycles the worker. The same profile mismatching again on another process of the
model (its replacement, or a sibling) says the optimised path itself drifts, not one process: the
model falls back one step down its chain instead of recycling into the same profile for ever.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import WorkerSlot

#: How long a mismatch counts toward a repeat: longer than any recycle takes, short of an unrelated fault.
REPEAT_WINDOW_S = 3600.0
#: Mismatches remembered per model.
_KEPT = 16


@dataclass(frozen=True)
class Mismatch:
    """One failed canary: when, which process, and the profile it served."""

    at: float
    pid: int
    profile: str


class CanaryWatch:
    """Says when a worker's canary is due; judges the answer when it comes back."""

    def __init__(self) -> None:
        #: pid -> when its last canary was asked for (its READY time before the first).
        self.sent_at: dict[int, float] = {}
        #: Per model, its recent mismatches.
        self.mismatches: dict[str, collections.deque[Mismatch]] = {}

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """A CANARY finding for each serving worker whose model's canary interval has passed."""
        findings: list[Finding] = []
        for slot in view.all_serving():
            interval, pid = view.model_of(slot).canary_interval_s, slot.pid
            if interval is None or pid is None:
                continue
            if now - self.sent_at.setdefault(pid, slot.proc.ready_at) >= interval:
                self.sent_at[pid] = now
                findings.append(Finding("canary_due", Action.CANARY, slot))
        for pid in set(self.sent_at) - view.live_pids:
            del self.sent_at[pid]
        return findings

    def judge(self, slot: WorkerSlot, model: ModelConfig, result: wm.CanaryResult, now: float) -> Finding:
        """A match is recorded; a mismatch recycles, or falls back when its profile mismatched in another process."""
        limit = model.canary_tolerance * max(1.0, result.scale)
        detail: dict[str, object] = {"max_abs_error": result.max_abs_error, "limit": limit, "ms": round(result.ms, 2)}
        if result.max_abs_error <= limit:
            return Finding("canary_ok", Action.RECORD, slot, detail)
        profile, pid = slot.proc.profile or "", slot.pid or 0
        seen = self.mismatches.setdefault(model.name, collections.deque(maxlen=_KEPT))
        earlier = sorted(
            {m.pid for m in seen if m.profile == profile and m.pid != pid and now - m.at < REPEAT_WINDOW_S}
        )
        seen.append(Mismatch(now, pid, profile))
        detail["profile"] = profile
        if earlier:
            detail["earlier_pids"] = earlier
            return Finding("canary_mismatch", Action.FALLBACK, slot, detail)
        return Finding("canary_mismatch", Action.RECYCLE, slot, detail)

    def forget(self, model: str) -> None:
        """The model falls back: its new profile's mismatches start a fresh count."""
        self.mismatches.pop(model, None)
