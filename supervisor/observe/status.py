"""The status document served on the control socket (and printed by `infervisor status`)."""

from __future__ import annotations

import time
from typing import Any

import psutil

from infervisor.common.profiles import PROFILES
from infervisor.protocol.constants import MAX_HEADER_BYTES, MAX_NAME_LEN, MAX_RANK, MAX_TENSORS
from infervisor.supervisor.core.fallback import Fallbacks
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.lifecycle.slot import SlotState, WorkerSlot
from infervisor.supervisor.observe.health import ModelReport
from infervisor.supervisor.observe.stats import percentile
from infervisor.supervisor.routing.broker import Broker, ModelQueue
from infervisor.supervisor.settings.config import BatchingConfig, Config


def rss_of(pid: int | None) -> int | None:
    """Resident memory of a process in bytes, or None when it is gone."""
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def pss_of(pid: int | None) -> int | None:
    """Proportional set size of a process in bytes (its shared pages divided among their users), or None."""
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_full_info().pss)
    except (psutil.Error, AttributeError):  # gone, or a kernel without smaps
        return None


def slot_status(slot: WorkerSlot, held: int, now: float | None = None) -> dict[str, Any]:
    """One worker's row (`held`: requests its process holds, from the broker's pipelines)."""
    pid = slot.pid
    now = time.monotonic() if now is None else now
    return {
        "slot": slot.assignment.slot,
        "pid": pid,
        "state": slot.state.value,
        "reason": slot.reason,
        "busy": bool(held),
        "inflight": held,
        "cores": list(slot.assignment.cpus),
        "node": slot.assignment.node,
        "shared_cores": slot.assignment.shared,
        "threads": slot.threads_seen if slot.threads_seen is not None else slot.assignment.threads,
        "rss": rss_of(pid),
        "pss": pss_of(pid),
        "requests": slot.requests,
        "p50_ms": percentile(slot.latencies_ms, 50),
        "p99_ms": percentile(slot.latencies_ms, 99),
        "ready_ms": round(slot.ready_ms, 1),
        "profile": slot.profile,
        "profile_skipped": list(slot.profile_notes),
        "profile_build": list(slot.build_notes),
        **accuracy_data(slot),
        "last_profile": slot.last_profile,
        "restarts": slot.restarts,
        "last_exit": slot.last_exit,
        # Why its last worker could not load the model, in the worker's words (until a worker of the slot serves).
        "load_error": slot.last_load_error or None,
        "last_event": slot.last_event,
        # Before READY: the phase (loading, building profile i of n, ...) and how long each limit has counted.
        "starting": slot.start.status(now) if slot.state is SlotState.STARTING else None,
    }


def accuracy_data(slot: WorkerSlot) -> dict[str, str | None]:
    """What the serving profile was judged on, and a warning when that was synthetic data for one that changes
    numerics (int8, bf16): agreement with eager on drawn inputs says little about real ones."""
    if slot.profile is None:
        return {"checked_on": None, "accuracy_warning": None}
    if slot.model.validation:
        return {"checked_on": "validation set", "accuracy_warning": None}
    declared = PROFILES.get(slot.profile)
    warning = None
    if declared is not None and declared.changes_numerics:
        warning = (
            f"{slot.profile} changes numerics and was judged on synthetic inputs only (no validation set): configure "
            "`validation`, an .npz of real inputs"
        )
    return {"checked_on": "synthetic inputs", "accuracy_warning": warning}


def models_status(
    pool: WorkerPool, broker: Broker, reports: dict[str, ModelReport], fallbacks: Fallbacks | None = None
) -> dict[str, Any]:
    """Per model: its health, spec, queue, counters and workers (members first, then successors and retiring ones)."""
    models: dict[str, Any] = {}
    config = pool.serving.current
    errors = pool.load_errors()
    for name, slots in pool.members.items():
        queue = broker.queues[name]
        model = config.models[name]
        report = reports[name]
        models[name] = {
            "health": report.health.value,
            "reason": report.reason,
            # Why the model (or its last replacement) cannot load, in the worker's words; None when nothing failed.
            "error": errors.get(name),
            "source": {k: v for k, v in vars(model.source).items() if v is not None},
            "inputs": [
                {
                    "name": s.name,
                    "dtype": s.dtype,
                    "shape": s.config_shape(),
                    "synthetic": s.synthetic.to_config() if s.synthetic is not None else None,
                }
                for s in model.inputs
            ],
            "queued": len(queue.waiting),
            "queue_size": queue.capacity,
            "completed": queue.completed,
            "errors": dict(queue.errors),
            "p50_ms": percentile(queue.latencies_ms, 50),
            "p99_ms": percentile(queue.latencies_ms, 99),
            "profiles": list(model.profiles),
            "fallback": fallbacks.status(name, model) if fallbacks is not None else None,
            "batching": batching_status(model.batching, queue),
            "workers": [slot_status(s, broker.pipelines.of(s).size) for s in slots]
            + [
                slot_status(s, broker.pipelines.of(s).size)
                | {"role": "successor" if s.state is SlotState.STARTING else "retiring"}
                for s in pool.extra
                if s.model.name == name
            ],
        }
    return models


def batching_status(policy: BatchingConfig | None, queue: ModelQueue) -> dict[str, Any] | None:
    """How a batching model's requests were joined: batches per size (rows), mean size, the wait to be batched."""
    if policy is None:
        return None
    batches = sum(queue.batch_sizes.values())
    rows = sum(size * count for size, count in queue.batch_sizes.items())
    return {
        "max_batch_size": policy.max_batch_size,
        "max_queue_delay_us": policy.max_queue_delay_us,
        "preferred_batch_sizes": list(policy.preferred_batch_sizes),
        "batches": batches,
        "mean_size": round(rows / batches, 3) if batches else None,
        "batch_sizes": {str(size): count for size, count in sorted(queue.batch_sizes.items())},
        "wait_p50_ms": percentile(queue.batch_wait_ms, 50),
        "wait_p99_ms": percentile(queue.batch_wait_ms, 99),
    }


def config_states(pool: WorkerPool) -> dict[str, Any]:
    """Per model, where the last applied config stands: applied, still rolling out, or rolled back and why."""
    states: dict[str, Any] = {}
    for name in pool.members:
        if name in pool.serving.targets:
            states[name] = {"state": "rolling"}
        elif name in pool.rollout_errors:
            states[name] = {"state": "failed", "error": pool.rollout_errors[name]}
        else:
            states[name] = {"state": "applied"}
    return states


def limits(config: Config) -> dict[str, int]:
    """What a client must stay within (docs/protocol.md): frames, header, tensors per message, rank, names."""
    return {
        "max_frame_bytes": config.max_frame_bytes,
        "max_header_bytes": MAX_HEADER_BYTES,
        "max_tensors": MAX_TENSORS,
        "max_rank": MAX_RANK,
        "max_name_len": MAX_NAME_LEN,
    }


def rollout_status(pool: WorkerPool) -> dict[str, Any]:
    """The rolling-restart queue."""
    rollout = pool.rollout
    return {
        "pending": rollout.pending,
        "current": rollout.current.old.name if rollout.current else None,
        "completed": rollout.completed,
        "last_error": rollout.last_error,
    }
