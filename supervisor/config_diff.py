"""What a new config.json changes, sorted by how it is applied: live, by rolling restart, or not at all."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from supervisor.config import Config, ModelConfig

#: Top-level keys the running daemon adopts at once.
LIVE_KEYS = frozenset(
    {"log_level", "hang_factor", "hang_min_s", "worker_start_timeout_s", "shutdown_grace_s", "restart_window_s",
     "max_restarts", "monitor_interval_s", "thermal_sysfs_root", "thermal_action", "thermal_max_c", "pin_supervisor",
     "cpu_latency_us", "keep_warm_ms"}
)  # fmt: skip
#: Top-level keys every worker was launched with: changing them restarts every model, rolling.
WORKER_KEYS = frozenset({"heartbeat_interval_ms", "heartbeat_liveness", "cache_dir"})
#: Top-level keys bound into sockets at start: they need a restart of the daemon itself.
DAEMON_KEYS = frozenset({"runtime_dir", "tcp_endpoint", "curve", "max_frame_bytes", "oversubscribe"})
#: Model keys the broker applies at once.
MODEL_LIVE_KEYS = frozenset(
    {"queue_size", "max_retries", "prefetch", "rollout", "max_age_s", "max_requests", "recycle_jitter", "rss_soft_mb",
     "rss_hard_mb", "leak_mb_per_min", "leak_window_s", "drift_factor", "drift_window", "canary_interval_s",
     "canary_tolerance"}
)  # fmt: skip
#: Model keys a worker is built from: changing one replaces that model's workers, one at a time.
MODEL_ROLLING_KEYS = frozenset(
    {
        "source",
        "inputs",
        "outputs",
        "threads",
        "cores_per_worker",
        "use_smt",
        "warmup_iterations",
        "max_memory_mb",
        "profiles",
        "pick",
        "tolerance",
        "channels_last",
        "calibration",
        "validation",
    }
)
_IGNORED = frozenset({"models", "digest", "name", "workers"})


@dataclass
class ConfigDiff:
    """The changes from one valid config to the next."""

    live: list[str] = field(default_factory=list)
    needs_daemon_restart: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    model_live: dict[str, list[str]] = field(default_factory=dict)
    rolling: dict[str, list[str]] = field(default_factory=dict)
    scaled: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """True when nothing at all changed."""
        return not any(getattr(self, f.name) for f in fields(self))

    def summary(self) -> dict[str, object]:
        """The non-empty parts, for logs and status."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


def _changed(old: object, new: object, names: frozenset[str]) -> list[str]:
    return sorted(name for name in names if getattr(old, name) != getattr(new, name))


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    """Classify every difference between two validated configs."""
    diff = ConfigDiff(
        live=_changed(old, new, LIVE_KEYS),
        needs_daemon_restart=_changed(old, new, DAEMON_KEYS),
        added=sorted(set(new.models) - set(old.models)),
        removed=sorted(set(old.models) - set(new.models)),
    )
    worker_keys = _changed(old, new, WORKER_KEYS)
    for name in sorted(set(old.models) & set(new.models)):
        before, after = old.models[name], new.models[name]
        live = _changed(before, after, MODEL_LIVE_KEYS)
        rolling = _changed(before, after, MODEL_ROLLING_KEYS) + worker_keys
        if live:
            diff.model_live[name] = live
        if rolling:
            diff.rolling[name] = rolling
        if before.workers != after.workers:
            diff.scaled[name] = (before.workers, after.workers)
    return diff


def unclassified_keys() -> set[str]:
    """Config fields without a reload rule; a test keeps this empty so no key is silently ignored on reload."""
    top = {f.name for f in fields(Config)} - _IGNORED - LIVE_KEYS - WORKER_KEYS - DAEMON_KEYS
    model = {f.name for f in fields(ModelConfig)} - _IGNORED - MODEL_LIVE_KEYS - MODEL_ROLLING_KEYS
    return top | model
