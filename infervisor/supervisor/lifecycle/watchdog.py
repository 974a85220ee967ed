"""The pool's watchdog: kills workers that stopped making progress, and sends the heartbeats that show it.

A worker is killed when it did not exit after STOP, overran its start or compile limit, sat on the head of its
pipeline past the hang budget, or went silent while serving; the reaper (exits.py) does the rest. It reads a
worker's load through the broker's read-only view (`load_of`), and once a `profile` command's grace ends it
times what waited behind the profiler from then (`broker.hold_progress_until`).
"""

from __future__ import annotations

import time

import structlog

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.lifecycle.roster import Roster
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import LIVE_STATES, RestartReason, SlotState, WorkerSlot
from infervisor.supervisor.workers.worker_links import WorkerLinks

log = structlog.get_logger("supervisor")

#: How long after a `profile` command a worker is not killed as hung or silent: torch.profiler takes seconds to start.
PROFILE_START_GRACE_S = 30.0


class Watchdog:
    """Kills the stuck and heartbeats the rest, over every slot of the roster."""

    def __init__(self, roster: Roster, serving: ServingConfig, links: WorkerLinks, broker: Broker) -> None:
        self.roster = roster
        self.serving = serving
        self.links = links
        self.broker = broker

    def murder(self, now: float) -> None:
        """SIGKILL workers that stopped making progress: silent when idle, stuck on a request, or never ready."""
        config = self.serving.current
        for slot in self.roster.all_slots():
            proc = slot.proc
            if slot.state not in LIVE_STATES or proc.process is None:
                continue
            if proc.kill_at is not None and now >= proc.kill_at:
                slot.kill("did not exit after STOP")
            elif slot.state is SlotState.STARTING:
                self.check_start(slot, now)
            elif proc.profile_started_at is not None and now - proc.profile_started_at < PROFILE_START_GRACE_S:
                continue  # starting torch.profiler (the `profile` command) blocks the worker for seconds
            elif (load := self.broker.load_of(slot)).size:
                # Only the head of the pipeline is running (one request, or one batch), so progress is measured
                # from its start; its budget grows with its rows, since warm-up timed a batch of one.
                rows = load.running_rows()
                budget = max(config.hang_min_s, config.hang_factor * proc.expected_ms * rows / 1000.0)
                if proc.profile_started_at is not None:
                    # The grace is over: what waited behind the profiler's start is timed from its end.
                    self.broker.hold_progress_until(slot, proc.profile_started_at + PROFILE_START_GRACE_S)
                    proc.profile_started_at = None
                hung = f"no reply within {budget:.1f} s (hung)"
                if load.stalled_for(now) > budget and slot.kill(hung, RestartReason.HANG):
                    proc.hung_request = True
            elif slot.state is SlotState.SERVING and now - proc.last_heard > proc.heartbeat_s * proc.liveness:
                slot.kill(f"no heartbeat for {now - proc.last_heard:.1f} s", RestartReason.HEARTBEAT)

    def check_start(self, slot: WorkerSlot, now: float) -> None:
        """Kill a starting worker past a limit: the start limit (loading, checking), the compile limit (builds)."""
        config = self.serving.current
        overrun = slot.proc.start.overrun(now, config.worker_start_timeout_s, config.compile_timeout_s)
        if overrun is None or not slot.kill(overrun.reason, RestartReason.START_TIMEOUT):
            return
        if overrun.profile is not None:
            slot.proc.compile_overrun = {"profile": overrun.profile, "limit_s": overrun.limit_s, "at": time.time()}
        log.error(
            "worker_start_overrun",
            slot=slot.name,
            pid=slot.pid,
            phase=slot.proc.start.phase.value,
            profile=overrun.profile,
            limit_s=overrun.limit_s,
            reason=overrun.reason,
        )

    def heartbeat(self, now: float) -> None:
        """Send in-band heartbeats to connected workers, each at the interval it was launched with."""
        for slot in self.roster.all_slots():
            if slot.state in (SlotState.SERVING, SlotState.DRAINING) and now >= slot.proc.next_heartbeat:
                slot.proc.next_heartbeat = now + slot.proc.heartbeat_s
                self.links.send_control(slot, wm.Heartbeat())
