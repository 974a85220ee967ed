"""A worker that built a package (or timed a fresh fastest pick) restarts its own process image, dropping the build.

Exporting, quantizing and compiling a model leaves hundreds of MB in the process (the exported and
quantized graphs, inductor's caches, the C++ compiler's output read back, allocator arenas that never
shrink): a worker that compiled its packages held 1.0-1.5 GB PSS where one that loaded them from the
cache held 0.46 GB. After a selection that built anything into the cache, the worker execs the same
interpreter with the same arguments: the pid, the cpu pinning, the rlimits and the link's descriptor
stay, the heap does not, and the new image loads every package from the cache. The supervisor sees
one more LOADING phase of the same worker. The new image finds INFERVISOR_REEXEC set and never
restarts again, whatever it builds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import structlog

from infervisor.protocol.worker_link import Link

log = structlog.get_logger("worker")

#: Set in the restarted image: what the first one did, and that this one must not restart again.
REEXEC_ENV = "INFERVISOR_REEXEC"


@dataclass(frozen=True)
class Carried:
    """What the image that built tells the one that serves."""

    #: time.perf_counter() when the first image started (CLOCK_MONOTONIC on Linux: the same clock after exec).
    started: float
    #: Package builds the first image ran.
    builds: int
    #: Profiles it built and checked that passed (more than one: a fresh fastest pick, timed).
    passed: int
    #: Its proportional set size just before the exec, in MiB.
    pss_mb: float
    #: Its time from start to the exec, in ms.
    elapsed_ms: float
    #: What it found and the serving image cannot see again (a damaged package it moved aside and rebuilt).
    notes: tuple[str, ...] = ()

    def note(self) -> str:
        """One line for the selection's notes (status `profile_build`)."""
        return (
            f"restarted the process after its build ({self.builds} cache miss(es), {self.passed} profile(s) "
            f"passed, {self.elapsed_ms / 1000.0:.1f} s) to drop the build's memory ({self.pss_mb:.0f} MB PSS "
            "before), then loaded from the cache"
        )


def carried() -> Carried | None:
    """What the building image passed on, or None in a first image (or when the variable is not ours)."""
    text = os.environ.get(REEXEC_ENV)
    if not text:
        return None
    try:
        fields = json.loads(text)
        return Carried(**{**fields, "notes": tuple(fields.get("notes", ()))})
    except (ValueError, TypeError):
        # Still a restarted image: never restart again, only the figures are lost.
        return Carried(time.perf_counter(), 0, 0, 0.0, 0.0)


def restarted() -> bool:
    """This image is the one a build restarted (it must not restart again)."""
    return REEXEC_ENV in os.environ


def pss_mb() -> float:
    """This process's proportional set size in MiB (0.0 when the kernel does not say)."""
    import psutil

    try:
        return float(psutil.Process().memory_full_info().pss) / 2**20
    except (psutil.Error, AttributeError, OSError):
        return 0.0


def restart(
    link: Link,
    link_fd: int,
    started: float,
    builds: int,
    passed: int,
    send_timeout_s: float,
    notes: tuple[str, ...] = (),
) -> None:
    """Exec this worker again with the same argv and link; returns only if the exec failed (serve on as is).

    Nothing of the link may be lost: the outbox is flushed first, and a starting worker reads nothing
    from its link, so whatever the supervisor sent waits in the kernel's buffer for the new image.
    """
    if restarted():
        return
    elapsed_ms = round((time.perf_counter() - started) * 1000.0, 1)
    record = Carried(started, builds, passed, round(pss_mb(), 1), elapsed_ms, tuple(n[:2000] for n in notes[:16]))
    log.info("worker_restarting_after_build", builds=builds, pss_mb=record.pss_mb)
    link.flush_blocking(send_timeout_s)
    sys.stdout.flush()
    sys.stderr.flush()
    environment = dict(os.environ, **{REEXEC_ENV: json.dumps(asdict(record))})
    try:
        os.set_inheritable(link_fd, True)
        os.execve(sys.executable, sys.orig_argv, environment)
    except OSError as exc:
        os.set_inheritable(link_fd, False)
        log.warning("worker_restart_failed", error=str(exc))
