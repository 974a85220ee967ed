"""The one config the daemon serves with: an immutable snapshot every part reads, replaced whole by a reload."""

from __future__ import annotations

from supervisor.config import Config, ModelConfig


class ServingConfig:
    """Holds the current `Config`; the arbiter alone replaces it, the broker, pool and monitors read it."""

    def __init__(self, config: Config) -> None:
        self.current = config

    def replace(self, config: Config) -> None:
        """Serve with `config` from now on (a validated, diffed, planned config)."""
        self.current = config

    def model(self, name: str) -> ModelConfig | None:
        """The serving config of one model, or None once it left the config."""
        return self.current.models.get(name)
