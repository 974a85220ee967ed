"""What each worker process holds: its requests in dispatch order, and when the head of that line last moved.

The broker owns one `Pipeline` per worker process (keyed by worker id, so a respawned process starts
empty). The pool reads it only through the broker, as a `PipelineView` (is the worker busy, how big is what
runs, since when, was a batch running when it died); the broker alone changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.workers.slot import WorkerSlot


class PipelineView(Protocol):
    """What the pool may read of a worker's pipeline."""

    @property
    def size(self) -> int: ...

    def running_count(self) -> int: ...

    def running_rows(self) -> int: ...

    def stalled_for(self, now: float) -> float: ...


@dataclass
class Pipeline:
    """The requests handed to one worker process, in the order it serves them."""

    held: dict[int, PendingRequest] = field(default_factory=dict)
    #: When the head of the pipeline last moved (a reply, or a dispatch into an empty pipeline).
    progress_at: float = 0.0

    @property
    def size(self) -> int:
        """Requests in hand."""
        return len(self.held)

    def batches(self) -> int:
        """How many dispatches (batches, or lone requests) it holds."""
        return len({request.batch_id or -request.internal_id for request in self.held.values()})

    def running(self) -> list[PendingRequest]:
        """The head of the pipeline: the one request running, or every member of the batch running."""
        if not self.held:
            return []
        head = next(iter(self.held.values()))
        if not head.batch_id:
            return [head]
        return [r for r in self.held.values() if r.batch_id == head.batch_id]

    def running_count(self) -> int:
        """How many requests run now (more than one: a batch)."""
        return len(self.running())

    def running_rows(self) -> int:
        """Rows of what runs now (its hang budget grows with them: warm-up timed a batch of one)."""
        return sum(request.rows for request in self.running())

    def stalled_for(self, now: float) -> float:
        """How long the head has not moved."""
        return now - self.progress_at

    def hold_progress_until(self, when: float) -> None:
        """Time the head from `when` at the earliest (what waited behind a profiler's start)."""
        self.progress_at = max(self.progress_at, when)

    def add(self, requests: list[PendingRequest], now: float) -> None:
        """Requests sent to the worker, in the order it will serve them."""
        if not self.held:
            self.progress_at = now
        for request in requests:
            request.dispatched_at = now
            self.held[request.internal_id] = request

    def pop(self, internal_id: int, now: float) -> PendingRequest | None:
        """The request a reply answers (None for a stale reply); the head moved."""
        request = self.held.pop(internal_id, None)
        if request is not None:
            self.progress_at = now
        return request

    def pop_oldest(self, now: float) -> PendingRequest | None:
        """The oldest request in hand (a garbled reply answers it: workers answer in order)."""
        return self.pop(next(iter(self.held)), now) if self.held else None


class Pipelines:
    """Every worker process's pipeline (only those holding something, or ready and not yet used, are kept)."""

    def __init__(self) -> None:
        self.by_worker: dict[str, Pipeline] = {}

    @property
    def held_count(self) -> int:
        """Requests held by every worker together."""
        return sum(pipeline.size for pipeline in self.by_worker.values())

    def of(self, slot: WorkerSlot) -> Pipeline:
        """The pipeline of the slot's current process (a new empty one, not kept, if it never held anything)."""
        pipeline = self.by_worker.get(slot.proc.worker_id)
        return Pipeline() if pipeline is None else pipeline

    def open(self, slot: WorkerSlot, now: float) -> None:
        """A process became ready: for picking it counts as busy from now (its caches are warm)."""
        self.by_worker.setdefault(slot.proc.worker_id, Pipeline(progress_at=now))

    def add(self, slot: WorkerSlot, requests: list[PendingRequest], now: float) -> None:
        """Requests sent to the slot's process, in the order it will serve them."""
        pipeline = self.by_worker.get(slot.proc.worker_id)
        if pipeline is None:
            pipeline = self.by_worker[slot.proc.worker_id] = Pipeline()
        pipeline.add(requests, now)

    def take_all(self, slot: WorkerSlot) -> list[PendingRequest]:
        """Detach every request the slot's process holds, oldest first, and forget its pipeline."""
        pipeline = self.by_worker.pop(slot.proc.worker_id, None)
        return list(pipeline.held.values()) if pipeline is not None else []
