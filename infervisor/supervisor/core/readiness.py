"""What systemd hears from the daemon: READY=1 once, STATUS= whenever it changes, WATCHDOG=1 from the loop."""

from __future__ import annotations

import time

import structlog

from infervisor.supervisor.host.sd_notify import Notifier
from infervisor.supervisor.lifecycle.roster import Roster
from infervisor.supervisor.workers.health import DaemonState, daemon_state, ready_to_announce, status_line
from infervisor.supervisor.workers.slot import SlotState

log = structlog.get_logger("supervisor")

#: Before READY=1, while a worker still starts (loading, or building with `build: at_start`), systemd's start
#: timeout is pushed this far ahead every _EXTEND_EVERY_S: a slow first start is never killed by its own unit,
#: and a loop that stalls stops extending (each worker's own start and compile limits still apply).
_EXTEND_BY_S = 30
_EXTEND_EVERY_S = 10.0


class Readiness:
    """The daemon's announced state, kept in step with the roster's health each housekeeping turn."""

    def __init__(self, notifier: Notifier, started_at: float) -> None:
        self.notifier = notifier
        self.started_at = started_at
        self.announced = False
        self.state = DaemonState.STARTING
        #: The last STATUS= line sent to systemd (sent again only when it changes).
        self.line = ""
        #: Every slot of every model has failed (logged once per time it happens).
        self.all_failed = False
        self.watchdog_every = notifier.watchdog_interval()
        self.next_watchdog = 0.0
        self.next_extend = 0.0

    def current_line(self) -> str:
        """The STATUS= line systemd has now."""
        return self.line

    def pet_watchdog(self, now: float) -> None:
        """WATCHDOG=1 from the loop itself, so systemd restarts us if the broker loop stalls."""
        if self.watchdog_every is not None and now >= self.next_watchdog:
            self.next_watchdog = now + self.watchdog_every
            self.notifier.notify("WATCHDOG=1")

    def announce(self, roster: Roster, stopping: bool) -> None:
        """READY=1 once every model has a serving worker or has FAILED with a reason; STATUS= whenever that changes."""
        self.note_all_failed(roster.all_failed())
        reports = roster.reports()
        if not self.announced:
            self.extend_start(roster, time.monotonic())
        if not self.announced and ready_to_announce(reports):
            self.announced = True
            ready = sum(1 for s in roster.all_slots() if s.state is SlotState.SERVING)
            log.info("supervisor_ready", workers=ready, uptime_s=round(time.time() - self.started_at, 3))
            self.line = status_line(reports, daemon_state(reports, True, False))
            self.notifier.ready(self.line)
            return
        state = daemon_state(reports, self.announced, stopping)
        line = status_line(reports, state)
        if line != self.line:
            if state is not self.state:
                log.info("daemon_state", old=self.state.value, new=state.value, status=line)
            self.line = line
            self.state = state
            self.notifier.status(line)

    def extend_start(self, roster: Roster, now: float) -> None:
        """EXTEND_TIMEOUT_USEC while a worker is still on its way to serving (starting, or backing off to retry)."""
        if now < self.next_extend:
            return
        if any(s.state in (SlotState.STARTING, SlotState.BACKOFF) for s in roster.all_slots()):
            self.next_extend = now + _EXTEND_EVERY_S
            self.notifier.notify(f"EXTEND_TIMEOUT_USEC={_EXTEND_BY_S * 1_000_000}")

    def note_all_failed(self, all_failed: bool) -> None:
        """Log once each time every slot of every model has failed."""
        if all_failed == self.all_failed:
            return
        # The daemon stays up, state down, with each model's reason in status: a fixed config.json is
        # reloaded without a restart (systemd would only retry the same config up to its start limit).
        self.all_failed = all_failed
        if all_failed:
            log.error("all_workers_failed", reason="every slot of every model failed; down until a reload or restart")

    def stopping(self) -> None:
        """STOPPING=1: systemd then waits for our exit."""
        self.notifier.stopping()
