"""The supervisor's main loop: signals are only queued; each turn routes messages, then reaps,
murders hung workers and manages the pools toward the configured shape."""

from __future__ import annotations

import collections
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import structlog
import zmq

from protocol import worker_messages as wm
from protocol.constants import ErrorCode, WorkerExitCode
from supervisor.broker import Broker
from supervisor.config import Config
from supervisor.control import ControlServer
from supervisor.planner import WorkerDemand, plan_cores
from supervisor.sd_notify import Notifier
from supervisor.slot import LIVE_STATES, SlotState, WorkerSlot, describe_exit
from supervisor.status import build_status
from supervisor.topology import read_topology

log = structlog.get_logger("supervisor")

#: How often timers (reaping, hang checks, deadlines, heartbeats) run, at most.
_HOUSEKEEPING_S = 0.02
#: How long stopped workers get to exit before SIGKILL.
_STOP_KILL_AFTER_S = 5.0
_BACKOFF_BASE_S = 0.5
_BACKOFF_MAX_S = 30.0


class Arbiter:
    """Owns the worker slots, the broker and the control socket, and runs the loop."""

    def __init__(self, config: Config, config_path: Path, runtime_dir: Path, sysfs_root: Path = Path("/sys")) -> None:
        self.config = config
        self.config_path = config_path
        self.runtime_dir = runtime_dir
        self.started_at = time.time()
        self.context: zmq.Context[Any] = zmq.Context(1)
        self.broker = Broker(self.context, config, runtime_dir)
        self.control = ControlServer(self.context, runtime_dir)
        self.notifier = Notifier()
        self.slots = self.plan(config, sysfs_root)
        self.broker.set_pools(self.slots)
        self.signals: collections.deque[int] = collections.deque()
        self.stopping = False
        self.stop_deadline = 0.0
        self.kill_deadline: float | None = None
        self.announced_ready = False
        self.exit_code = 0
        self.next_housekeeping = 0.0
        self.next_heartbeat = 0.0
        self.watchdog_every = self.notifier.watchdog_interval()
        self.next_watchdog = 0.0
        self.wake_r, self.wake_w = socket.socketpair()

    @staticmethod
    def plan(config: Config, sysfs_root: Path) -> dict[str, list[WorkerSlot]]:
        """Slots per model, each pinned to the cores the planner gives it."""
        demands = [
            WorkerDemand(m.name, m.workers, m.cores_per_worker, m.use_smt, m.threads) for m in config.models.values()
        ]
        assignments = plan_cores(read_topology(sysfs_root), os.sched_getaffinity(0), demands, config.oversubscribe)
        slots: dict[str, list[WorkerSlot]] = {name: [] for name in config.models}
        for assignment in assignments:
            slots[assignment.model].append(WorkerSlot(config.models[assignment.model], assignment))
        return slots

    def all_slots(self) -> list[WorkerSlot]:
        """Every slot of every model."""
        return [slot for slots in self.slots.values() for slot in slots]

    # ---- signals ----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Handlers only queue the signal; the wake-up fd makes the poll return at once."""
        self.wake_w.setblocking(False)
        self.wake_r.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._queue_signal)

    def _queue_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def handle_signals(self) -> None:
        """Act on queued signals in the main loop."""
        while self.signals:
            signum = self.signals.popleft()
            if signum in (signal.SIGTERM, signal.SIGINT):
                if self.stopping:
                    log.warning("stop_forced", signal=signal.Signals(signum).name)
                    self.stop_deadline = 0.0
                else:
                    self.begin_stop(f"signal {signal.Signals(signum).name}")
            elif signum == signal.SIGHUP:
                log.info("sighup_ignored", reason="reload arrives with the live-config work")

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Spawn the pools and serve until stopped; returns the process exit code."""
        self.install_signal_handlers()
        log.info(
            "supervisor_starting",
            pid=os.getpid(),
            runtime_dir=str(self.runtime_dir),
            endpoint=self.broker.client_endpoint,
            tcp_endpoint=self.config.tcp_endpoint,
            config=str(self.config_path),
            config_digest=self.config.digest,
            plan={s.name: list(s.assignment.cpus) for s in self.all_slots()},
        )
        for slot in self.all_slots():
            self.spawn(slot)
        poller = zmq.Poller()
        for client_socket in self.broker.client_sockets:
            poller.register(client_socket, zmq.POLLIN)
        poller.register(self.broker.backend, zmq.POLLIN)
        poller.register(self.control.socket, zmq.POLLIN)
        poller.register(self.wake_r.fileno(), zmq.POLLIN)
        try:
            while not self.finished():
                events = dict(poller.poll(int(_HOUSEKEEPING_S * 1000)))
                if self.wake_r.fileno() in events:
                    self._drain_wakeup()
                self.handle_signals()
                if self.broker.backend in events:
                    self.broker.handle_workers()
                for client_socket in self.broker.client_sockets:
                    if client_socket in events:
                        self.broker.handle_clients(client_socket)
                if self.control.socket in events:
                    self.control.handle(self.control_command)
                now = time.monotonic()
                if now >= self.next_housekeeping:
                    self.next_housekeeping = now + _HOUSEKEEPING_S
                    self.housekeeping(now)
        finally:
            self.shutdown_sockets()
        log.info("supervisor_exit", code=self.exit_code)
        return self.exit_code

    def housekeeping(self, now: float) -> None:
        """The timer-driven steps, each named for what it does."""
        self.reap()
        self.murder(now)
        self.broker.expire(now)
        self.heartbeat(now)
        self.pet_watchdog(now)
        if self.stopping:
            self.advance_stop(now)
        else:
            self.manage(now)
            self.announce_readiness()

    def _drain_wakeup(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # ---- process management -----------------------------------------------------------------

    def spawn(self, slot: WorkerSlot) -> None:
        """Start the slot's process and accept its messages."""
        self.broker.forget(slot)
        slot.spawn(self.config, self.broker.worker_endpoint)
        self.broker.register(slot)

    def reap(self) -> None:
        """Collect exited workers: re-dispatch their request, then back off or settle."""
        for slot in self.all_slots():
            if slot.process is None or slot.state not in LIVE_STATES:
                continue
            code = slot.process.poll()
            if code is None:
                continue
            self.on_exit(slot, code, time.monotonic())

    def on_exit(self, slot: WorkerSlot, code: int, now: float) -> None:
        """Handle one worker exit: settle the slot's state first, then re-dispatch what it held."""
        how = describe_exit(code)
        slot.last_exit = how
        self.broker.forget(slot)
        if slot.state not in (SlotState.DRAINING, SlotState.STOPPING):
            log.warning("worker_exited", slot=slot.name, pid=slot.process.pid if slot.process else None, how=how)
        self.settle_exit(slot, how, code, now)
        # Only now, with the slot no longer SERVING, can its requests not be routed back to it.
        self.broker.worker_lost(slot, how)
        if slot.state is SlotState.FAILED and not self.broker.has_capacity(slot.model.name):
            self.broker.fail_queued(slot.model.name, ErrorCode.UNAVAILABLE, "every worker slot of the model failed")

    def settle_exit(self, slot: WorkerSlot, how: str, code: int, now: float) -> None:
        """The state after an exit: STOPPED if we asked for it, else BACKOFF, or FAILED after too many."""
        if slot.state in (SlotState.DRAINING, SlotState.STOPPING):
            slot.transition(SlotState.STOPPED, how)
            return
        failures = slot.record_failure(now, self.config.restart_window_s)
        if failures >= self.config.max_restarts:
            slot.transition(SlotState.BACKOFF, how)
            slot.transition(
                SlotState.FAILED, f"{failures} failures within {self.config.restart_window_s:.0f} s; last: {how}"
            )
            log.error("worker_slot_failed", slot=slot.name, failures=failures, last_exit=how)
            return
        # A worker that never got ready (bad model, bad spec) backs off harder than one that crashed while serving.
        never_ready = slot.state is SlotState.STARTING or code == WorkerExitCode.LOAD_FAILED
        delay = min(_BACKOFF_MAX_S, _BACKOFF_BASE_S * 2 ** (failures - (0 if never_ready else 1)))
        slot.respawn_at = now + (delay if never_ready or failures > 1 else 0.0)
        slot.transition(SlotState.BACKOFF, f"{how}; respawn in {slot.respawn_at - now:.1f} s")

    def murder(self, now: float) -> None:
        """SIGKILL workers that stopped making progress: silent when idle, stuck on a request, or never ready."""
        interval = self.config.heartbeat_interval_ms / 1000.0
        for slot in self.all_slots():
            if slot.state not in LIVE_STATES or slot.process is None:
                continue
            if slot.kill_at is not None and now >= slot.kill_at:
                slot.kill("did not exit after STOP")
            elif slot.state is SlotState.STARTING and now - slot.spawned_at > self.config.worker_start_timeout_s:
                slot.kill(f"not ready after {self.config.worker_start_timeout_s:.0f} s")
            elif slot.inflight:
                # Only the head of the pipeline is running, so progress is measured from its start.
                budget = max(self.config.hang_min_s, self.config.hang_factor * slot.expected_ms / 1000.0)
                if now - slot.progress_at > budget:
                    slot.kill(f"no reply within {budget:.1f} s (hung)")
            elif slot.state is SlotState.SERVING and now - slot.last_heard > interval * self.config.heartbeat_liveness:
                slot.kill(f"no heartbeat for {now - slot.last_heard:.1f} s")

    def heartbeat(self, now: float) -> None:
        """Send in-band heartbeats to connected workers, once per interval."""
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.config.heartbeat_interval_ms / 1000.0
        for slot in self.all_slots():
            if slot.state in (SlotState.SERVING, SlotState.DRAINING):
                self.broker.send_control(slot, wm.Heartbeat())

    def pet_watchdog(self, now: float) -> None:
        """WATCHDOG=1 from this loop itself, so systemd restarts us if the broker loop stalls."""
        if self.watchdog_every is not None and now >= self.next_watchdog:
            self.next_watchdog = now + self.watchdog_every
            self.notifier.notify("WATCHDOG=1")

    def manage(self, now: float) -> None:
        """Reconcile toward the desired pools: respawn slots whose back-off has elapsed."""
        for slot in self.all_slots():
            if slot.state is SlotState.BACKOFF and now >= slot.respawn_at:
                self.spawn(slot)
            elif slot.state is SlotState.STOPPED:
                self.spawn(slot)
        slots = self.all_slots()
        if slots and all(s.state is SlotState.FAILED for s in slots):
            log.error("all_workers_failed", reason="every slot of every model failed; exiting for the service manager")
            self.exit_code = 1
            self.begin_stop("all workers failed")

    def announce_readiness(self) -> None:
        """READY=1 once each model has at least one warm worker."""
        if self.announced_ready:
            return
        if all(any(s.state is SlotState.SERVING for s in slots) for slots in self.slots.values()):
            self.announced_ready = True
            ready = sum(1 for s in self.all_slots() if s.state is SlotState.SERVING)
            log.info("supervisor_ready", workers=ready, uptime_s=round(time.time() - self.started_at, 3))
            self.notifier.ready(f"serving {len(self.slots)} model(s) with {ready} worker(s)")

    # ---- stopping ---------------------------------------------------------------------------

    def begin_stop(self, reason: str) -> None:
        """Refuse new work; in-flight and queued requests get the grace period to finish."""
        self.stopping = True
        self.broker.accepting = False
        self.stop_deadline = time.monotonic() + self.config.shutdown_grace_s
        self.notifier.stopping()
        log.info("supervisor_stopping", reason=reason, grace_s=self.config.shutdown_grace_s)

    def advance_stop(self, now: float) -> None:
        """Finish the work in hand, or answer it SHUTTING_DOWN at the deadline; then stop and kill workers."""
        busy = self.broker.queued_count + self.broker.inflight_count
        if busy and now < self.stop_deadline:
            return
        if busy:
            log.warning("grace_expired", unanswered=busy)
            self.broker.fail_all(ErrorCode.SHUTTING_DOWN, "the daemon stopped before this request could finish")
        if self.kill_deadline is None:
            self.kill_deadline = now + _STOP_KILL_AFTER_S
            for slot in self.all_slots():
                if slot.state in (SlotState.SERVING, SlotState.STARTING, SlotState.DRAINING):
                    self.broker.send_control(slot, wm.Stop())
                    slot.transition(SlotState.STOPPING, "supervisor stopping")
                elif slot.state is SlotState.BACKOFF:
                    slot.transition(SlotState.STOPPED, "supervisor stopping")
        elif now >= self.kill_deadline:
            for slot in self.all_slots():
                slot.kill("did not stop in time")

    def finished(self) -> bool:
        """True once stopping and no worker process is left."""
        return (
            self.stopping
            and self.kill_deadline is not None
            and not any(s.state in LIVE_STATES for s in self.all_slots())
        )

    def shutdown_sockets(self) -> None:
        """Kill anything still alive, then close sockets so no file is left behind."""
        for slot in self.all_slots():
            slot.kill("supervisor exiting")
            if slot.process is not None:
                slot.process.wait()
        self.broker.close()
        self.control.close()
        self.context.term()

    # ---- control ----------------------------------------------------------------------------

    def control_command(self, command: dict[str, Any]) -> dict[str, Any]:
        """Answer one control-socket command."""
        name = command.get("cmd")
        if name == "status":
            return build_status(self)
        if name == "ping":
            return {"ok": True, "pid": os.getpid()}
        return {"ok": False, "error": f"unknown command {name!r}; known: status, ping"}
