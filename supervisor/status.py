"""The status document served on the control socket (and printed by `infervisor status`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psutil

from supervisor.broker import Broker
from supervisor.pool import WorkerPool
from supervisor.slot import SlotState, WorkerSlot


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a sample, or None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return round(ordered[rank], 3)


def rss_of(pid: int | None) -> int | None:
    """Resident memory of a process in bytes, or None when it is gone."""
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def slot_status(slot: WorkerSlot) -> dict[str, Any]:
    """One worker's row."""
    pid = slot.pid
    return {
        "slot": slot.assignment.slot,
        "pid": pid,
        "state": slot.state.value,
        "reason": slot.reason,
        "busy": bool(slot.inflight),
        "inflight": len(slot.inflight),
        "cores": list(slot.assignment.cpus),
        "node": slot.assignment.node,
        "shared_cores": slot.assignment.shared,
        "threads": slot.threads_seen if slot.threads_seen is not None else slot.assignment.threads,
        "rss": rss_of(pid),
        "requests": slot.requests,
        "rehearsals": slot.rehearsals_seen,
        "p50_ms": percentile(slot.latencies_ms, 50),
        "p99_ms": percentile(slot.latencies_ms, 99),
        "ready_ms": round(slot.ready_ms, 1),
        "profile": slot.profile,
        "profile_skipped": [n for n in slot.profile_notes.split("; ") if n],
        "profile_build": [n for n in slot.build_notes.split("; ") if n],
        "last_profile": slot.last_profile,
        "restarts": slot.restarts,
        "last_exit": slot.last_exit,
        "last_event": slot.last_event,
    }


def models_status(pool: WorkerPool, broker: Broker) -> dict[str, Any]:
    """Per model: its spec, queue, counters and workers (members first, then successors and retiring ones)."""
    models: dict[str, Any] = {}
    config = pool.serving.current
    for name, slots in pool.members.items():
        queue = broker.queues[name]
        model = config.models[name]
        models[name] = {
            "source": {k: v for k, v in vars(model.source).items() if v is not None},
            "inputs": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in model.inputs],
            "queued": len(queue.waiting),
            "queue_size": queue.capacity,
            "completed": queue.completed,
            "errors": dict(queue.errors),
            "p50_ms": percentile(queue.latencies_ms, 50),
            "p99_ms": percentile(queue.latencies_ms, 99),
            "workers": [slot_status(s) for s in slots]
            + [
                slot_status(s) | {"role": "successor" if s.state is SlotState.STARTING else "retiring"}
                for s in pool.extra
                if s.model.name == name
            ],
        }
    return models


def rollout_status(pool: WorkerPool) -> dict[str, Any]:
    """The rolling-restart queue."""
    rollout = pool.rollout
    return {
        "pending": rollout.pending,
        "current": rollout.current.old.name if rollout.current else None,
        "completed": rollout.completed,
        "last_error": rollout.last_error,
    }
