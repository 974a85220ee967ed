"""One record for a child of any kind beside the serving workers (builder, audit, shadow, OIP gateway): its process
and link now, the cores it runs on, and what its ends add up to across its processes.

A serving worker's process is an `Incarnation` (slot.py) inside its slot's state machine; every other kind's is this
record, kept for the child's whole life in the daemon, so its owner keeps no counters of its own. Its end is noticed
by the one reaper (reaper.py), which sets `exit_code`; its owner judges that end (lifecycle/exit_decision.py) at its
turn and applies the verdict through `ended`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from infervisor.protocol.worker_link import Link
from infervisor.supervisor.workers.child_home import ChildProcess
from infervisor.supervisor.workers.process_tree import kill_group
from infervisor.supervisor.workers.retry_policy import ChildKind


@dataclass
class ChildRecord:
    """A child of `kind` serving `owner` (a model's name, or the gateway): one process at a time."""

    kind: ChildKind
    owner: str
    process: ChildProcess | None = None
    #: The supervisor's end of its link (None for the gateway, which is the broker's client, or once it broke).
    link: Link | None = None
    #: Its id in logs (model.role.generation).
    worker_id: str = ""
    cores: tuple[int, ...] = ()
    started_at: float = 0.0
    #: How its process ended, as the reaper found it (None while it runs, or before the reaper's turn saw it).
    exit_code: int | None = None
    #: Processes started, and ends judged (a restart each, unless its work was given up).
    starts: int = 0
    ends: int = 0
    #: Ends in a row (reset by a READY, or by a run long enough): what the next back-off reads.
    ends_in_row: int = 0
    #: Not started again before this (monotonic seconds).
    next_start: float = 0.0
    #: How its last process ended, as status says it.
    last_exit: str | None = None
    #: Told before the link closes (child_links.py: a closed descriptor must leave the event loop's poller first).
    on_close: Callable[[], None] | None = None

    @property
    def pid(self) -> int | None:
        """The current process's id (None between processes)."""
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        """A process is held and the reaper has not seen it end."""
        return self.process is not None and self.exit_code is None

    def adopt(
        self, process: ChildProcess, link: Link | None, worker_id: str, cores: tuple[int, ...], now: float
    ) -> None:
        """Take on a freshly started process (the reaper is told by the owner, which knows what its end means)."""
        self.process, self.link, self.worker_id, self.cores = process, link, worker_id, cores
        self.started_at, self.exit_code, self.on_close = now, None, None
        self.starts += 1

    def reaped(self, process: ChildProcess, code: int) -> None:
        """The reaper saw `process` end with `code` (ignored once the record holds another process)."""
        if process is self.process:
            self.exit_code = code

    def ended(self, how: str, restart_in: float, ends_in_row: int, now: float) -> None:
        """The verdict on one end: counted, remembered for status, and the next start not before `restart_in`."""
        self.close()
        self.ends += 1
        self.ends_in_row, self.last_exit = ends_in_row, how
        self.next_start = now + restart_in

    def close(self) -> None:
        """Let go of the process: killed with its process group if it lives, waited for, its link closed."""
        process, link, on_close = self.process, self.link, self.on_close
        self.process, self.link, self.on_close = None, None, None
        if on_close is not None:
            on_close()
        if link is not None:
            link.close()
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            kill_group(process.pid)  # its compilers too, while its unreaped pid still names the group
        process.wait()

    def report(self, now: float | None = None) -> dict[str, object]:
        """The status fields every kind shares: pid, restarts, how it last ended, when it starts again."""
        now = time.monotonic() if now is None else now
        waiting = self.process is None and self.next_start > now
        return {
            "pid": self.pid,
            "restarts": self.ends,
            "last_exit": self.last_exit,
            "next_start_in_s": round(self.next_start - now, 3) if waiting else None,
        }
