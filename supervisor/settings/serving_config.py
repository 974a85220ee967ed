"""The one config the daemon serves with: an immutable snapshot every part reads, replaced whole by a reload.

A reload that rebuilds a model's workers does not change what that model serves with until its
rollout has finished: until then the model keeps its old build keys (its spec, its profiles) in
`current`, and the config it is moving to is its `target`. A rollout that fails drops the target.
"""

from __future__ import annotations

import dataclasses

from infervisor.supervisor.settings.config import Config, ModelConfig


class ServingConfig:
    """Holds the current `Config` and the per-model rollout targets; the arbiter and the pool replace them."""

    def __init__(self, config: Config) -> None:
        self.current = config
        self.targets: dict[str, ModelConfig] = {}

    def replace(self, config: Config) -> None:
        """Serve with `config` from now on (a validated, diffed, planned config)."""
        self.current = config

    def model(self, name: str) -> ModelConfig | None:
        """The serving config of one model, or None once it left the config."""
        return self.current.models.get(name)

    def desired(self, name: str) -> ModelConfig | None:
        """What a model's workers are to be built from: its rollout target, else what it serves with."""
        return self.targets.get(name) or self.current.models.get(name)

    def set_model(self, model: ModelConfig) -> None:
        """Serve one model with `model` (its rollout finished)."""
        self.current = dataclasses.replace(self.current, models={**self.current.models, model.name: model})
