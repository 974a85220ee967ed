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

from infervisor.supervisor.core.assembly import Parts, assemble
from infervisor.supervisor.core.control import ControlServer, status_server
from infervisor.supervisor.core.control_commands import dispatch
from infervisor.supervisor.host.event_loop import CONTROL
from infervisor.supervisor.lifecycle.exits import keep_gateway
from infervisor.supervisor.monitors.memory import rss_now
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.observe import status
from infervisor.supervisor.observe.capture import Figures, take_snapshot
from infervisor.supervisor.observe.snapshot import Snapshot
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.workers.gateway_process import GatewayProcess
from infervisor.supervisor.workers.health import daemon_state, status_line
from infervisor.supervisor.workers.launcher import Launcher, launch_worker

log = structlog.get_logger("supervisor")

#: How often timers (reaping, hang checks, deadlines, heartbeats) run, at most.
_HOUSEKEEPING_S = 0.02
_HOUSEKEEPING_MS = int(_HOUSEKEEPING_S * 1000)


class Arbiter:
    """Runs the loop over the daemon's parts (wired by core/assembly.py); answers control commands."""

    def __init__(
        self,
        config: Config,
        config_path: Path,
        runtime_dir: Path,
        sysfs_root: Path = Path("/sys"),
        launcher: Launcher = launch_worker,
        source_dir: Path | None = None,
    ) -> None:
        parts = assemble(config, config_path, runtime_dir, sysfs_root, launcher, source_dir)
        self.parts: Parts = parts
        # What control commands reach (core/control_commands.py: ControlHost), and what the loop drives most.
        self.pool, self.reloader, self.fallback = parts.pool, parts.reloader, parts.fallback
        self.broker, self.loop, self.serving = parts.broker, parts.loop, parts.serving
        # Its own context, so its own I/O thread: a flood of commands cannot delay the request sockets' I/O.
        self.control_context: zmq.Context[Any] = zmq.Context(1)
        self.control = ControlServer(self.control_context, runtime_dir, parts.anomalies)
        self.loop.register(self.control.socket, CONTROL, lambda flags: self.control.handle(self.control_command))
        # With a socket_group its members get the read-only commands on status.sock; control.sock stays ours.
        self.status_server = status_server(self.control_context, runtime_dir, parts.anomalies, config.socket_group)
        if (reader := self.status_server) is not None:
            self.loop.register(reader.socket, CONTROL, lambda flags: reader.handle(self.control_command))
        # The OIP gateway (config `oip`): a child process that is a client of the broker's ipc endpoint.
        self.gateway = GatewayProcess(runtime_dir, parts.endpoints.ipc_endpoint, self.pool.children)
        self.signals: collections.deque[int] = collections.deque()
        self.exit_code = 0
        self.next_housekeeping = 0.0
        self.next_monitor = 0.0

    @property
    def config(self) -> Config:
        """The config the daemon serves with now."""
        return self.serving.current

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
                    self.pool.stop.hurry()
                else:
                    self.begin_stop(f"signal {signal.Signals(signum).name}")
            elif signum == signal.SIGHUP:
                self.reloader.request("SIGHUP")

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Spawn the pools and serve until stopped; returns the process exit code."""
        parts = self.parts
        self.install_signal_handlers()
        log.info(
            "supervisor_starting",
            pid=os.getpid(),
            runtime_dir=str(parts.runtime_dir),
            endpoint=parts.endpoints.ipc_endpoint,
            tcp_endpoint=self.config.tcp_endpoint,
            config=str(self.reloader.config_path),
            config_digest=self.config.digest,
            plan={s.name: list(s.assignment.cpus) for s in self.pool.roster.all_slots()},
        )
        try:
            # Inside the try: whatever fails here, the workers already spawned are killed and reaped.
            self.publish_metrics()
            # Before the first worker, so every worker is a fork of it (it imports what they would).
            parts.home.open(self.config.warm_template)
            if self.config.metrics_listen is not None:
                parts.metrics.listen(self.config.metrics_listen)
            self.pool.start()
            self.reloader.watch_files()
            parts.watcher.start()
            while not self.pool.stop.finished():
                self.loop.poll(self.wait_ms())
                self.handle_signals()
                now = time.monotonic()
                if self.broker.dispatcher.batch_due:
                    self.broker.dispatcher.dispatch_due(now)
                # Every turn (at least every housekeeping interval): a request's arrival and its answer move the gate.
                self.pool.builds.gate(now, self.broker.unanswered > 0)
                if now >= self.next_housekeeping:
                    self.next_housekeeping = now + _HOUSEKEEPING_S
                    self.housekeeping(now)
        finally:
            parts.watcher.stop()
            self.shutdown()
            parts.cpu_latency.release("exit")
        log.info("supervisor_exit", code=self.exit_code)
        return self.exit_code

    def wait_ms(self) -> int:
        """How long the poll may wait: the housekeeping interval, or less when a batch is due sooner."""
        due = self.broker.dispatcher.next_batch_due
        if due is None:
            return _HOUSEKEEPING_MS
        # The poll's resolution is 1 ms: the nearest one, since a batch within half of it is due (batcher.is_due).
        return max(0, min(_HOUSEKEEPING_MS, round((due - time.monotonic()) * 1000)))

    def housekeeping(self, now: float) -> None:
        """The timer-driven steps, each named for what it does."""
        parts = self.parts
        parts.home.tick(now)
        self.pool.tick(now)
        self.fallback.reconcile()
        self.broker.expire(now)
        self.broker.replies.flush()
        parts.readiness.pet_watchdog(now)
        if self.pool.stop.stopping:
            return
        self.reloader.react_to_file_changes(now)
        keep_gateway(self.gateway, now, self.config)
        self.monitor(now)
        parts.affinity.reconcile((s.assignment.cpus for s in self.pool.roster.all_slots()), self.config.pin_supervisor)
        # Polling idle adds heat: a throttling box lets go of the request until it cools.
        parts.cpu_latency.reconcile(self.config.cpu_latency_us, parts.monitors.thermal.throttled)
        parts.readiness.announce(self.pool.roster, self.pool.stop.stopping)

    def monitor(self, now: float) -> None:
        """Once per monitor interval: every monitor looks at the workers; their findings are responded to."""
        if now < self.next_monitor:
            return
        config, monitors, roster = self.config, self.parts.monitors, self.pool.roster
        self.next_monitor = now + config.monitor_interval_s
        ages = {name: age for name, queue in self.broker.queues.items() if (age := queue.oldest_wait(now)) is not None}
        view = MonitorView(config, roster.serving_members(), roster.draining(), roster.live_pids(), ages)
        findings = monitors.check(now, view)
        self.pool.track_descendants()
        self.parts.memory.trim_if_grown()
        for finding in findings:
            self.parts.responses.act(finding)
        self.publish_metrics()

    def publish_metrics(self) -> Snapshot:
        """Take a snapshot and hand it to the metrics endpoint (which never reads the loop's state itself)."""
        parts = self.parts
        figures = Figures(parts.monitors.readings(self.config), self.reloader.stats, parts.anomalies.counts)
        snapshot = take_snapshot(
            self.pool, self.broker, figures, self.fallback.fallbacks, time.time(), time.monotonic()
        )
        parts.metrics.publish(snapshot)
        return snapshot

    # ---- stopping ---------------------------------------------------------------------------

    def begin_stop(self, reason: str) -> None:
        """Refuse new work; in-flight and queued requests get the grace period to finish."""
        self.broker.stop_accepting()
        self.pool.stop.begin(time.monotonic())
        self.parts.readiness.stopping()
        log.info("supervisor_stopping", reason=reason, grace_s=self.config.shutdown_grace_s)

    def shutdown(self) -> None:
        """Kill anything still alive, then close sockets so no file is left behind."""
        self.gateway.stop()
        self.parts.metrics.close()
        self.pool.audits.stop_all()
        self.pool.stop.shutdown()
        self.parts.home.close()
        self.broker.close()
        self.control.close()
        if self.status_server is not None:
            self.status_server.close()
        self.loop.close()
        self.parts.context.term()
        self.control_context.term()

    # ---- control ----------------------------------------------------------------------------

    def control_command(self, command: dict[str, Any]) -> dict[str, Any]:
        """Answer one control-socket command (the table is infervisor/supervisor/core/control_commands.py)."""
        return dispatch(self, command)

    def metrics_text(self) -> str:
        """The Prometheus text of this turn's figures, which the HTTP endpoint then shows too."""
        self.publish_metrics()
        return self.parts.metrics.render()

    def start_profile(self, model: str, requests: int) -> dict[str, Any]:
        """Ask one serving worker of `model` to profile its next requests; the report appears in its status."""
        return self.parts.responses.start_profile(model, requests)

    def status(self) -> dict[str, Any]:
        """Everything an operator asks first: who serves what, where, how fast, and what went wrong.

        The snapshot it renders is the one the metrics then show too.
        """
        config, parts = self.config, self.parts
        snapshot = self.publish_metrics()
        reports = snapshot.reports()
        state = daemon_state(reports, parts.readiness.announced, snapshot.stopping)
        document = {
            "ok": True,
            "pid": os.getpid(),
            "state": state.value,
            "status": status_line(reports, state),
            "uptime_s": round(snapshot.taken_at - parts.started_at, 3),
            "rss": rss_now(os.getpid()),
            "cpus": sorted(parts.affinity.current),
            "cpu_latency": parts.cpu_latency.status(config.cpu_latency_us),
            "config": {
                **self.reloader.status(),
                "models": status.config_states(snapshot),
            },
            "limits": status.limits(config),
            "rollout": status.rollout_status(snapshot),
            "endpoints": {
                "client": parts.endpoints.ipc_endpoint,
                "tcp": config.tcp_endpoint,
                "metrics": parts.metrics.url,
                "metrics_error": parts.metrics.error,
                "oip": self.gateway.status(),
            },
            "counters": dict(snapshot.anomalies),
            "template": parts.home.status(),
        }
        # Each monitor's readings about the box under its name (the thermal monitor's: `thermal`), then the models.
        return (
            document | status.box_readings(snapshot, {*document, "models"}) | {"models": status.models_status(snapshot)}
        )
