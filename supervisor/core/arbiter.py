"""The supervisor's main loop: poll and dispatch, act on queued signals, tick the pool, run the monitors.

Signal handlers only queue the signal. Each turn the event loop runs the handlers of whatever fired
(worker links, client sockets, the control socket); then, at most every housekeeping interval, the
pool reconciles toward the configured shape and the monitors look at the workers.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path
from typing import Any

import structlog
import zmq

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.core.control import ControlServer, status_server
from infervisor.supervisor.core.control_commands import dispatch
from infervisor.supervisor.core.event_loop import CONTROL, EventLoop
from infervisor.supervisor.core.fallback_control import FallbackControl
from infervisor.supervisor.core.reloader import ConfigReloader
from infervisor.supervisor.host.affinity import SupervisorAffinity
from infervisor.supervisor.host.cpu_latency import CpuLatencyHold
from infervisor.supervisor.host.file_watch import FileWatcher
from infervisor.supervisor.host.planner import Assignment, WorkerDemand, plan_cores
from infervisor.supervisor.host.sd_notify import Notifier
from infervisor.supervisor.host.topology import read_topology
from infervisor.supervisor.lifecycle.launcher import Launcher, launch_worker
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.lifecycle.slot import RestartReason, SlotState, WorkerSlot
from infervisor.supervisor.lifecycle.worker_inbox import WorkerInbox
from infervisor.supervisor.lifecycle.worker_links import WorkerLinks
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.registry import build_monitors
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.observe import status
from infervisor.supervisor.observe.anomalies import Anomalies
from infervisor.supervisor.observe.capture import Readings, take_snapshot
from infervisor.supervisor.observe.exposition import Metrics
from infervisor.supervisor.observe.health import DaemonState, daemon_state, ready_to_announce, status_line
from infervisor.supervisor.observe.snapshot import Snapshot
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.routing.endpoints import ClientEndpoints
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.serving_config import ServingConfig

log = structlog.get_logger("supervisor")

#: How often timers (reaping, hang checks, deadlines, heartbeats) run, at most.
_HOUSEKEEPING_S = 0.02
_HOUSEKEEPING_MS = int(_HOUSEKEEPING_S * 1000)


class Arbiter:
    """Composes the daemon's parts and runs the loop; reloads the config and answers control commands."""

    def __init__(
        self,
        config: Config,
        config_path: Path,
        runtime_dir: Path,
        sysfs_root: Path = Path("/sys"),
        launcher: Launcher = launch_worker,
    ) -> None:
        self.runtime_dir = runtime_dir
        self.sysfs_root = sysfs_root
        self.started_at = time.time()
        self.serving = ServingConfig(config)
        self.affinity = SupervisorAffinity(frozenset(os.sched_getaffinity(0)))
        plan = self.plan(config)
        self.context: zmq.Context[Any] = zmq.Context(1)
        self.loop = EventLoop()
        self.anomalies = Anomalies()
        self.endpoints = ClientEndpoints(self.context, config, runtime_dir)
        self.links = WorkerLinks(self.loop, self.anomalies)
        self.broker = Broker(self.endpoints, self.loop, self.links, self.serving, self.anomalies)
        self.pool = WorkerPool(self.serving, plan, self.links, self.broker, launcher)
        # Its own context, so its own I/O thread: a flood of commands cannot delay the request sockets' I/O.
        self.control_context: zmq.Context[Any] = zmq.Context(1)
        self.control = ControlServer(self.control_context, runtime_dir, self.anomalies)
        self.loop.register(self.control.socket, CONTROL, lambda flags: self.control.handle(self.control_command))
        # With a socket_group its members get the read-only commands on status.sock; control.sock stays ours.
        self.status_server = status_server(self.control_context, runtime_dir, self.anomalies, config.socket_group)
        if (reader := self.status_server) is not None:
            self.loop.register(reader.socket, CONTROL, lambda flags: reader.handle(self.control_command))
        self.notifier = Notifier()
        self.cpu_latency = CpuLatencyHold()
        self.watcher = FileWatcher(self.loop.wake)
        #: Built from the table (supervisor/monitors/registry.py): adding a monitor is one file and one entry there.
        self.monitors = build_monitors()
        # Each worker message goes straight to its owner; a link that lost its framing, to the pool.
        self.inbox = WorkerInbox(self.anomalies, self.broker, self.pool, self.judge_canary)
        self.links.deliver_to(self.inbox.deliver, self.pool.link_broken)
        #: Models moved down their chain (`infervisor fallback`, repeated canary mismatches).
        self.fallback = FallbackControl(self.serving, self.pool)
        self.signals: collections.deque[int] = collections.deque()
        self.reloader = ConfigReloader(
            config_path, self.serving, self.pool, self.plan, self.watcher, self.notifier, self.started_at,
            self.fallback.fallbacks, lambda: self.status_line,
        )  # fmt: skip
        #: Published each monitor turn; served over HTTP only with metrics_listen, and by `infervisor metrics`.
        self.metrics = Metrics()
        self.announced_ready = False
        self.state = DaemonState.STARTING
        #: The last STATUS= line sent to systemd (sent again only when it changes).
        self.status_line = ""
        self.exit_code = 0
        #: Every slot of every model has failed (logged once per time it happens).
        self.all_failed_logged = False
        self.next_housekeeping = 0.0
        self.next_monitor = 0.0
        self.watchdog_every = self.notifier.watchdog_interval()
        self.next_watchdog = 0.0
        #: Sequence numbers of canary and profile requests, so an answer matches its question.
        self.probe_seq = 0

    @property
    def config(self) -> Config:
        """The config the daemon serves with now."""
        return self.serving.current

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

    # ---- signals ----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Handlers only queue the signal; the wake-up fd makes the poll return at once."""
        signal.set_wakeup_fd(self.loop.wake_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._queue_signal)

    def _queue_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def handle_signals(self) -> None:
        """Act on queued signals in the main loop."""
        while self.signals:
            signum = self.signals.popleft()
            if signum in (signal.SIGTERM, signal.SIGINT):
                if self.pool.stop.stopping:
                    log.warning("stop_forced", signal=signal.Signals(signum).name)
                    self.pool.stop.deadline = 0.0
                else:
                    self.begin_stop(f"signal {signal.Signals(signum).name}")
            elif signum == signal.SIGHUP:
                self.reloader.requested = "SIGHUP"

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Spawn the pools and serve until stopped; returns the process exit code."""
        self.install_signal_handlers()
        log.info(
            "supervisor_starting",
            pid=os.getpid(),
            runtime_dir=str(self.runtime_dir),
            endpoint=self.endpoints.ipc_endpoint,
            tcp_endpoint=self.config.tcp_endpoint,
            config=str(self.reloader.config_path),
            config_digest=self.config.digest,
            plan={s.name: list(s.assignment.cpus) for s in self.pool.roster.all_slots()},
        )
        try:
            # Inside the try: whatever fails here, the workers already spawned are killed and reaped.
            self.publish_metrics()
            if self.config.metrics_listen is not None:
                self.metrics.listen(self.config.metrics_listen)
            self.pool.start()
            self.reloader.watch_files()
            self.watcher.start()
            while not self.pool.stop.finished():
                self.loop.poll(self.wait_ms())
                self.handle_signals()
                now = time.monotonic()
                if self.broker.batch_due:
                    self.broker.dispatch_due(now)
                if now >= self.next_housekeeping:
                    self.next_housekeeping = now + _HOUSEKEEPING_S
                    self.housekeeping(now)
        finally:
            self.watcher.stop()
            self.shutdown()
            self.cpu_latency.release("exit")
        log.info("supervisor_exit", code=self.exit_code)
        return self.exit_code

    def wait_ms(self) -> int:
        """How long the poll may wait: the housekeeping interval, or less when a batch is due sooner."""
        due = self.broker.next_batch_due
        if due is None:
            return _HOUSEKEEPING_MS
        # The poll's resolution is 1 ms: the nearest one, since a batch within half of it is due (batcher.is_due).
        return max(0, min(_HOUSEKEEPING_MS, round((due - time.monotonic()) * 1000)))

    def housekeeping(self, now: float) -> None:
        """The timer-driven steps, each named for what it does."""
        self.pool.tick(now)
        self.fallback.reconcile()
        self.broker.expire(now)
        self.broker.replies.flush()
        self.pet_watchdog(now)
        if self.pool.stop.stopping:
            return
        self.reloader.react_to_file_changes(now)
        self.monitor(now)
        if self.pool.roster.all_failed() != self.all_failed_logged:
            # The daemon stays up, state down, with each model's reason in status: a fixed config.json is
            # reloaded without a restart (systemd would only retry the same config up to its start limit).
            self.all_failed_logged = not self.all_failed_logged
            if self.all_failed_logged:
                log.error(
                    "all_workers_failed", reason="every slot of every model failed; down until a reload or restart"
                )
        self.affinity.reconcile((s.assignment.cpus for s in self.pool.roster.all_slots()), self.config.pin_supervisor)
        # Polling idle adds heat: a throttling box lets go of the request until it cools.
        self.cpu_latency.reconcile(self.config.cpu_latency_us, self.monitors.thermal.throttled)
        self.announce_readiness()

    def pet_watchdog(self, now: float) -> None:
        """WATCHDOG=1 from this loop itself, so systemd restarts us if the broker loop stalls."""
        if self.watchdog_every is not None and now >= self.next_watchdog:
            self.next_watchdog = now + self.watchdog_every
            self.notifier.notify("WATCHDOG=1")

    def announce_readiness(self) -> None:
        """READY=1 once every model has a serving worker or has FAILED with a reason; STATUS= whenever that changes."""
        reports = self.pool.roster.reports()
        if not self.announced_ready and ready_to_announce(reports):
            self.announced_ready = True
            ready = sum(1 for s in self.pool.roster.all_slots() if s.state is SlotState.SERVING)
            log.info("supervisor_ready", workers=ready, uptime_s=round(time.time() - self.started_at, 3))
            self.status_line = status_line(reports, daemon_state(reports, True, False))
            self.notifier.ready(self.status_line)
            return
        state = daemon_state(reports, self.announced_ready, self.pool.stop.stopping)
        line = status_line(reports, state)
        if line != self.status_line:
            if state is not self.state:
                log.info("daemon_state", old=self.state.value, new=state.value, status=line)
            self.status_line = line
            self.state = state
            self.notifier.status(line)

    def judge_canary(self, slot: WorkerSlot, result: wm.CanaryResult) -> None:
        """Judge a canary: outputs on the golden inputs must still match this worker's own warm-up outputs."""
        model = self.serving.model(slot.model.name) or slot.model
        self.act(self.monitors.canaries.judge(slot, model, result, time.monotonic()))

    # ---- monitors -----------------------------------------------------------------------------

    def monitor(self, now: float) -> None:
        """Once per monitor interval: every monitor looks at the workers; the findings are acted on."""
        if now < self.next_monitor:
            return
        config = self.config
        self.next_monitor = now + config.monitor_interval_s
        view = MonitorView(
            config, self.pool.roster.serving_members(), self.pool.roster.draining(), self.pool.roster.live_pids()
        )
        findings = self.monitors.check(now, view)
        self.pool.track_descendants()
        self.broker.shed = self.monitors.thermal.throttled and config.thermal_action == "shed"
        for finding in findings:
            self.act(finding)
        self.publish_metrics()

    def publish_metrics(self) -> Snapshot:
        """Take a snapshot and hand it to the metrics endpoint (which never reads the loop's state itself)."""
        rss_mb = {pid: samples[-1][1] for pid, samples in self.monitors.memory.history.items() if samples}
        memory, reloads, anomalies = self.monitors.memory.pss_mb, self.reloader.stats, self.anomalies.counts
        readings = Readings(rss_mb, memory, self.monitors.thermal.reading, reloads, anomalies)
        snapshot = take_snapshot(
            self.pool, self.broker, readings, self.fallback.fallbacks, time.time(), time.monotonic()
        )
        self.metrics.publish(snapshot)
        return snapshot

    def act(self, finding: Finding) -> None:
        """Log a finding as data, show it in status, and probe, recycle or kill as it says."""
        slot = finding.slot
        if finding.action is Action.CANARY:
            if slot is not None:
                self.probe_seq += 1
                self.links.send_control(slot, wm.Canary(self.probe_seq))
            return
        if finding.action is not Action.RECORD:
            where = {"slot": slot.name, "pid": slot.pid} if slot is not None else {}
            action = finding.action.value
            log.warning("monitor_fired", monitor=finding.monitor, action=action, **where, **finding.detail)
        if slot is None:
            return
        if finding.action is Action.RECORD:
            slot.notes.last_event = {"monitor": finding.monitor, **finding.detail}
            return
        slot.notes.last_event = {"monitor": finding.monitor, "action": finding.action.value, **finding.detail}
        if finding.action is Action.KILL:
            slot.kill(f"monitor {finding.monitor}", RestartReason.MONITOR_KILL)
        elif finding.action is Action.RECYCLE:
            self.pool.recycle(slot, f"monitor {finding.monitor}")
        elif finding.action is Action.FALLBACK and self.fallback.for_finding(slot, finding):
            self.monitors.canaries.forget(slot.model.name)
        elif finding.action is Action.FALLBACK:
            self.pool.recycle(slot, f"monitor {finding.monitor}")

    # ---- stopping ---------------------------------------------------------------------------

    def begin_stop(self, reason: str) -> None:
        """Refuse new work; in-flight and queued requests get the grace period to finish."""
        self.broker.accepting = False
        self.pool.stop.begin(time.monotonic())
        self.notifier.stopping()
        log.info("supervisor_stopping", reason=reason, grace_s=self.config.shutdown_grace_s)

    def shutdown(self) -> None:
        """Kill anything still alive, then close sockets so no file is left behind."""
        self.metrics.close()
        self.pool.stop.shutdown()
        self.broker.close()
        self.control.close()
        if self.status_server is not None:
            self.status_server.close()
        self.loop.close()
        self.context.term()
        self.control_context.term()

    # ---- control ----------------------------------------------------------------------------

    def control_command(self, command: dict[str, Any]) -> dict[str, Any]:
        """Answer one control-socket command (the table is supervisor/core/control_commands.py)."""
        return dispatch(self, command)

    def metrics_text(self) -> str:
        """The Prometheus text of this turn's figures, which the HTTP endpoint then shows too."""
        self.publish_metrics()
        return self.metrics.render()

    def start_profile(self, model: str, requests: int) -> dict[str, Any]:
        """Ask one serving worker of `model` to profile its next requests; the report appears in its status."""
        serving = self.pool.roster.serving_members().get(model, [])
        if not serving:
            return {"ok": False, "error": f"model {model[:128]!r} has no serving worker"}
        self.probe_seq += 1
        slot = serving[0]
        if not self.links.send_control(slot, wm.Profile(self.probe_seq, requests)):
            return {"ok": False, "error": f"{slot.name} is not connected"}
        slot.proc.profile_started_at = time.monotonic()
        return {"ok": True, "slot": slot.assignment.slot, "pid": slot.pid, "seq": self.probe_seq}

    def status(self) -> dict[str, Any]:
        """Everything an operator asks first: who serves what, where, how fast, and what went wrong.

        The snapshot it renders is the one the metrics then show too.
        """
        config = self.config
        snapshot = self.publish_metrics()
        reports = snapshot.reports()
        state = daemon_state(reports, self.announced_ready, snapshot.stopping)
        return {
            "ok": True,
            "pid": os.getpid(),
            "state": state.value,
            "status": status_line(reports, state),
            "uptime_s": round(snapshot.taken_at - self.started_at, 3),
            "rss": status.rss_of(os.getpid()),
            "cpus": sorted(self.affinity.current),
            "cpu_latency": self.cpu_latency.status(config.cpu_latency_us),
            "config": {
                **self.reloader.status(),
                "models": status.config_states(snapshot),
            },
            "limits": status.limits(config),
            "rollout": status.rollout_status(snapshot),
            "endpoints": {
                "client": self.endpoints.ipc_endpoint,
                "tcp": config.tcp_endpoint,
                "metrics": self.metrics.url,
                "metrics_error": self.metrics.error,
            },
            "counters": dict(snapshot.anomalies),
            "thermal": {**snapshot.thermal, "shedding": snapshot.shedding},
            "models": status.models_status(snapshot),
        }
