"""RSS per worker: a hard limit kills, a soft limit recycles, a steady leak slope recycles; PSS is sampled alongside.

The limits judge RSS: it is what the process itself has resident, so a worker is judged on its own
growth, not on how many siblings happen to share its libraries right now (PSS of a worker rises
when a sibling exits, with nothing of its own changed). PSS (each shared page divided among the
processes that map it) is what the box pays for a worker. Both are readings (status `rss`, `pss` of a
worker, and their metric families), from the same sample.
"""

from __future__ import annotations

import collections

import psutil

from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.readings import Reading, Readings, Scope
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import WorkerSlot

MB = 2**20


def rss_now(pid: int) -> int | None:
    """Resident memory of a process in bytes, read now, or None when it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def pss_now(pid: int) -> int | None:
    """Proportional set size of a process in bytes (its shared pages divided among their users), or None."""
    try:
        return int(psutil.Process(pid).memory_full_info().pss)
    except (psutil.Error, AttributeError):  # gone, or a kernel without smaps
        return None


#: Status shows a worker the monitor has not sampled yet (it samples serving and draining ones) as read now.
MEMORY_READINGS = (
    Reading(
        "rss",
        Scope.WORKER,
        "RSS of each serving or draining worker, as the memory monitor last sampled it",
        metric="infervisor_worker_resident_memory_bytes",
        unit="bytes",
        read_now=rss_now,
    ),
    Reading(
        "pss",
        Scope.WORKER,
        "PSS of each serving or draining worker (shared pages divided among the processes mapping them): "
        "what the box pays for it",
        metric="infervisor_worker_proportional_memory_bytes",
        unit="bytes",
        read_now=pss_now,
    ),
)


def leak_slope_mb_per_min(samples: collections.deque[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    if spread == 0.0:
        return 0.0
    return 60.0 * sum((t - mean_t) * (m - mean_m) for t, m in samples) / spread


class MemoryWatch:
    """Samples each worker's RSS (judged) and PSS (shown) once per monitor interval."""

    def __init__(self) -> None:
        self.history: dict[int, collections.deque[tuple[float, float]]] = {}
        #: Each live worker's last PSS sample in MiB, for the metrics.
        self.pss_mb: dict[int, float] = {}

    def rss_mb(self) -> dict[int, float]:
        """Each live worker's last RSS sample in MiB, for status and the metrics."""
        return {pid: samples[-1][1] for pid, samples in self.history.items() if samples}

    def readings(self, config: Config) -> Readings:
        """Each sampled worker's last RSS and PSS, in bytes (one sample: the figures judged and shown agree)."""
        rss = self.rss_mb()
        return Readings(
            workers={
                pid: {"rss": round(rss_mb * MB), "pss": round(self.pss_mb[pid] * MB) if pid in self.pss_mb else None}
                for pid, rss_mb in rss.items()
            }
        )

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Serving workers against every limit of their model; draining ones against the hard limit only.

        A retiring worker still runs its last requests: one that balloons meanwhile must not escape the hard limit.
        """
        findings = [f for slot in view.all_serving() if (f := self.judge(slot, view.model_of(slot), now, False))]
        findings += [f for slot in view.draining if (f := self.judge(slot, view.model_of(slot), now, True))]
        for pid in set(self.history) - view.live_pids:
            del self.history[pid]
        for pid in set(self.pss_mb) - view.live_pids:
            del self.pss_mb[pid]
        return findings

    def judge(self, slot: WorkerSlot, model: ModelConfig, now: float, hard_only: bool) -> Finding | None:
        """Sample one worker and judge it against its model's limits."""
        pid = slot.pid
        if pid is None:
            return None
        try:
            # One read of /proc/PID/smaps_rollup gives both figures.
            memory = psutil.Process(pid).memory_full_info()
        except psutil.Error:
            return None
        rss_mb = memory.rss / MB
        self.pss_mb[pid] = memory.pss / MB
        history = self.history.setdefault(pid, collections.deque())
        history.append((now, rss_mb))
        while history and now - history[0][0] > model.leak_window_s:
            history.popleft()
        if model.rss_hard_mb is not None and rss_mb > model.rss_hard_mb:
            return Finding("rss_hard", Action.KILL, slot, {"rss_mb": round(rss_mb, 1), "limit_mb": model.rss_hard_mb})
        if hard_only:
            return None
        if model.rss_soft_mb is not None and rss_mb > model.rss_soft_mb:
            return Finding(
                "rss_soft", Action.RECYCLE, slot, {"rss_mb": round(rss_mb, 1), "limit_mb": model.rss_soft_mb}
            )
        # A slope needs most of a window of history, all of it after warm-up (READY), to mean anything.
        covered = history[-1][0] - history[0][0] if history else 0.0
        if model.leak_mb_per_min is not None and len(history) >= 5 and covered >= 0.8 * model.leak_window_s:
            slope = leak_slope_mb_per_min(history)
            if slope > model.leak_mb_per_min:
                detail: dict[str, object] = {
                    "mb_per_min": round(slope, 2),
                    "limit_mb_per_min": model.leak_mb_per_min,
                    "rss_mb": round(rss_mb, 1),
                }
                return Finding("rss_leak", Action.RECYCLE, slot, detail)
        return None
