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
    #: Drain-first only: where in the pool the replacement goes, and that it went straight there.
    index: int = 0
    in_pool: bool = False


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
        """Start the next replacement, settle a ready successor, or give up on a failed one."""
        if self.current is None:
            while self.queue and self.current is None:
                self.current = self.queue.popleft()
                if not self.start(arbiter, self.current):
                    self.current = None
            return
        replacement = self.current
        successor = replacement.successor
        if successor is None:  # drain-first: waiting for the old worker to go
            self.after_drain(arbiter, replacement)
        elif replacement.in_pool and successor not in arbiter.slots.get(replacement.model.name, []):
            self.current = None  # a scale-down or removal took the slot away: nothing left to replace
        elif successor.state is SlotState.SERVING:
            self.promote(arbiter, replacement, successor)
        elif successor.state in (SlotState.BACKOFF, SlotState.FAILED, SlotState.STOPPED):
            self.fail(arbiter, replacement, successor)

    def start(self, arbiter: Arbiter, replacement: Replacement) -> bool:
        """Surge: spawn the successor beside the old worker. Drain-first: take the old one out of service first.

        Returns False when there is nothing to replace any more (the worker was scaled away or its model removed).
        """
        name = replacement.old.model.name
        pool = arbiter.slots.get(name)
        if pool is None or replacement.old not in pool or name not in arbiter.config.models:
            return False
        # The model as configured now: a restart queued before a live change must not bring old values back.
        replacement.model = arbiter.config.models[name]
        replacement.started_at = time.monotonic()
        if replacement.model.rollout == "drain_first":
            replacement.index = pool.index(replacement.old)
            pool.remove(replacement.old)
            log.info(
                "rollout_step_started", slot=replacement.old.name, reason=replacement.reason, strategy="drain_first"
            )
            arbiter.retire(replacement.old, f"replaced, drain first ({replacement.reason})")
            return True
        successor = WorkerSlot(replacement.model, replacement.assignment)
        replacement.successor = successor
        arbiter.extra.append(successor)
        log.info(
            "rollout_step_started", slot=replacement.old.name, reason=replacement.reason, strategy="surge",
            queued=len(self.queue),
        )  # fmt: skip
        arbiter.spawn(successor)
        return True

    def after_drain(self, arbiter: Arbiter, replacement: Replacement) -> None:
        """Drain-first: once the old worker is gone, its replacement takes the slot and warms up in the pool."""
        if replacement.old.state is not SlotState.STOPPED:
            return
        pool = arbiter.slots.get(replacement.model.name)
        if pool is None:  # the model was removed meanwhile: nothing to bring back
            self.current = None
            return
        successor = WorkerSlot(replacement.model, replacement.assignment)
        replacement.successor = successor
        replacement.in_pool = True
        pool.insert(min(replacement.index, len(pool)), successor)
        arbiter.spawn(successor)

    def promote(self, arbiter: Arbiter, replacement: Replacement, successor: WorkerSlot) -> None:
        """Move traffic to the successor (surge) and drain the old worker; the step is done."""
        if not replacement.in_pool:
            pool = arbiter.slots.get(replacement.model.name, [])
            arbiter.extra.remove(successor)
            if replacement.old in pool:
                pool[pool.index(replacement.old)] = successor
                arbiter.retire(replacement.old, f"replaced ({replacement.reason})")
            else:  # the old slot went away meanwhile (scaled down); the successor is not needed
                arbiter.extra.append(successor)
                arbiter.retire(successor, "its slot was removed during the rollout")
        # Later replacements asked for the old worker now mean its successor.
        for queued in self.queue:
            if queued.old is replacement.old:
                queued.old = successor
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
        """The replacement died before READY: stop this model's rollout and say so.

        Surge: the old worker keeps serving. Drain-first: the old one is gone, so the slot stays in
        the pool and backs off like any crashing worker.
        """
        keeps = "the old worker keeps serving" if not replacement.in_pool else "the slot backs off and retries"
        self.last_error = f"{successor.name}: replacement failed ({successor.last_exit}); {keeps}"
        log.error("rollout_failed", slot=successor.name, how=successor.last_exit, reason=replacement.reason)
        if not replacement.in_pool:
            if successor.state is SlotState.BACKOFF:
                successor.transition(SlotState.STOPPED, "replacement abandoned")
            arbiter.extra.remove(successor)
            arbiter.broker.forget(successor)
        self.current = None
        self.drop_model(replacement.model.name, "an earlier replacement of this model failed")
