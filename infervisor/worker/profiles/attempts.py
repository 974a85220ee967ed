"""Markers that outlive a native crash, so a profile that kills its process is a fallback, not a crash loop.

Before a worker builds, checks or warms a profile it writes `<profile>-<key>.<pid>.attempt` in the
cache directory, and removes it when that step ends in any way Python sees. A segfault, an abort
or a kernel kill mid-step leaves the marker behind. The next worker of the model finds it, learns
from the supervisor how that pid ended (the launch spec's `recent_exits`), and when the process
died of a signal the supervisor did not send, writes `<profile>-<key>.crashed` with the reason:
that profile is skipped from then on, for this model, torch and CPU, until the file is deleted.
A marker whose process the supervisor killed itself (a start timeout, a stop) or that nobody can
account for is only removed: the profile is tried again.

A build the supervisor killed for overrunning its compile limit (config compile_timeout_s) is tried
again too, since a box busy with a sibling's compile may have slowed it; after OVERRUNS_ALLOWED
overruns at the limit in force (or a higher one) within OVERRUN_MEMORY_S, the profile is skipped
with that reason instead of compiling into the same kill for ever.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from infervisor.common.processes import pid_alive

log = structlog.get_logger("worker")

#: Compile-limit kills of one profile after which workers skip it (the second attempt is the retry).
OVERRUNS_ALLOWED = 2
#: How long such a kill counts, like a failed build's marker (cache.FAILED_RETRY_S).
OVERRUN_MEMORY_S = 3600.0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class AttemptLog:
    """The attempt markers and crash records of one model's profiles in one cache directory."""

    def __init__(
        self,
        root: Path | None,
        stems: dict[str, str],
        recent_exits: Sequence[dict[str, Any]],
        compile_limit_s: float | None = None,
    ) -> None:
        #: None: no cache directory, so nothing survives a crash and every profile is simply tried.
        self.root = root / "attempts" if root is not None else None
        #: profile -> `<profile>-<key>`, the same key material as the profile's cached package.
        self.stems = stems
        self.exits = {int(e["pid"]): e for e in recent_exits if e.get("pid") is not None}
        self.overruns = _overruns(recent_exits, compile_limit_s)

    def refusal(self, profile: str) -> str | None:
        """Why `profile` is not tried: it crashed a process of this model, or overran the compile limit too often."""
        overruns = self.overruns.get(profile, [])
        if len(overruns) >= OVERRUNS_ALLOWED:
            pids = ", ".join(str(p) for p in overruns)
            return (
                f"its build overran the compile limit {len(overruns)} times (compile_timeout_s; pids {pids}): skipped "
                "for an hour; raise compile_timeout_s, or fill the cache with `infervisor build` and "
                "`infervisor restart` the model"
            )
        if self.root is None or profile not in self.stems:
            return None
        stem = self.stems[profile]
        crashed = self.root / f"{stem}.crashed"
        if crashed.exists():
            return f"{crashed.read_text().strip()} (remembered in {crashed}; delete it to try again)"
        for marker in self.root.glob(f"{stem}.*.attempt"):
            reason = self._judge(marker)
            if reason is not None:
                crashed.write_text(reason)
                log.error("profile_crashed", profile=profile, reason=reason, record=str(crashed))
                return f"{reason} (remembered in {crashed}; delete it to try again)"
        return None

    def _judge(self, marker: Path) -> str | None:
        """A marker left by a process that crashed: the reason; otherwise the marker is removed, or kept if live."""
        try:
            attempt = json.loads(marker.read_text())
            pid, phase = int(attempt["pid"]), str(attempt["phase"])
        except (OSError, ValueError, KeyError, TypeError):
            marker.unlink(missing_ok=True)
            return None
        if pid != os.getpid() and pid_alive(pid):
            return None  # a sibling worker is on this step right now
        marker.unlink(missing_ok=True)
        ended = self.exits.get(pid)
        if ended is None or ended.get("signal") is None or ended.get("killed_by_supervisor"):
            return None  # stopped by the supervisor, or by an earlier run of the daemon: not the profile's fault
        return f"crashed while {phase} (killed by {_signal_name(int(ended['signal']))})"

    @contextmanager
    def attempting(self, profile: str, phase: str) -> Iterator[None]:
        """Mark `profile` as being `phase` (building and checking, warming up) by this process while the step runs."""
        if self.root is None or profile not in self.stems:
            yield
            return
        marker = self.root / f"{self.stems[profile]}.{os.getpid()}.attempt"
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            marker.write_text(json.dumps({"pid": os.getpid(), "phase": phase}))
        except OSError as exc:  # a read-only or full cache: the step runs unprotected, and says so
            log.warning("attempt_not_marked", profile=profile, error=str(exc))
            yield
            return
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)


def _overruns(recent_exits: Sequence[dict[str, Any]], limit_s: float | None) -> dict[str, list[int]]:
    """Per profile, the pids the supervisor killed at a compile limit at least `limit_s`, within OVERRUN_MEMORY_S."""
    now = time.time()
    found: dict[str, list[int]] = {}
    for ended in recent_exits:
        overrun = ended.get("compile_overrun")
        if not isinstance(overrun, dict):
            continue
        recent = now - float(overrun.get("at", 0.0)) < OVERRUN_MEMORY_S
        if recent and (limit_s is None or float(overrun.get("limit_s", 0.0)) >= limit_s):
            found.setdefault(str(overrun.get("profile")), []).append(int(ended.get("pid") or 0))
    return found
