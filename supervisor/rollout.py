"""Rolling restarts: replace workers one at a time, each replacement readiness-gated, the old one drained."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from supervisor.config import ModelConfig
from supervisor.planner import Assignment
from supervisor.slot import SlotState, WorkerSlot

if TYPE_CHECKING:
    from supervisor.arbiter import Arbiter

log = structlog.get_logger("supervisor")


@dataclass
class Replacement:
    """Swap `old` for a fresh worker of `model` on `assignment` (usually the same cores)."""

    old: WorkerSlot
    model: ModelConfig
    assignment: Assignment
    reason: str
    successor: WorkerSlot | None = None
    started_at: float = 0.0


class Rollout:
    """The queue of replacements, worked one at a time so capacity never drops below N-1."""

    def __init__(self) -> None:
        self.queue: collections.deque[Replacement] = collections.deque()
        self.current: Replacement | None = None
        self.completed = 0
        self.last_error: str | None = None

    def enqueue(self, replacement: Replacement) -> None:
        """Add a replacement unless that worker is already queued for one (the newest request wins)."""
        self.queue = collections.deque(r for r in self.queue if r.old is not replacement.old)
        self.queue.append(replacement)

    def drop_model(self, model: str, reason: str) -> int:
        """Forget queued replacements of a model; returns how many."""
        before = len(self.queue)
        self.queue = collections.deque(r for r in self.queue if r.model.name != model)
        dropped = before - len(self.queue)
        if dropped:
            log.warning("rollout_dropped", model=model, replacements=dropped, reason=reason)
        return dropped

    def involves(self, slot: WorkerSlot) -> bool:
        """True when this worker is already queued or being replaced."""
        return (self.current is not None and self.current.old is slot) or any(r.old is slot for r in self.queue)

    @property
    def pending(self) -> int:
        """Replacements not finished yet, the running one included."""
        return len(self.queue) + (self.current is not None)

    def advance(self, arbiter: Arbiter) -> None:
        """Start the next replacement, promote a ready successor, or give up on a failed one."""
        if self.current is None:
            if not self.queue:
                return
            self.current = self.queue.popleft()
            self.start(arbiter, self.current)
            return
        successor = self.current.successor
        if successor is None:
            return
        if successor.state is SlotState.SERVING:
            self.promote(arbiter, self.current, successor)
        elif successor.state in (SlotState.BACKOFF, SlotState.FAILED, SlotState.STOPPED):
            self.fail(arbiter, self.current, successor)

    def start(self, arbiter: Arbiter, replacement: Replacement) -> None:
        """Spawn the successor beside the old worker (it takes traffic only once READY)."""
        successor = WorkerSlot(replacement.model, replacement.assignment)
        replacement.successor = successor
        replacement.started_at = time.monotonic()
        arbiter.extra.append(successor)
        log.info("rollout_step_started", slot=replacement.old.name, reason=replacement.reason, queued=len(self.queue))
        arbiter.spawn(successor)

    def promote(self, arbiter: Arbiter, replacement: Replacement, successor: WorkerSlot) -> None:
        """Move traffic to the successor and drain the old worker."""
        pool = arbiter.slots.get(replacement.model.name, [])
        arbiter.extra.remove(successor)
        if replacement.old in pool:
            pool[pool.index(replacement.old)] = successor
            arbiter.retire(replacement.old, f"replaced ({replacement.reason})")
        else:  # the old slot went away meanwhile (scaled down); the successor is not needed
            arbiter.extra.append(successor)
            arbiter.retire(successor, "its slot was removed during the rollout")
        self.completed += 1
        self.current = None
        log.info(
            "rollout_step_done",
            slot=successor.name,
            pid=successor.pid,
            took_s=round(time.monotonic() - replacement.started_at, 3),
            queued=len(self.queue),
        )
        arbiter.broker.dispatch(replacement.model.name)

    def fail(self, arbiter: Arbiter, replacement: Replacement, successor: WorkerSlot) -> None:
        """The replacement died before READY: keep the old worker serving and stop this model's rollout."""
        self.last_error = f"{successor.name}: replacement failed ({successor.last_exit}); the old worker keeps serving"
        log.error("rollout_failed", slot=successor.name, how=successor.last_exit, reason=replacement.reason)
        if successor.state is SlotState.BACKOFF:
            successor.transition(SlotState.STOPPED, "replacement abandoned")
        arbiter.extra.remove(successor)
        arbiter.broker.forget(successor)
        self.current = None
        self.drop_model(replacement.model.name, "an earlier replacement of this model failed")
