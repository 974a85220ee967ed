"""A scratch daemon: `infervisor serve` on a config written for one measurement (optimize's check, bench's daemon
half), beside any daemon already serving.

Its config lives in a folder of its own, but its models are the user's: the daemon is told the user's config folder
(`serve --source-dir`), so a `{"python": "module:factory"}` model and every relative file resolve exactly as
`infervisor serve` resolves them for the user's own config. When it fails, its folder (config and log) is kept and
the reason read from its log travels in the exception, so the user and the JSON get it, not a bare exit code.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from infervisor.protocol.control_client import DaemonNotReady, await_status

Found = TypeVar("Found")

#: Log fields that say nothing about why the daemon stopped.
_NOISE = ("event", "level", "timestamp", "logger")


class ScratchFailed(Exception):
    """The scratch daemon did not start or did not serve; the message says why and where its log was kept."""

    def __init__(self, reason: str, log_path: Path | None) -> None:
        super().__init__(f"{reason} (its config and log are kept in {log_path.parent})" if log_path else reason)
        self.reason = reason
        self.log_path = log_path


def log_reason(log_text: str) -> str:
    """Why a daemon stopped, from its JSON log: its last error events, else its last lines."""
    errors: list[str] = []
    lines = [line for line in log_text.splitlines() if line.strip()]
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("level") in ("error", "critical"):
            parts: list[str] = []
            problems = event.get("problems")
            if isinstance(problems, list):
                parts.append("; ".join(str(p) for p in problems))
            parts += [f"{k}={v}" for k, v in event.items() if k not in (*_NOISE, "problems") and v is not None]
            errors.append(f"{event.get('event')}: {', '.join(parts)}")
    if errors:
        return " | ".join(errors[-3:])
    return " / ".join(lines[-3:]) if lines else "it logged nothing"


@dataclass
class ScratchDaemon:
    """A running scratch daemon: its process, its folder (config.json, daemon.log) and its runtime dir."""

    process: subprocess.Popen[bytes]
    folder: Path
    runtime_dir: Path

    @property
    def log_path(self) -> Path:
        return self.folder / "daemon.log"

    def await_status(self, found: Callable[[dict[str, Any]], Found | None], timeout: float, awaited: str) -> Found:
        """await_status on this daemon; ScratchFailed with the log's reason when it exits or never gets there."""
        try:
            return await_status(self.process, self.runtime_dir, found, timeout, awaited)
        except DaemonNotReady as exc:
            raise self.failure(str(exc)) from None

    def failure(self, why: str) -> ScratchFailed:
        """A ScratchFailed saying `why`, with the daemon's own reason when it has exited."""
        if self.process.poll() is not None:
            why = f"{why}: {log_reason(self.log_path.read_text(errors='replace'))}"
        return ScratchFailed(why, self.log_path)

    def stop(self, grace: float = 60.0) -> int:
        """SIGTERM, SIGKILL after `grace` seconds; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def scratch_config(raw: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    """A config made safe to run beside a serving daemon: its own sockets, the given cache, warnings only.

    Its models build before they serve: a tool measures the profile the chain picks, never the eager a daemon
    serves first while its background builder works.
    """
    models = {name: {**entry, "build": "at_start"} for name, entry in raw.get("models", {}).items()}
    config = {**raw, "models": models, "cache_dir": str(cache_dir), "log_level": "warning"}
    for key in ("runtime_dir", "tcp_endpoint", "curve", "metrics_listen", "socket_group"):
        config.pop(key, None)  # a second daemon must not take the first one's endpoints
    return config


@contextmanager
def scratch_daemon(config: dict[str, Any], source_dir: Path, purpose: str) -> Iterator[ScratchDaemon]:
    """Start `infervisor serve` on `config`, its models found in `source_dir`; stop it on the way out.

    The folder is removed when the block ends normally; when it raises, the folder (config and log) is kept.
    """
    folder = Path(tempfile.mkdtemp(prefix=f"infervisor-{purpose}-"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    runtime_dir = folder / "run"
    with (folder / "daemon.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "infervisor", "serve", "--config", str(folder / "config.json"),
             "--runtime-dir", str(runtime_dir), "--source-dir", str(source_dir.resolve())],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    daemon = ScratchDaemon(process, folder, runtime_dir)
    try:
        yield daemon
    except BaseException:
        daemon.stop()
        raise
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)
