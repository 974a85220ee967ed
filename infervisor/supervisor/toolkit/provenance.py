"""Where, when and by which build a figure was measured, and what the daemon served: so a signed report can be
matched to what runs, and a figure from another box or another chain is said to be one."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from infervisor.common.cpuinfo import parse_cpuinfo
from infervisor.supervisor.settings.config_path import ConfigChoice, resolve_config_path

_SOURCE_ROOT = Path(__file__).resolve().parents[3]


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The source checkout's commit (with `-dirty` when it has local changes), or None outside a git checkout."""
    if not (_SOURCE_ROOT / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(_SOURCE_ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def cpu_model(proc: Path = Path("/proc")) -> str:
    """This box's CPU `model name` ("unknown" when /proc/cpuinfo does not say)."""
    try:
        return parse_cpuinfo((proc / "cpuinfo").read_text()).model_name
    except OSError:
        return "unknown"


def measured_on() -> dict[str, Any]:
    """Date and time (UTC), host, CPU model, the infervisor and torch builds (torch by metadata: never imported)."""
    return {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu_model": cpu_model(),
        "infervisor": _version("infervisor"),
        "commit": git_commit(),
        "torch": _version("torch"),
    }


#: Environment a toolkit command's result depends on: the config it finds by default, where modules are imported.
_NEEDED_ENVIRONMENT = ("INFERVISOR_CONFIG", "PYTHONPATH")


def infervisor_command() -> list[str]:
    """The infervisor that runs now, as a command that runs it again from any shell: the console script's absolute
    path (`.venv/bin/infervisor` is on no PATH after `./dev demo`), else `python -m infervisor` with this Python."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.name == "infervisor":
        found = shutil.which(str(script)) if script.parent == Path() else str(script)
        if found:
            return [os.path.abspath(found)]
    return [sys.executable, "-m", "infervisor"]


def command_line(resolved: dict[str, str] | None = None) -> str:
    """The command that was run, as a shell line that repeats it from anywhere: the folder it ran in (relative
    paths), the environment it read, and each `resolved` option (a --config or --runtime-dir found by default)
    spelled out when the command line did not give it."""
    argv = sys.argv[1:]
    for option, value in (resolved or {}).items():
        if not any(arg == option or arg.startswith(f"{option}=") for arg in argv):
            argv += [option, value]
    environment = [f"{name}={shlex.quote(os.environ[name])}" for name in _NEEDED_ENVIRONMENT if os.environ.get(name)]
    return " ".join(["cd", shlex.quote(os.getcwd()), "&&", *environment, shlex.join([*infervisor_command(), *argv])])


def sha256_of(path: Path) -> str:
    """The file's sha256, hex."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def served(model: dict[str, Any]) -> dict[str, Any]:
    """What a running daemon served for one model (its status entry): the chain, the layout, each worker's profile."""
    members = [w for w in model["workers"] if "role" not in w]
    cores = sorted({len(w["cores"]) for w in members})
    return {
        "chain": list(model["profiles"]),
        "workers": len(members),
        "cores_per_worker": cores[0] if len(cores) == 1 else None,
        "profiles": [w["profile"] for w in members],
        "checked_on": sorted({str(w.get("checked_on")) for w in members if w.get("checked_on")}),
    }


def delivery_config(explicit: str | None, optimize: dict[str, Any] | None) -> ConfigChoice:
    """The config a delivery's report and doctor are about: --config; else the file optimize wrote its choice
    into; else the config optimize read; else the usual chain (resolve_config_path)."""
    if explicit or optimize is None:
        return resolve_config_path(explicit)
    if optimize.get("written_to"):
        return ConfigChoice(Path(optimize["written_to"]), "optimize's JSON: the config it wrote")
    if optimize.get("config"):
        return ConfigChoice(Path(optimize["config"]), "optimize's JSON: the config it read (it wrote none)")
    return resolve_config_path(None)
