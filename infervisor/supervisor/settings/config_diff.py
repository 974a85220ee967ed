"""What a new config.json changes, sorted by how each key's declaration says it is applied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from infervisor.supervisor.settings.config import TOP_KEYS, Config
from infervisor.supervisor.settings.config_keys import Applied, Key
from infervisor.supervisor.settings.model_entry import MODEL_KEYS, ModelConfig

#: The rules diff_configs has for each level; a key declared with another rule would be ignored on reload.
_TOP_RULES = frozenset({Applied.LIVE, Applied.ROLLING, Applied.DAEMON_RESTART, Applied.PER_MODEL})
_MODEL_RULES = frozenset({Applied.LIVE, Applied.ROLLING, Applied.SCALED})
#: Fields that are not keys: the model's name is its key in `models`, the digest is computed from the text.
_DERIVED = frozenset({"name", "digest"})


def _names(keys: Sequence[Key], applied: Applied) -> frozenset[str]:
    return frozenset(key.name for key in keys if key.applied is applied)


_LIVE = _names(TOP_KEYS, Applied.LIVE)
#: Every worker was launched with these: a change restarts every model, rolling.
_WORKER = _names(TOP_KEYS, Applied.ROLLING)
_DAEMON = _names(TOP_KEYS, Applied.DAEMON_RESTART)
_MODEL_LIVE = _names(MODEL_KEYS, Applied.LIVE)
_MODEL_ROLLING = _names(MODEL_KEYS, Applied.ROLLING)


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
        live=_changed(old, new, _LIVE),
        needs_daemon_restart=_changed(old, new, _DAEMON),
        added=sorted(set(new.models) - set(old.models)),
        removed=sorted(set(old.models) - set(new.models)),
    )
    worker_keys = _changed(old, new, _WORKER)
    for name in sorted(set(old.models) & set(new.models)):
        before, after = old.models[name], new.models[name]
        live = _changed(before, after, _MODEL_LIVE)
        rolling = _changed(before, after, _MODEL_ROLLING) + worker_keys
        if live:
            diff.model_live[name] = live
        if rolling:
            diff.rolling[name] = rolling
        if before.workers != after.workers:
            diff.scaled[name] = (before.workers, after.workers)
    return diff


def held_back(old: ModelConfig, new: ModelConfig) -> ModelConfig:
    """`new` with the build keys of `old`: what a model serves with until its workers are rebuilt for `new`.

    Live keys (queue size, retries, monitor limits) apply at once; the keys a worker is built from
    (source, inputs, profiles, ...) change only when the model's rollout has finished.
    """
    return replace(new, **{name: getattr(old, name) for name in _MODEL_ROLLING})


def builds_differ(old: ModelConfig, new: ModelConfig) -> bool:
    """True when a worker built from `old` is not what `new` asks for (some key it is built from differs)."""
    return any(getattr(old, name) != getattr(new, name) for name in _MODEL_ROLLING)


def worker_keys_changed(diff: ConfigDiff, model: str) -> bool:
    """True when the reload changed a top-level key every worker was launched with (heartbeats, cache_dir)."""
    return any(key not in _MODEL_ROLLING for key in diff.rolling.get(model, ()))


def unclassified_keys() -> set[str]:
    """Keys a reload could ignore: declared with a rule diff_configs lacks at their level, or fields undeclared."""
    top = {key.name for key in TOP_KEYS if key.applied not in _TOP_RULES}
    model = {key.name for key in MODEL_KEYS if key.applied not in _MODEL_RULES}
    # A field no declaration reads (or a declaration without a field) would also fail every parse.
    top |= ({f.name for f in fields(Config)} - _DERIVED) ^ {key.name for key in TOP_KEYS}
    model |= ({f.name for f in fields(ModelConfig)} - _DERIVED) ^ {key.name for key in MODEL_KEYS}
    return top | model
