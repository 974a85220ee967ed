"""The one step that notices a child's end, whatever its kind: every process the supervisor started is polled once
per turn here, and nowhere else.

Each owner watches the process it started with what its end means (a worker slot's `ExitReaper.on_exit`, a child
record's `reaped`). At each turn the reaper kills what is left of an ended child's process group (a compiler it
started) before it reaps it, hands the exit code to that owner, then reaps the strangers adopted as a subreaper
(child_home.py). Judging the end stays the owner's, through lifecycle/exit_decision.py.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from infervisor.supervisor.workers.child_home import ChildHome, ChildProcess
from infervisor.supervisor.workers.process_tree import end_group_if_exited

log = structlog.get_logger("supervisor")

#: Told that a watched process ended: its exit code (negative: the signal), and the turn's clock.
OnEnd = Callable[[int, float], None]

#: How often adopted strangers (a crashed worker's orphaned compiler) are looked for: it reads /proc.
_STRANGERS_EVERY_S = 1.0


class Reaper:
    """Every watched process, polled once per `reap`; each end handed to its owner once."""

    def __init__(self, home: ChildHome | None = None) -> None:
        #: Where strangers are reaped from (None: the reaper of a pool without a daemon, in tests).
        self.home = home
        self.watched: dict[int, tuple[ChildProcess, OnEnd]] = {}
        self.strangers_at = 0.0
        #: Ends handed to owners, for tests and status.
        self.reaped = 0

    def watch(self, process: ChildProcess, on_end: OnEnd) -> None:
        """Hand `process`'s end to `on_end` at the turn it is seen."""
        self.watched[process.pid] = (process, on_end)

    def watches(self, process: ChildProcess) -> bool:
        """Whether `process` is watched and not reaped yet."""
        held = self.watched.get(process.pid)
        return held is not None and held[0] is process

    def reap(self, now: float) -> int:
        """Poll every watched process once; hand each end to its owner. How many ended."""
        ended = 0
        for pid, (process, on_end) in list(self.watched.items()):
            end_group_if_exited(pid)  # while its zombie still names the group: nothing it started outlives it
            code = process.poll()
            if code is None:
                continue
            del self.watched[pid]
            ended += 1
            on_end(code, now)
        self.reaped += ended
        if self.home is not None and now - self.strangers_at >= _STRANGERS_EVERY_S:
            self.strangers_at = now
            self.home.reap_strangers()
        return ended
