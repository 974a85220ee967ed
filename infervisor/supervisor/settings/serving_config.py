"""The one config the daemon serves with: an immutable snapshot every part reads, replaced whole by a reload.

A reload that rebuilds a model's workers does not change what that model serves with until its
rollout has finished: until then the model keeps its old build keys (its spec, its profiles) in
`current`, and the config it is moving to is its rollout target. A rollout that fails drops the
target and keeps why, until the model's next rollout begins.

`ServingConfig` is the only writer of the targets and of those errors: the reloader and the fallback
begin rollouts, the pool finishes, fails or drops them, and everyone else reads.
"""

from __future__ import annotations

import dataclasses

from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig


class ServingConfig:
    """Holds the current `Config`, the per-model rollout targets, and why the last rollouts failed."""

    def __init__(self, config: Config) -> None:
        self.current = config
        self._targets: dict[str, ModelConfig] = {}
        self._errors: dict[str, str] = {}
        #: Models whose replacement failed with no config change to undo (a model file broke on disk): the
        #: workers serving now cannot be replaced until the file loads again, so the model is degraded.
        self._held_up: dict[str, str] = {}

    def replace(self, config: Config) -> None:
        """Serve with `config` from now on (a validated, diffed, planned config)."""
        self.current = config

    def model(self, name: str) -> ModelConfig | None:
        """The serving config of one model, or None once it left the config."""
        return self.current.models.get(name)

    def desired(self, name: str) -> ModelConfig | None:
        """What a model's workers are to be built from: its rollout target, else what it serves with."""
        return self._targets.get(name) or self.current.models.get(name)

    # ---- rollouts ---------------------------------------------------------------------------

    def begin_rollout(self, target: ModelConfig) -> None:
        """Build the model's workers from `target` from now on; it serves with it once every worker is rebuilt.

        An older rollout's failure is not this one's: it is forgotten.
        """
        self._targets[target.name] = target
        self._errors.pop(target.name, None)
        self._held_up.pop(target.name, None)

    def finish_rollout(self, name: str) -> None:
        """Every worker of the model is built from its target: serve with it."""
        target = self._targets.pop(name, None)
        if target is not None:
            self.current = dataclasses.replace(self.current, models={**self.current.models, name: target})

    def fail_rollout(self, name: str, error: str) -> ModelConfig | None:
        """Drop the model's target and keep why; returns the target dropped (None: it had none, or left the config)."""
        target = self._targets.pop(name, None)
        if name not in self.current.models:
            return None
        self._errors[name] = error
        if target is None:
            self._held_up[name] = error
        return target

    def replacement_done(self, name: str) -> None:
        """A worker of the model was replaced with one that serves: what it is built from loads again."""
        if self._held_up.pop(name, None) is not None:
            self._errors.pop(name, None)

    def held_up(self, name: str) -> str | None:
        """Why the model's serving workers cannot be replaced now (its model file fails to load), else None."""
        return self._held_up.get(name)

    def drop_rollout(self, name: str) -> None:
        """The model left the config: forget its target."""
        self._targets.pop(name, None)
        self._held_up.pop(name, None)

    def target(self, name: str) -> ModelConfig | None:
        """The config the model is rolling out to, or None when it serves what it is built from."""
        return self._targets.get(name)

    def rolling(self) -> list[str]:
        """The models still moving to a new config, by name."""
        return sorted(self._targets)

    def rollout_error(self, name: str) -> str | None:
        """Why the model's last rollout failed, until its next one begins."""
        return self._errors.get(name)
