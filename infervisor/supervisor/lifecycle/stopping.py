"""Stopping the pool in order: the work in hand gets the grace period, then STOP, then SIGKILL."""

from __future__ import annotations

import structlog

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import ErrorCode
from infervisor.supervisor.lifecycle.rollout import Rollout
from infervisor.supervisor.lifecycle.roster import Roster
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import LIVE_STATES, SlotState
from infervisor.supervisor.workers.worker_links import WorkerLinks

log = structlog.get_logger("supervisor")

#: How long stopped workers get to exit before SIGKILL.
STOP_KILL_AFTER_S = 5.0


class StopSequence:
    """Whether the pool is stopping, and the deadlines of each stage."""

    def __init__(
        self, roster: Roster, serving: ServingConfig, rollout: Rollout, links: WorkerLinks, broker: Broker
    ) -> None:
        self.roster = roster
        self.serving = serving
        self.rollout = rollout
        self.links = links
        self.broker = broker
        self.stopping = False
        #: Until when the work in hand may finish (set to now by a second stop signal).
        self.deadline = 0.0
        self.kill_deadline: float | None = None

    def begin(self, now: float) -> None:
        """No more rollouts; what is in hand gets the grace period."""
        self.stopping = True
        self.rollout.clear()
        self.deadline = now + self.serving.current.shutdown_grace_s

    def hurry(self) -> None:
        """A second stop signal: the work in hand gets no more grace."""
        self.deadline = 0.0

    def advance(self, now: float) -> None:
        """Finish the work in hand, or answer it SHUTTING_DOWN at the deadline; then stop and kill workers."""
        busy = self.broker.unanswered
        if busy and now < self.deadline:
            return
        slots = self.roster.all_slots()
        if busy:
            log.warning("grace_expired", unanswered=busy)
            self.broker.fail_all(ErrorCode.SHUTTING_DOWN, "the daemon stopped before this request could finish", slots)
        if self.kill_deadline is None:
            self.kill_deadline = now + STOP_KILL_AFTER_S
            for slot in slots:
                if slot.state in (SlotState.SERVING, SlotState.DRAINING):
                    self.links.send_control(slot, wm.Stop())
                    slot.transition(SlotState.STOPPING, "supervisor stopping")
                elif slot.state is SlotState.STARTING:
                    # Still loading, not connected yet: a STOP could not reach it, so do not wait for one.
                    slot.transition(SlotState.STOPPING, "supervisor stopping")
                    slot.kill("stopped while starting")
                elif slot.state is SlotState.BACKOFF:
                    slot.transition(SlotState.STOPPED, "supervisor stopping")
        elif now >= self.kill_deadline:
            for slot in slots:
                slot.kill("did not stop in time")

    def finished(self) -> bool:
        """True once stopping and no worker process is left."""
        return (
            self.stopping
            and self.kill_deadline is not None
            and not any(s.state in LIVE_STATES for s in self.roster.all_slots())
        )

    def shutdown(self) -> None:
        """Kill anything still alive and wait for it, so no worker outlives the supervisor."""
        for slot in self.roster.all_slots():
            slot.kill("supervisor exiting")
            if slot.proc.process is not None:
                slot.proc.process.wait()
            self.links.detach(slot)
