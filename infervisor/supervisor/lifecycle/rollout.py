"""Rolling restarts: replace workers one at a time, each replacement readiness-gated, the old one drained.

The rollout decides the order of a replacement's steps; the pool that hosts it performs them (it
alone creates, spawns, retires and moves slots), through the `RolloutHost` calls below.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import RestartReason, SlotState, WorkerSlot

log = structlog.get_logger("supervisor")


@dataclass
class Replacement:
    """Swap `old` for a fresh worker of `model` on `assignment` (usually the same cores)."""

    old: WorkerSlot
    model: ModelConfig
    assignment: Assignment
    reason: str
    #: What the replacement is counted as in `infervisor_worker_restarts_total`.
    cause: RestartReason
    successor: WorkerSlot | None = None
    started_at: float = 0.0
    #: Drain-first only: where in the pool the replacement goes, and that it went straight there.
    index: int = 0
    in_pool: bool = False


class RolloutHost(Protocol):
    """The pool's operations a rollout step needs."""

    def members_of(self, model: str) -> Sequence[WorkerSlot] | None:
        """The slots a model routes to, or None once the model left the config."""

    def model_config(self, model: str) -> ModelConfig | None:
        """The model as configured now."""

    def start_successor(self, model: ModelConfig, assignment: Assignment) -> WorkerSlot:
        """Spawn a new slot beside the pool (surge): alive, but not routed to yet."""

    def take_out(self, slot: WorkerSlot, reason: str) -> int:
        """Remove a slot from its pool and retire it; returns where it was."""

    def put_in(self, model: ModelConfig, assignment: Assignment, index: int) -> WorkerSlot:
        """Spawn a new slot in the pool at `index` (drain-first)."""

    def swap_in(self, old: WorkerSlot, successor: WorkerSlot, reason: str) -> bool:
        """Route to `successor` in `old`'s place and retire `old`; False when `old` left the pool meanwhile."""

    def abandon(self, successor: WorkerSlot, reason: str) -> None:
        """Give up on a successor that is not in the pool."""

    def rollout_failed(self, model: str, error: str) -> None:
        """A replacement of this model failed: keep serving with the config it has."""

    def replacement_served(self, model: str) -> None:
        """A replacement of this model serves: an earlier failure to replace it is over."""


