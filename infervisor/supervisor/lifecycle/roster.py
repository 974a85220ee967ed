"""Which slots the pool has: each model's members (what the broker routes to) and the slots outside them.

The pool and its rollout steps change the roster; everything else asks it the read-only questions below.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.health import ModelHealth, ModelReport, model_report
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot


class Roster:
    """Every slot of every model, and the questions asked of them."""

    def __init__(self, serving: ServingConfig, members: dict[str, list[WorkerSlot]]) -> None:
        self.serving = serving
        #: The slots each model routes to, in slot order (the broker reads this mapping).
        self.members = members
        #: Successors still warming up and old workers draining away: alive, but not routed to.
        self.extra: list[WorkerSlot] = []
        #: Models that have had a serving worker since they joined the config (STARTING vs UNAVAILABLE).
        self.has_served: set[str] = set()

    def forget_stopped(self, keep: WorkerSlot | None) -> None:
        """Drop the stopped slots outside the members, except `keep` (a successor the rollout still judges)."""
        self.extra[:] = [s for s in self.extra if s.state is not SlotState.STOPPED or s is keep]

    def member_slots(self) -> Iterator[WorkerSlot]:
        """Every slot the broker routes to."""
        for slots in self.members.values():
            yield from slots

    def all_slots(self) -> list[WorkerSlot]:
        """Every slot with a process to watch: the members plus successors and retiring workers."""
        return [*self.member_slots(), *self.extra]

    def members_of(self, model: str) -> Sequence[WorkerSlot] | None:
        """The slots a model routes to, or None once the model left the config."""
        return self.members.get(model)

    def serving_members(self) -> dict[str, list[WorkerSlot]]:
        """Per model, the members that serve now."""
        return {name: [s for s in slots if s.state is SlotState.SERVING] for name, slots in self.members.items()}

    def draining(self) -> list[WorkerSlot]:
        """Retired workers that still finish their requests."""
        return [s for s in self.extra if s.state is SlotState.DRAINING]

    def live_pids(self) -> frozenset[int]:
        """The pid of every live worker process."""
        return frozenset(pid for s in self.all_slots() if (pid := s.pid) is not None)

    def reports(self) -> dict[str, ModelReport]:
        """Each model's health, from its members."""
        reports = {name: model_report(slots, name in self.has_served) for name, slots in self.members.items()}
        for name, report in reports.items():
            held_up = self.serving.held_up(name)
            if held_up is not None and report.health is ModelHealth.SERVING:
                # Its workers serve, but none can be replaced: the next exit of one is a lost worker.
                reports[name] = ModelReport(ModelHealth.DEGRADED, f"serving workers cannot be replaced: {held_up}")
        return reports

    def all_failed(self) -> bool:
        """True when every slot of every model has FAILED: nothing will ever serve again."""
        slots = list(self.member_slots())
        return bool(slots) and all(s.state is SlotState.FAILED for s in slots)

    def model_errors(self, replacement_errors: Mapping[str, str]) -> dict[str, str]:
        """Per model, status `models[NAME].error` (docs/protocol.md, Error fields): the first of these that holds.

        A member's load error (in the worker's words), a failed member's reason (a crash loop), its failed
        config rollout's error, its last failed replacement's error (`replacement_errors`, the rollout's).
        """
        errors: dict[str, str] = {}
        for name, slots in self.members.items():
            waiting = [s for s in slots if s.state is not SlotState.SERVING]
            candidates = [
                *(s.notes.last_load_error for s in waiting if s.notes.last_load_error),
                *(f"{s.name} failed: {s.reason}" for s in slots if s.state is SlotState.FAILED),
                self.serving.rollout_error(name),
                replacement_errors.get(name),
            ]
            error = next((c for c in candidates if c), None)
            if error is not None:
                errors[name] = error
        return errors
