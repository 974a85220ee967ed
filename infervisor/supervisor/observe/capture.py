"""Taking the snapshot: copy what the broker, the pool and the monitors hold now, and change none of them.

This module sits above the broker and the pool (it imports both); they import only the recorders
(infervisor/supervisor/instruments/recorders.py), so no import goes back up.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infervisor.supervisor.instruments.recorders import ModelTimes, ReloadStats
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.monitors.readings import MonitorReadings
from infervisor.supervisor.observe.snapshot import (
    Histogram,
    ModelSample,
    Role,
    RolloutSample,
    SlotSample,
    Snapshot,
)
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.routing.model_queue import ModelQueue
from infervisor.supervisor.settings.fallback import Fallbacks
from infervisor.supervisor.workers.slot import RestartReason, SlotState, WorkerSlot


@dataclass(frozen=True)
class Figures:
    """What the monitors (their readings), the reloader and the anomaly counter report, beside the broker and pool."""

    monitors: tuple[MonitorReadings, ...]
    reloads: ReloadStats
    anomalies: Mapping[str, int]


def take_snapshot(
    pool: WorkerPool, broker: Broker, figures: Figures, fallbacks: Fallbacks | None, now: float, clock: float
) -> Snapshot:
    """Copy what the loop knows now (`now` Unix time, `clock` monotonic) into a Snapshot; nothing read is changed."""
    roles = [(s, Role.MEMBER) for s in pool.roster.member_slots()]
    roles += [(s, Role.SUCCESSOR if s.state is SlotState.STARTING else Role.RETIRING) for s in pool.roster.extra]
    rollout = pool.rollout
    reloads = figures.reloads
    return Snapshot(
        taken_at=now,
        models=tuple(_models(pool, broker, fallbacks)),
        slots=tuple(_slot_sample(slot, role, clock, broker.load_of(slot).size) for slot, role in roles),
        refused=tuple(sorted(broker.refused.items())),
        # Every reason of every model, from 0: a first crash then shows in increase().
        restarts=tuple(
            (name, reason.value, pool.restarts[(name, reason)])
            for name in pool.roster.members
            for reason in RestartReason
        ),
        rollout=RolloutSample(
            pending=rollout.pending,
            current=rollout.current.old.name if rollout.current else None,
            completed=rollout.completed,
            last_error=rollout.last_error,
        ),
        stopping=pool.stop.stopping,
        reloads_success=reloads.success,
        reloads_failure=reloads.failure,
        last_reload_ok=reloads.last_ok,
        last_reload_success_at=reloads.last_success_at,
        config_digest=pool.serving.current.digest,
        anomalies=tuple(figures.anomalies.items()),
        monitors=figures.monitors,
    )


def _models(pool: WorkerPool, broker: Broker, fallbacks: Fallbacks | None) -> list[ModelSample]:
    """One sample per model of the pool that has a queue."""
    config = pool.serving.current
    errors = pool.roster.model_errors(pool.rollout.failed)
    reports = pool.roster.reports()
    models = []
    for name in pool.roster.members:
        queue, model = broker.queues.get(name), config.models.get(name)
        if queue is None or model is None:
            continue
        if pool.serving.target(name) is not None:
            state, error = "rolling", None
        elif (failed := pool.serving.rollout_error(name)) is not None:
            state, error = "failed", failed
        else:
            state, error = "applied", None
        build = pool.builds.build_of(name)
        models.append(
            ModelSample(
                name=name,
                config=model,
                report=reports[name],
                load_error=errors.get(name),
                load_failures=pool.exits.load_failures[name],
                fallback=fallbacks.status(name, model) if fallbacks is not None else None,
                config_state=state,
                config_error=error,
                build=build.report(time.monotonic()) if build is not None else None,
                streams=broker.streams.report(pool.serving.desired(name) or model),
                refusals=pool.builds.refusals.get(name),
                recorded_inputs=pool.builds.recorder.report(name),
                **_queue_figures(queue),
            )
        )
    return models


def _queue_figures(queue: ModelQueue) -> dict[str, Any]:
    """A model's queue and request counters, copied."""
    times: ModelTimes = queue.times
    return {
        "completed": times.completed,
        "errors": tuple(queue.errors.items()),
        "queued": len(queue.waiting),
        "capacity": queue.capacity,
        "total": Histogram(tuple(times.total), times.total_sum),
        "queue": Histogram(tuple(times.queue), times.queue_sum),
        "service": Histogram(tuple(times.service), times.service_sum),
        "latencies_ms": tuple(times.recent_ms),
        "batch_sizes": tuple(sorted(queue.batch_sizes.items())),
        "batch_wait_ms": tuple(queue.batch_wait_ms),
    }


def _slot_sample(slot: WorkerSlot, role: Role, clock: float, held: int) -> SlotSample:
    """One slot, copied."""
    return SlotSample(
        model=slot.model.name,
        slot=slot.assignment.slot,
        role=role,
        pid=slot.pid,
        state=slot.state,
        reason=slot.reason,
        inflight=held,
        cores=tuple(slot.assignment.cpus),
        node=slot.assignment.node,
        shared_cores=slot.assignment.shared,
        threads=slot.proc.threads_seen if slot.proc.threads_seen is not None else slot.assignment.threads,
        requests=slot.notes.requests,
        latencies_ms=tuple(slot.proc.latencies_ms),
        ready_ms=slot.proc.ready_ms,
        profile=slot.proc.profile,
        profile_skipped=tuple(slot.proc.profile_notes),
        profile_build=tuple(slot.proc.build_notes),
        validated=bool(slot.model.validation),
        last_profile=slot.notes.last_profile,
        restarts=slot.notes.restarts,
        last_exit=slot.notes.last_exit,
        load_error=slot.notes.last_load_error,
        last_event=slot.notes.last_event,
        starting=slot.proc.start.status(clock) if slot.state is SlotState.STARTING else None,
    )