class Rollout:
    """The queue of replacements, worked one at a time so capacity never drops below N-1."""

    def __init__(self, restarts: collections.Counter[tuple[str, RestartReason]] | None = None) -> None:
        self.queue: collections.deque[Replacement] = collections.deque()
        self.current: Replacement | None = None
        self.completed = 0
        self.last_error: str | None = None
        #: Per model, its last failed replacement's error, until a replacement of it succeeds (status `error`).
        self.failed: dict[str, str] = {}
        #: Replacements started, per model and cause (the pool's restart counts, shared with its exits).
        self.restarts: collections.Counter[tuple[str, RestartReason]] = (
            collections.Counter() if restarts is None else restarts
        )

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

    def has_work_for(self, model: str) -> bool:
        """True while a replacement of this model is queued or running."""
        current = self.current is not None and self.current.model.name == model
        return current or any(r.model.name == model for r in self.queue)

    def involves(self, slot: WorkerSlot) -> bool:
        """True when this worker is already queued or being replaced."""
        return (self.current is not None and self.current.old is slot) or any(r.old is slot for r in self.queue)

    @property
    def pending(self) -> int:
        """Replacements not finished yet, the running one included."""
        return len(self.queue) + (self.current is not None)

    @property
    def drain_step_under_way(self) -> bool:
        """A drain-first step is under way: its old worker drains, or its replacement starts in the pool."""
        current = self.current
        return current is not None and (current.successor is None or current.in_pool)

    @property
    def successor(self) -> WorkerSlot | None:
        """The replacement being warmed up now, if any."""
        return self.current.successor if self.current is not None else None

    def advance(self, host: RolloutHost) -> None:
        """Start the next replacement, settle a ready successor, or give up on a failed one."""
        if self.current is None:
            while self.queue and self.current is None:
                self.current = self.queue.popleft()
                if not self.start(host, self.current):
                    self.current = None
            return
        replacement = self.current
        successor = replacement.successor
        if successor is None:  # drain-first: waiting for the old worker to go
            self.after_drain(host, replacement)
        elif replacement.in_pool and successor not in (host.members_of(replacement.model.name) or ()):
            self.current = None  # a scale-down or removal took the slot away: nothing left to replace
        elif successor.state is SlotState.SERVING:
            self.promote(host, replacement, successor)
        elif successor.state in (SlotState.BACKOFF, SlotState.FAILED, SlotState.STOPPED):
            self.fail(host, replacement, successor)

    def start(self, host: RolloutHost, replacement: Replacement) -> bool:
        """Surge: spawn the successor beside the old worker. Drain-first: take the old one out of service first.

        Returns False when there is nothing to replace any more (the worker was scaled away or its model removed).
        """
        name = replacement.old.model.name
        pool = host.members_of(name)
        model = host.model_config(name)
        if pool is None or replacement.old not in pool or model is None:
            return False
        # The model as configured now: a restart queued before a live change must not bring old values back.
        replacement.model = model
        replacement.started_at = time.monotonic()
        self.restarts[(name, replacement.cause)] += 1
        strategy = replacement.model.rollout
        log.info(
            "rollout_step_started", slot=replacement.old.name, reason=replacement.reason, strategy=strategy,
            queued=len(self.queue),
        )  # fmt: skip
        if strategy == "drain_first":
            replacement.index = host.take_out(replacement.old, f"replaced, drain first ({replacement.reason})")
            return True
        replacement.successor = host.start_successor(replacement.model, replacement.assignment)
        return True

    def after_drain(self, host: RolloutHost, replacement: Replacement) -> None:
        """Drain-first: once the old worker is gone, its replacement takes the slot and warms up in the pool."""
        if replacement.old.state is not SlotState.STOPPED:
            return
        if host.members_of(replacement.model.name) is None:  # the model was removed meanwhile
            self.current = None
            return
        replacement.successor = host.put_in(replacement.model, replacement.assignment, replacement.index)
        replacement.in_pool = True

    def promote(self, host: RolloutHost, replacement: Replacement, successor: WorkerSlot) -> None:
        """Move traffic to the successor (surge) and drain the old worker; the step is done."""
        if not replacement.in_pool and not host.swap_in(replacement.old, successor, replacement.reason):
            host.abandon(successor, "its slot was removed during the rollout")
        # Later replacements asked for the old worker now mean its successor.
        for queued in self.queue:
            if queued.old is replacement.old:
                queued.old = successor
        self.completed += 1
        self.current = None
        self.failed.pop(replacement.model.name, None)
        host.replacement_served(replacement.model.name)
        log.info(
            "rollout_step_done",
            slot=successor.name,
            pid=successor.pid,
            took_s=round(time.monotonic() - replacement.started_at, 3),
            queued=len(self.queue),
        )

    def fail(self, host: RolloutHost, replacement: Replacement, successor: WorkerSlot) -> None:
        """The replacement died before READY: stop this model's rollout, keep its serving config, say so.

        Surge: the old worker keeps serving (if it served). Drain-first: the old one is gone, so the slot is rebuilt
        from the config the model serves with (a plain restart of an unchanged config backs off and retries).
        """
        if replacement.in_pool:
            keeps = "its slot is rebuilt"
        elif replacement.old.state is SlotState.SERVING:
            keeps = "the old worker keeps serving"
        else:  # restarting a failed (or backing-off) slot: there was nothing serving to keep
            keeps = f"the old worker is {replacement.old.state.value}: this slot serves nothing"
        self.last_error = f"{successor.name}: replacement failed ({successor.notes.last_exit}); {keeps}"
        self.failed[replacement.model.name] = self.last_error
        log.error("rollout_failed", slot=successor.name, how=successor.notes.last_exit, reason=replacement.reason)
        if not replacement.in_pool:
            host.abandon(successor, "replacement abandoned")
        self.current = None
        self.drop_model(replacement.model.name, "an earlier replacement of this model failed")
        host.rollout_failed(replacement.model.name, self.last_error)

    def clear(self) -> None:
        """Forget queued replacements (the daemon is stopping); the running step, if any, is left to the stop."""
        self.queue.clear()
