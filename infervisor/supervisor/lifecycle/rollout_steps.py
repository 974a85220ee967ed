"""The steps of a rolling replacement, done on the pool's roster: the `RolloutHost` a `Rollout` drives.

Surge starts a successor beside the pool and swaps it in once READY; drain-first takes the old
worker out first and puts the replacement in its place. A failed replacement drops the model's
rollout target (infervisor/supervisor/settings/serving_config.py) and rebuilds what was built from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.lifecycle.rollout import Replacement, Rollout
from infervisor.supervisor.lifecycle.roster import Roster
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.settings.config_diff import builds_differ
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import RestartReason, SlotState, WorkerSlot
from infervisor.supervisor.workers.worker_links import WorkerLinks

log = structlog.get_logger("supervisor")


class RolloutSteps:
    """Creates, swaps and abandons slots for the rollout; spawning and retiring stay the pool's."""

    def __init__(
        self,
        roster: Roster,
        serving: ServingConfig,
        rollout: Rollout,
        links: WorkerLinks,
        broker: Broker,
        spawn: Callable[[WorkerSlot], None],
        retire: Callable[[WorkerSlot, str], None],
    ) -> None:
        self.roster = roster
        self.serving = serving
        self.rollout = rollout
        self.links = links
        self.broker = broker
        self.spawn = spawn
        self.retire = retire

    def members_of(self, model: str) -> Sequence[WorkerSlot] | None:
        """The slots a model routes to, or None once the model left the config."""
        return self.roster.members_of(model)

    def model_config(self, model: str) -> ModelConfig | None:
        """What the model's workers are to be built from now: its rollout target, else its serving config."""
        return self.serving.desired(model)

    def rollout_failed(self, model: str, error: str) -> None:
        """A replacement toward the model's target failed: drop the target and rebuild what was built from it.

        The model keeps serving with the config it had; members already replaced (earlier surge steps,
        or the drain-first slot) go back to that config, rolling.
        """
        target = self.serving.fail_rollout(model, error)
        serving = self.serving.model(model)
        if target is None or serving is None:
            return
        back = [s for s in self.roster.members.get(model, []) if not builds_differ(s.model, target)]
        for slot in back:
            why = "roll back: the new config failed"
            self.rollout.enqueue(Replacement(slot, serving, slot.assignment, why, RestartReason.ROLLBACK))
        log.error("model_config_rolled_back", model=model, error=error, workers_rebuilt=len(back))

    def replacement_served(self, model: str) -> None:
        """A replacement of the model serves: its model file loads again, so it is no longer held up."""
        self.serving.replacement_done(model)

    def start_successor(self, model: ModelConfig, assignment: Assignment) -> WorkerSlot:
        """Spawn a new slot beside the pool (surge): alive, but not routed to until promoted."""
        successor = WorkerSlot(model, assignment)
        self.roster.extra.append(successor)
        self.spawn(successor)
        return successor

    def take_out(self, slot: WorkerSlot, reason: str) -> int:
        """Remove a member from its pool and retire it; returns where it was."""
        pool = self.roster.members[slot.model.name]
        index = pool.index(slot)
        pool.remove(slot)
        self.retire(slot, reason)
        return index

    def put_in(self, model: ModelConfig, assignment: Assignment, index: int) -> WorkerSlot:
        """Spawn a new member at `index` of its model's pool (drain-first)."""
        pool = self.roster.members[model.name]
        slot = WorkerSlot(model, assignment)
        pool.insert(min(index, len(pool)), slot)
        self.spawn(slot)
        return slot

    def swap_in(self, old: WorkerSlot, successor: WorkerSlot, reason: str) -> bool:
        """Route to a ready successor in `old`'s place and drain `old`; False when `old` left the pool meanwhile."""
        pool = self.roster.members.get(successor.model.name, [])
        if old not in pool:
            return False
        self.roster.extra.remove(successor)
        pool[pool.index(old)] = successor
        self.retire(old, f"replaced ({reason})")
        self.broker.dispatcher.dispatch(successor.model.name)
        return True

    def abandon(self, successor: WorkerSlot, reason: str) -> None:
        """Give up on a successor outside the pool: drain it if it serves, else stop and forget it."""
        if successor.state is SlotState.SERVING:
            self.retire(successor, reason)
            return
        if successor.state is SlotState.BACKOFF:
            successor.transition(SlotState.STOPPED, reason)
        if successor in self.roster.extra:
            self.roster.extra.remove(successor)
        self.links.detach(successor)
