"""Where compiled model packages are kept between restarts, chosen like a systemd service would."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$CACHE_DIRECTORY, else /var/cache/infervisor when writable, else $XDG_CACHE_HOME or ~/.cache, /infervisor."""
    from_systemd = os.environ.get("CACHE_DIRECTORY")
    if from_systemd:
        # systemd may pass several colon-separated directories; the first is ours.
        return Path(from_systemd.split(":")[0])
    var_cache = Path("/var/cache")
    ours = var_cache / "infervisor"
    if os.access(ours, os.W_OK) or (not ours.exists() and os.access(var_cache, os.W_OK)):
        return ours
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "infervisor"


def resolve_cache_dir(config_value: str | None) -> Path:
    """config.json's cache_dir, else the default."""
    return Path(config_value) if config_value else default_cache_dir()
