"""The supervisor's main loop: signals are only queued; each turn routes messages, then reaps,
murders hung workers and manages the pools toward the configured shape."""

from __future__ import annotations

import collections
import dataclasses
import json
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
from supervisor.affinity import SupervisorAffinity
from supervisor.broker import Broker
from supervisor.config import Config, ConfigError, load_config
from supervisor.config_diff import ConfigDiff, diff_configs
from supervisor.control import ControlServer
from supervisor.cpu_latency import CpuLatencyHold
from supervisor.file_watch import FileWatcher
from supervisor.logs import configure_logging
from supervisor.monitors.age import AgeWatch
from supervisor.monitors.drift import DriftWatch
from supervisor.monitors.findings import Action, Finding
from supervisor.monitors.memory import MemoryWatch
from supervisor.monitors.thermal import ThermalWatch
from supervisor.planner import Assignment, PlanError, WorkerDemand, plan_cores
from supervisor.rollout import Replacement, Rollout
from supervisor.sd_notify import Notifier
from supervisor.slot import LIVE_STATES, SlotState, WorkerSlot, describe_exit
from supervisor.status import build_status
from supervisor.topology import TopologyError, read_topology

log = structlog.get_logger("supervisor")

#: The file watcher's key for config.json (model files are keyed by model name).
_CONFIG_KEY = "\0config"
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
        self.sysfs_root = sysfs_root
        self.affinity = SupervisorAffinity(frozenset(os.sched_getaffinity(0)))
        self.cpu_latency = CpuLatencyHold()
        self.slots: dict[str, list[WorkerSlot]] = {
            name: [WorkerSlot(config.models[name], a) for a in assignments]
            for name, assignments in self.plan(config).items()
        }
        #: Successors still warming up and old workers draining away: alive, but outside the pools.
        self.extra: list[WorkerSlot] = []
        self.rollout = Rollout()
        self.broker.set_pools(self.slots)
        self.reload_reason: str | None = None
        self.config_applied_at = time.time()
        self.config_error: list[str] | None = None
        self.last_diff: dict[str, object] = {}
        self.signals: collections.deque[int] = collections.deque()
        self.stopping = False
        self.stop_deadline = 0.0
        self.kill_deadline: float | None = None
        self.announced_ready = False
        self.exit_code = 0
        self.next_housekeeping = 0.0
        self.watchdog_every = self.notifier.watchdog_interval()
        self.next_watchdog = 0.0
        self.wake_r, self.wake_w = socket.socketpair()
        self.watcher = FileWatcher(self.wake)
        self.memory = MemoryWatch()
        self.drift = DriftWatch()
        self.age = AgeWatch()
        self.thermal = ThermalWatch(config.thermal_sysfs_root)
        self.next_monitor = 0.0
        self.canary_seq = 0
        self.broker.on_canary = self.on_canary
        self.broker.on_profile = self.on_profile

    def plan(self, config: Config) -> dict[str, list[Assignment]]:
        """Core assignments per model, from the topology and the cpus this process may use."""
        demands = [
            WorkerDemand(m.name, m.workers, m.cores_per_worker, m.use_smt, m.threads) for m in config.models.values()
        ]
        # The cpus we were given at start, not our own mask now: pinning the supervisor narrows that.
        assignments = plan_cores(read_topology(self.sysfs_root), self.affinity.allowed, demands, config.oversubscribe)
        planned: dict[str, list[Assignment]] = {name: [] for name in config.models}
        for assignment in assignments:
            planned[assignment.model].append(assignment)
        return planned

    def pool_slots(self) -> list[WorkerSlot]:
        """The slots the broker routes to."""
        return [slot for slots in self.slots.values() for slot in slots]

    def all_slots(self) -> list[WorkerSlot]:
        """Every slot with a process to watch: the pools plus successors and retiring workers."""
        return self.pool_slots() + self.extra

    def wake(self) -> None:
        """Make the main loop's poll return (safe from any thread)."""
        try:
            self.wake_w.send(b"\0")
        except BlockingIOError:
            pass

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
                self.reload_reason = "SIGHUP"

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
        poller = self.broker.poller
        poller.register(self.control.socket, zmq.POLLIN)
        poller.register(self.wake_r.fileno(), zmq.POLLIN)
        try:
            # Inside the try: whatever fails here, the workers already spawned are killed and reaped.
            for slot in self.all_slots():
                self.spawn(slot)
            self.watch_files()
            self.watcher.start()
            while not self.finished():
                # keep_warm_ms: while a worker holds a request, an idle wait that long ends in a rehearsal.
                rehearse_after_ms = self.broker.rehearsal_due_ms
                wait_ms = int(_HOUSEKEEPING_S * 1000) if rehearse_after_ms is None else rehearse_after_ms
                events = dict(poller.poll(wait_ms))
                if not events and rehearse_after_ms is not None:
                    self.broker.rehearse()
                if self.wake_r.fileno() in events:
                    self._drain_wakeup()
                self.handle_signals()
                # Worker messages first: each reply frees a place the client messages may take.
                for item, flags in events.items():
                    linked = self.broker.links.get(item)
                    if linked is not None:
                        self.broker.on_link_event(linked, flags)
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
            self.watcher.stop()
            self.shutdown_sockets()
            self.cpu_latency.release("exit")
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
            return
        for key in self.watcher.due(now):
            if key == _CONFIG_KEY:
                self.reload_reason = self.reload_reason or "config file changed"
            elif key in self.slots:
                self.restart(key, "model file changed on disk")
        # A drain-first step has taken a worker out of its pool and not yet put the replacement in;
        # re-planning the pool now would see a hole and fill it twice. The reload waits for the step.
        mid_drain = self.rollout.current is not None and self.rollout.current.successor is None
        if self.reload_reason is not None and not mid_drain:
            reason, self.reload_reason = self.reload_reason, None
            self.reload_config(reason)
        self.monitor(now)
        self.rollout.advance(self)
        self.manage(now)
        self.affinity.reconcile((s.assignment.cpus for s in self.all_slots()), self.config.pin_supervisor)
        # Polling idle adds heat: a throttling box lets go of the request until it cools.
        self.cpu_latency.reconcile(self.config.cpu_latency_us, self.thermal.throttled)
        self.broker.reconcile_rehearsal()
        self.announce_readiness()

    def _drain_wakeup(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # ---- process management -----------------------------------------------------------------

    def spawn(self, slot: WorkerSlot) -> None:
        """Start the slot's process and accept its messages; a failed fork/exec is retried later, not fatal."""
        self.broker.forget(slot)
        try:
            slot.spawn(self.config)
        except OSError as exc:  # EAGAIN (pid limit), ENOMEM, EMFILE: the box is short of something
            log.error("spawn_failed", slot=slot.name, error=str(exc), retry_in_s=_BACKOFF_MAX_S)
            if slot.state is SlotState.STOPPED:
                slot.transition(SlotState.STARTING, "spawn attempted")
                slot.transition(SlotState.BACKOFF, f"spawn failed: {exc}")
            slot.respawn_at = time.monotonic() + _BACKOFF_MAX_S
            return
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
        self.broker.drain(slot)
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
            elif slot.state is SlotState.SERVING and now - slot.last_heard > slot.heartbeat_s * slot.liveness:
                slot.kill(f"no heartbeat for {now - slot.last_heard:.1f} s")

    def heartbeat(self, now: float) -> None:
        """Send in-band heartbeats to connected workers, each at the interval it was launched with."""
        for slot in self.all_slots():
            if slot.state in (SlotState.SERVING, SlotState.DRAINING) and now >= slot.next_heartbeat:
                slot.next_heartbeat = now + slot.heartbeat_s
                self.broker.send_control(slot, wm.Heartbeat())

    def pet_watchdog(self, now: float) -> None:
        """WATCHDOG=1 from this loop itself, so systemd restarts us if the broker loop stalls."""
        if self.watchdog_every is not None and now >= self.next_watchdog:
            self.next_watchdog = now + self.watchdog_every
            self.notifier.notify("WATCHDOG=1")

    def manage(self, now: float) -> None:
        """Reconcile toward the desired pools: respawn slots whose back-off has elapsed, forget retired ones."""
        for slot in self.pool_slots():
            if slot.state is SlotState.BACKOFF and now >= slot.respawn_at:
                self.spawn(slot)
            elif slot.state is SlotState.STOPPED:
                self.spawn(slot)
        successor = self.rollout.current.successor if self.rollout.current else None
        self.extra = [s for s in self.extra if s.state is not SlotState.STOPPED or s is successor]
        slots = self.pool_slots()
        if slots and all(s.state is SlotState.FAILED for s in slots):
            log.error("all_workers_failed", reason="every slot of every model failed; exiting for the service manager")
            self.exit_code = 1
            self.begin_stop("all workers failed")

    # ---- restarts and reloads ----------------------------------------------------------------

    def retire(self, slot: WorkerSlot, reason: str) -> None:
        """Take a worker out of service gently: drain a serving one, stop a starting one, forget a dead one."""
        if slot not in self.extra:
            self.extra.append(slot)
        if slot.state is SlotState.SERVING:
            slot.transition(SlotState.DRAINING, reason)
            slot.kill_at = time.monotonic() + self.config.shutdown_grace_s + _STOP_KILL_AFTER_S
            if not slot.inflight:
                self.broker.send_control(slot, wm.Drain())
        elif slot.state is SlotState.STARTING:
            slot.transition(SlotState.STOPPING, reason)
            slot.kill(reason)
        elif slot.state in (SlotState.BACKOFF, SlotState.FAILED):
            slot.transition(SlotState.STOPPED, reason)

    def restart(self, model: str | None, reason: str) -> int:
        """Queue a rolling restart of one model's workers (or all); returns how many were queued."""
        queued = 0
        for name, slots in self.slots.items():
            if model is None or name == model:
                for slot in slots:
                    self.rollout.enqueue(Replacement(slot, slot.model, slot.assignment, reason))
                    queued += 1
        log.info("restart_requested", model=model or "*", workers=queued, reason=reason)
        return queued

    def reload_config(self, reason: str) -> None:
        """Read config.json again; a bad file changes nothing, a good one is applied by its diff."""
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
            diff = diff_configs(self.config, new)
            if diff.needs_daemon_restart:
                # Bound into sockets at start: keep the running values, say what needs a restart.
                kept = {key: getattr(self.config, key) for key in diff.needs_daemon_restart}
                new = dataclasses.replace(new, **kept)
                log.warning("config_needs_daemon_restart", keys=diff.needs_daemon_restart)
            assignments = self.plan(new)
        except ConfigError as exc:
            self.reject_config(reason, exc.problems)
            return
        except (PlanError, TopologyError) as exc:
            self.reject_config(reason, [f"models: {exc}"])
            return
        self.config_error = None
        self.last_diff = diff.summary()
        if diff.empty and new.digest == self.config.digest:
            log.info("config_unchanged", reason=reason)
        else:
            self.apply_config(new, assignments, diff)
            log.info("config_applied", reason=reason, digest=new.digest, diff=self.last_diff)
        self.notifier.ready(f"config {self.config.digest} applied")

    def watch_files(self) -> None:
        """Watch config.json and every model file (a changed file restarts its model, rolling)."""
        files = {_CONFIG_KEY: self.config_path}
        for name, model in self.config.models.items():
            if model.source.path is not None:
                files[name] = Path(model.source.path)
        self.watcher.watch(files)

    def reject_config(self, reason: str, problems: list[str]) -> None:
        """Keep serving with the last good config and say why the new one was refused."""
        self.config_error = problems
        log.error("config_rejected", reason=reason, problems=problems, serving_digest=self.config.digest)
        self.notifier.ready(f"config rejected; still serving {self.config.digest}")

    def apply_config(self, new: Config, assignments: dict[str, list[Assignment]], diff: ConfigDiff) -> None:
        """Adopt a validated config: live keys at once, new/removed/scaled workers now, rebuilt ones rolling."""
        self.config = new
        self.broker.config = new
        self.broker.rehearsal_error = None  # a new config may rehearse again (reconciled at housekeeping)
        self.config_applied_at = time.time()
        if "log_level" in diff.live:
            configure_logging(new.log_level)
        for name in diff.removed:
            self.rollout.drop_model(name, "model removed from config")
            for slot in self.slots.pop(name):
                self.retire(slot, "model removed from config")
            self.broker.remove_model(name)
        for name, wanted in assignments.items():
            model = new.models[name]
            pool = self.slots.setdefault(name, [])
            for slot in pool[len(wanted) :]:
                self.retire(slot, f"scaled down to {len(wanted)} workers")
            del pool[len(wanted) :]
            for index, assignment in enumerate(wanted):
                if index >= len(pool):
                    slot = WorkerSlot(model, assignment)
                    pool.append(slot)
                    self.spawn(slot)
                    continue
                slot = pool[index]
                moved = slot.assignment.cpus != assignment.cpus or slot.assignment.threads != assignment.threads
                if name in diff.rolling or moved:
                    why = ", ".join(diff.rolling.get(name, [])) or "cores re-planned"
                    self.rollout.enqueue(Replacement(slot, model, assignment, f"config: {why}"))
                else:
                    slot.model = model  # only live keys changed (queue size, retries, prefetch)
        self.broker.set_pools(self.slots)
        for name in self.slots:
            self.broker.dispatch(name)
        self.thermal = ThermalWatch(new.thermal_sysfs_root) if "thermal_sysfs_root" in diff.live else self.thermal
        self.watch_files()

    # ---- monitors -----------------------------------------------------------------------------

    def monitor(self, now: float) -> None:
        """Once per monitor interval: sample memory, age, drift and heat, send due canaries, act on findings."""
        if now < self.next_monitor:
            return
        self.next_monitor = now + self.config.monitor_interval_s
        serving = [s for s in self.pool_slots() if s.state is SlotState.SERVING]
        findings: list[Finding] = []
        for slot in serving:
            findings.extend(f for f in (self.memory.check(slot, now), self.age.check(slot, now)) if f is not None)
            interval = slot.model.canary_interval_s
            if interval is not None and now - slot.last_canary_at >= interval:
                slot.last_canary_at = now
                self.canary_seq += 1
                self.broker.send_control(slot, wm.Canary(self.canary_seq))
        # A retiring worker still runs its last requests: one that balloons meanwhile must not escape the hard limit.
        for slot in self.extra:
            if slot.state is SlotState.DRAINING and (finding := self.memory.check(slot, now, hard_only=True)):
                findings.append(finding)
        for slots in self.slots.values():
            findings.extend(self.drift.check_model([s for s in slots if s.state is SlotState.SERVING]))
        thermal = self.thermal.check(self.config.thermal_max_c)
        if thermal is not None:
            findings.append(thermal)
        self.broker.shed = self.thermal.throttled and self.config.thermal_action == "shed"
        live = {pid for s in self.all_slots() if (pid := s.pid) is not None}
        for watch in (self.memory, self.drift, self.age):
            watch.forget_dead(live)
        for finding in findings:
            self.act(finding)

    def on_profile(self, slot: WorkerSlot, result: wm.ProfileResult) -> None:
        """Keep a worker's torch.profiler report for status (malformed operator JSON is kept as an error)."""
        try:
            operators = json.loads(result.operators)
        except ValueError:
            operators = {"error": "the worker sent operators that are not JSON"}
        slot.last_profile = {"seq": result.seq, "requests": result.requests, "operators": operators}
        log.info("profile_received", slot=slot.name, seq=result.seq, requests=result.requests)

    def start_profile(self, model: str, requests: int) -> dict[str, Any]:
        """Ask one serving worker of `model` to profile its next requests; the report appears in its status."""
        serving = [s for s in self.slots.get(model, []) if s.state is SlotState.SERVING]
        if not serving:
            return {"ok": False, "error": f"model {model[:128]!r} has no serving worker"}
        self.canary_seq += 1
        slot = serving[0]
        if not self.broker.send_control(slot, wm.Profile(self.canary_seq, requests)):
            return {"ok": False, "error": f"{slot.name} is not connected"}
        return {"ok": True, "slot": slot.assignment.slot, "pid": slot.pid, "seq": self.canary_seq}

    def on_canary(self, slot: WorkerSlot, result: wm.CanaryResult) -> None:
        """Judge a canary: outputs on the golden inputs must still match this worker's own warm-up outputs."""
        limit = slot.model.canary_tolerance * max(1.0, result.scale)
        detail: dict[str, object] = {"max_abs_error": result.max_abs_error, "limit": limit, "ms": round(result.ms, 2)}
        if result.max_abs_error > limit:
            self.act(Finding("canary_mismatch", Action.RECYCLE, slot, detail))
        else:
            slot.last_event = {"monitor": "canary_ok", **detail}

    def act(self, finding: Finding) -> None:
        """Log a finding as data, show it in status, and recycle or kill as it says."""
        slot = finding.slot
        where = {"slot": slot.name, "pid": slot.pid} if slot is not None else {}
        log.warning("monitor_fired", monitor=finding.monitor, action=finding.action.value, **where, **finding.detail)
        if slot is None:
            return
        slot.last_event = {"monitor": finding.monitor, "action": finding.action.value, **finding.detail}
        if finding.action is Action.KILL:
            slot.kill(f"monitor {finding.monitor}")
        elif finding.action is Action.RECYCLE and not self.rollout.involves(slot):
            self.rollout.enqueue(Replacement(slot, slot.model, slot.assignment, f"monitor {finding.monitor}"))

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
        self.rollout.queue.clear()
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
            self.broker.fail_all(
                ErrorCode.SHUTTING_DOWN, "the daemon stopped before this request could finish", self.all_slots()
            )
        if self.kill_deadline is None:
            self.kill_deadline = now + _STOP_KILL_AFTER_S
            for slot in self.all_slots():
                if slot.state in (SlotState.SERVING, SlotState.DRAINING):
                    self.broker.send_control(slot, wm.Stop())
                    slot.transition(SlotState.STOPPING, "supervisor stopping")
                elif slot.state is SlotState.STARTING:
                    # Still loading, not connected yet: a STOP could not reach it, so do not wait for one.
                    slot.transition(SlotState.STOPPING, "supervisor stopping")
                    slot.kill("stopped while starting")
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
            self.broker.forget(slot)
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
        if name == "restart":
            model = command.get("model")
            if model is not None and model not in self.slots:
                return {"ok": False, "error": f"no model {str(model)[:128]!r}; serving {sorted(self.slots)}"}
            return {"ok": True, "queued": self.restart(model, "operator command")}
        if name in ("reload", "restart") and self.stopping:
            return {"ok": False, "error": "the daemon is stopping"}
        if name == "profile":
            model, requests = command.get("model"), command.get("requests", 50)
            if not isinstance(model, str) or type(requests) is not int or not 1 <= requests <= 10_000:
                return {"ok": False, "error": "profile needs model (a string) and requests (1..10000)"}
            return self.start_profile(model, requests)
        if name == "reload":
            self.reload_reason = "operator command"
            return {"ok": True, "note": "reload queued; see `infervisor status` for the result"}
        known = "status, ping, restart, reload, profile"
        return {"ok": False, "error": f"unknown command {str(name)[:64]!r}; known: {known}"}
