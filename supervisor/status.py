"""The status document served on the control socket (and printed by `infervisor status`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psutil

from supervisor.slot import SlotState, WorkerSlot

if TYPE_CHECKING:
    from supervisor.arbiter import Arbiter


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a sample, or None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return round(ordered[rank], 3)


def _rss(pid: int | None) -> int | None:
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
        "busy": bool(slot.inflight),
        "inflight": len(slot.inflight),
        "cores": list(slot.assignment.cpus),
        "node": slot.assignment.node,
        "shared_cores": slot.assignment.shared,
        "threads": slot.threads_seen if slot.threads_seen is not None else slot.assignment.threads,
        "rss": _rss(pid),
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


def build_status(arbiter: Arbiter) -> dict[str, Any]:
    """Everything an operator asks first: who serves what, where, how fast, and what went wrong."""
    broker = arbiter.broker
    models: dict[str, Any] = {}
    for name, slots in arbiter.slots.items():
        queue = broker.queues[name]
        models[name] = {
            "source": {k: v for k, v in vars(arbiter.config.models[name].source).items() if v is not None},
            "inputs": [
                {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in arbiter.config.models[name].inputs
            ],
            "queued": len(queue.waiting),
            "queue_size": queue.capacity,
            "completed": queue.completed,
            "errors": dict(queue.errors),
            "p50_ms": percentile(queue.latencies_ms, 50),
            "p99_ms": percentile(queue.latencies_ms, 99),
            "workers": [slot_status(s) for s in slots]
            + [
                slot_status(s) | {"role": "successor" if s.state is SlotState.STARTING else "retiring"}
                for s in arbiter.extra
                if s.model.name == name
            ],
        }
    return {
        "ok": True,
        "pid": os.getpid(),
        "state": "stopping" if arbiter.stopping else ("ready" if arbiter.announced_ready else "starting"),
        "uptime_s": round(time.time() - arbiter.started_at, 3),
        "rss": _rss(os.getpid()),
        "cpus": sorted(arbiter.affinity.current),
        "cpu_latency": arbiter.cpu_latency.status(arbiter.config.cpu_latency_us),
        "keep_warm": {
            "ms": arbiter.config.keep_warm_ms,
            "model": broker.rehearsal.model.name if broker.rehearsal is not None else None,
            "rehearsals": broker.rehearsals,
            "error": broker.rehearsal_error,
        },
        "config": {
            "path": str(arbiter.config_path),
            "digest": arbiter.config.digest,
            "applied_at": arbiter.config_applied_at,
            "last_error": arbiter.config_error,
            "last_diff": arbiter.last_diff,
        },
        "rollout": {
            "pending": arbiter.rollout.pending,
            "current": arbiter.rollout.current.old.name if arbiter.rollout.current else None,
            "completed": arbiter.rollout.completed,
            "last_error": arbiter.rollout.last_error,
        },
        "endpoints": {"client": broker.client_endpoint, "tcp": arbiter.config.tcp_endpoint},
        "counters": dict(broker.counters),
        "thermal": {**arbiter.thermal.reading, "shedding": broker.shed},
        "models": models,
    }
