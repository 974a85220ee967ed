"""Which config.json a command uses: one chain for serve, demo, doctor, optimize and report alike.

An explicit --config wins; else $INFERVISOR_CONFIG; else /etc/infervisor/config.json when it exists (where the
systemd unit reads it); else the shipped configs/default.json, found beside the installed package rather than in
the current directory, so a command gives the same answer from wherever it is run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: The environment variable that names the config when --config is not given.
CONFIG_ENV = "INFERVISOR_CONFIG"
#: Where a box's config lives (docs/deploy.md, systemd/infervisor.service).
ETC_CONFIG = Path("/etc/infervisor/config.json")
#: The default config of this source tree: a checkout or an editable install has it one level above the package.
SHIPPED_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "default.json"


class ConfigPathError(Exception):
    """No config was named and none of the default places has one."""


@dataclass(frozen=True)
class ConfigChoice:
    """The config file a command uses and why that one."""

    path: Path
    #: "--config", "$INFERVISOR_CONFIG", "/etc/infervisor/config.json" or "shipped default".
    source: str

    def describe(self) -> str:
        """`PATH (from SOURCE)`, for a command's first line or its error message."""
        return f"{self.path} (from {self.source})"


def resolve_config_path(
    explicit: str | None, etc_config: Path = ETC_CONFIG, shipped: Path = SHIPPED_CONFIG
) -> ConfigChoice:
    """The config a command should load; an explicit or environment path is used as given, even if missing.

    Made absolute but not resolved: a ConfigMap's config.json is a symlink into a folder the kubelet
    deletes on the next update, so the daemon must keep re-reading the path it was given.
    """
    if explicit:
        return ConfigChoice(Path(explicit).absolute(), "--config")
    from_env = os.environ.get(CONFIG_ENV)
    if from_env:
        return ConfigChoice(Path(from_env).absolute(), f"${CONFIG_ENV}")
    if etc_config.is_file():
        return ConfigChoice(etc_config, str(etc_config))
    if shipped.is_file():
        return ConfigChoice(shipped, "shipped default")
    raise ConfigPathError(
        f"no config: pass --config PATH, set ${CONFIG_ENV}, or install one at {etc_config} "
        f"(the shipped default {shipped} is not in this installation)"
    )
