"""Live config: config.json re-read on a change, SIGHUP or `infervisor reload`, validated, planned and diffed.

A bad file changes nothing and says why. A good one is applied by its difference: live keys at
once, added, removed and scaled models at once, a model whose workers must be rebuilt by a rolling
replacement that keeps its old config serving until the new workers are READY (infervisor/supervisor/lifecycle/pool.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from infervisor.supervisor.host.file_watch import FileWatcher
from infervisor.supervisor.host.logs import configure_logging
from infervisor.supervisor.host.planner import Assignment, PlanError
from infervisor.supervisor.host.sd_notify import Notifier
from infervisor.supervisor.host.topology import TopologyError
from infervisor.supervisor.instruments.recorders import ReloadOutcome, ReloadStats
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.settings.config import Config, ConfigError, load_config
from infervisor.supervisor.settings.config_diff import ConfigDiff, diff_configs, held_back
from infervisor.supervisor.settings.fallback import Fallbacks
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import RestartReason

log = structlog.get_logger("supervisor")

#: The file watcher's key for config.json (model files are keyed by model name).
_CONFIG_KEY = "\0config"

#: Cores per model for a config (the arbiter's planner over the topology and the cpus given at start).
Planner = Callable[[Config], dict[str, list[Assignment]]]


class ConfigReloader:
    """Owns the config file's path, its watcher and what the last reloads did."""

    def __init__(
        self,
        config_path: Path,
        serving: ServingConfig,
        pool: WorkerPool,
        plan: Planner,
        watcher: FileWatcher,
        notifier: Notifier,
        started_at: float,
        fallbacks: Fallbacks,
        status_line: Callable[[], str],
        source_dir: Path | None = None,
    ) -> None:
        self.config_path = config_path
        #: Where the config's relative files and python modules are found (None: the config's own folder).
        self.source_dir = source_dir
        self.serving = serving
        self.pool = pool
        self.plan = plan
        self.watcher = watcher
        self.notifier = notifier
        #: A fallback in force stays in force through a reload that keeps the model's chain.
        self.fallbacks = fallbacks
        #: Why a reload is due (a file change, SIGHUP, a command that came mid drain-first step), if one is.
        self.requested: str | None = None
        self.applied_at = time.time()
        #: The problems of the last refused file, None once one is accepted.
        self.error: list[str] | None = None
        #: How many configs have been applied since start (the first one is 0).
        self.generation = 0
        self.last_diff: dict[str, object] = {}
        self.stats = ReloadStats(last_success_at=started_at)
        #: The daemon's STATUS= line now (core/readiness.py keeps it), sent again with READY=1 after a reload.
        self.status_line = status_line

    def watch_files(self) -> None:
        """Watch config.json and every model file (a changed file restarts its model, rolling)."""
        files = {_CONFIG_KEY: self.config_path}
        for name, model in self.serving.current.models.items():
            if model.source.path is not None:
                files[name] = Path(model.source.path)
        self.watcher.watch(files)

    def react_to_file_changes(self, now: float) -> None:
        """A changed config.json is reloaded; a changed model file restarts its model, rolling."""
        for key in self.watcher.due(now):
            if key == _CONFIG_KEY:
                self.requested = self.requested or "config file changed"
            elif key in self.pool.roster.members:
                self.pool.restart(key, "model file changed on disk", RestartReason.MODEL_FILE)
        # A drain-first step has taken a worker out of its pool and its replacement does not serve yet:
        # re-planning the pool now would see a hole (or a half-built slot) and fill it twice. The reload
        # waits for the step to end, as docs/protocol.md section 9 says.
        if self.requested is not None and not self.pool.rollout.drain_step_under_way:
            reason, self.requested = self.requested, None
            self.reload(reason)

    def request(self, why: str) -> None:
        """Reload at the next turn (SIGHUP), or once the drain-first step under way has ended."""
        self.requested = why

    def command(self) -> dict[str, Any]:
        """`infervisor reload`: now, or once the drain-first step under way has ended (replacement serves/failed)."""
        if self.pool.rollout.drain_step_under_way:
            self.requested = "operator command"
            return {"ok": True, "queued": True, "generation": self.generation}
        return self.reload("operator command")

    def reload(self, reason: str) -> dict[str, Any]:
        """Read config.json again; a bad file changes nothing, a good one is applied by its diff.

        Returns the outcome as the control socket answers it.
        """
        self.notifier.reloading()
        current = self.serving.current
        try:
            read = load_config(self.config_path, self.source_dir)
            new = self.fallbacks.overlay(read)
            diff = diff_configs(current, new)
            if diff.needs_daemon_restart:
                # Bound into sockets at start: keep the running values, say what needs a restart.
                kept = {key: getattr(current, key) for key in diff.needs_daemon_restart}
                new = dataclasses.replace(new, **kept)
                log.warning("config_needs_daemon_restart", keys=diff.needs_daemon_restart)
            plan = self.plan(new)
        except ConfigError as exc:
            return self.reject(reason, exc.problems)
        except (PlanError, TopologyError) as exc:
            return self.reject(reason, [f"models: {exc}"])
        self.error = None
        self.fallbacks.end_stale(read)
        self.stats.record(ReloadOutcome.SUCCESS, time.time())
        self.last_diff = diff.summary()
        if diff.empty and new.digest == current.digest:
            log.info("config_unchanged", reason=reason)
        else:
            self.apply(new, plan, diff)
            log.info("config_applied", reason=reason, digest=new.digest, diff=self.last_diff)
        self.notifier.ready(self.status_line() or f"config {new.digest} applied")
        # Every model still moving to a new config, whichever reload started it: what `infervisor reload` waits for.
        rolling = self.serving.rolling()
        return {"ok": True, "generation": self.generation, "diff": self.last_diff, "rolling": rolling}

    def reject(self, reason: str, problems: list[str]) -> dict[str, Any]:
        """Keep serving with the last good config and say why the new one was refused."""
        self.error = problems
        self.stats.record(ReloadOutcome.FAILURE, time.time())
        digest = self.serving.current.digest
        log.error("config_rejected", reason=reason, problems=problems, serving_digest=digest)
        self.notifier.ready(self.status_line() or f"config rejected; still serving {digest}")
        return {"ok": False, "error": "config rejected; nothing changed", "problems": problems}

    def apply(self, new: Config, plan: dict[str, list[Assignment]], diff: ConfigDiff) -> None:
        """Serve with a validated config: one snapshot replaced whole, then the pools reshaped by its diff.

        A model whose workers must be rebuilt keeps serving with its old build keys (admission
        included) until every worker has been replaced and is READY; the new config is its target.
        """
        old = self.serving.current
        held = {name: held_back(old.models[name], new.models[name]) for name in diff.rolling}
        self.serving.replace(dataclasses.replace(new, models={**new.models, **held}))
        for name in diff.rolling:
            self.serving.begin_rollout(new.models[name])
        for name in diff.removed:
            self.serving.drop_rollout(name)
        self.generation += 1
        self.applied_at = time.time()
        if "log_level" in diff.live:
            configure_logging(new.log_level)
        self.pool.adopt(new, plan, diff)
        self.watch_files()

    def status(self) -> dict[str, Any]:
        """The `config` section of the status document (the pool adds each model's rollout state)."""
        return {
            "path": str(self.config_path),
            "digest": self.serving.current.digest,
            "applied_at": self.applied_at,
            "generation": self.generation,
            "last_error": self.error,
            "last_diff": self.last_diff,
        }
