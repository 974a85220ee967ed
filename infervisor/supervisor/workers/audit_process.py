"""One model's audit process: started, fed, read, and restarted with back-off, never in the way of serving.

The process (`python -P -m infervisor.worker.audit`, worker/audit.py) runs at the lowest CPU priority on the
model's cores and the supervisor's, with one thread and its own memory cap. Everything here is non-blocking: a
send that does not fit waits in the link's outbox, a dead process is noticed by the one reaper (reaper.py), its
process, link and ends are its `ChildRecord` (child_record.py), and how long it has
been stopped or gained no CPU time while samples wait for it is read from the kernel. Whether it hangs or is
stuck, and how long it waits before its next start, is lifecycle/exit_decision.py's (`decide_child_exit`), applied
by lifecycle/exits.py `reap_runner` through `ended`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Sequence
from typing import Any

import psutil
import structlog

from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.protocol import worker_messages as wm
from infervisor.protocol.constants import StartPhase
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.child_record import ChildRecord
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.launcher import AUDIT_ENTRY, launch_worker
from infervisor.supervisor.workers.process_tree import own_child
from infervisor.supervisor.workers.retry_policy import ChildKind
from infervisor.supervisor.workers.slot import describe_exit

log = structlog.get_logger("supervisor")

_HALTED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


class AuditState(enum.Enum):
    """Where a model's audit process stands (status `models.<name>.audit.process`)."""

    OFF = "off"  # not needed: budget 0, or the model serves eager fp32
    STARTING = "starting"  # spawned, loading eager fp32
    READY = "ready"  # auditing
    BACKOFF = "backoff"  # ended unasked (crash, kill, hang, load failure): started again at `next_start`


class AuditProcess:
    """The audit process of one model, with its restarts; the samples it holds are the watch's."""

    def __init__(self, model: str, children: Children, profile: str = REFERENCE_PROFILE) -> None:
        self.model = model
        #: What the process runs: eager fp32 (the audit), or a lossy candidate (the shadow, lifecycle/shadow.py).
        self.profile = profile
        #: Its process, link and ends across restarts; the supervisor's `children` notice its end and read its link.
        self.child = ChildRecord(ChildKind.AUDIT if profile == REFERENCE_PROFILE else ChildKind.SHADOW, model)
        self.children = children
        #: Results read from its link since its owner last took them.
        self.results: list[wm.AuditResult] = []
        #: The build notes of its READY (the shadow's: the spec key its verdict is recorded under).
        self.notes: list[str] = []
        self.state = AuditState.OFF
        self.error: str | None = None
        #: Why its start's gate rejected the profile (a shadow's candidate off on the recorded served inputs).
        self.rejected: str | None = None
        #: The process as psutil sees it, and its progress: CPU seconds, when they last grew, when it was seen stopped.
        self.tree_root: psutil.Process | None = None
        self.cpu_s = 0.0
        self.progress_at = 0.0
        self.stopped_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def kind(self) -> ChildKind:
        """An audit process (eager fp32) or a shadow (a lossy candidate): their limits and back-off differ."""
        return self.child.kind

    @property
    def running(self) -> bool:
        """A process is held (alive, or ended and not judged yet)."""
        return self.child.process is not None

    def start(self, config: Config, model: ModelConfig, cpus: Sequence[int], now: float) -> str | None:
        """Spawn the process for `model` (its profile only, one thread) on `cpus`; on OSError, why it did not start
        (an end its owner judges like any other)."""
        cap = config.builder_memory_mb or model.max_memory_mb or int(psutil.virtual_memory().total // 2**20 // 4)
        if self.profile == REFERENCE_PROFILE:
            loaded = dataclasses.replace(model, profiles=("eager",), channels_last=False, max_memory_mb=max(512, cap))
        else:  # the shadow: what the builder built, loaded as a serving worker would (never held to a shadow itself)
            loaded = dataclasses.replace(model, profiles=(self.profile,), max_memory_mb=max(512, cap), shadow="off")
        # The model's cores and the supervisor's: on the model's cores alone a 300 ms pass raised resnet50's P99
        # 1.27x (the worker shares its core with it), while beside the supervisor it did not move.
        assignment = Assignment(model.name, 0, tuple(sorted(set(cpus) | os.sched_getaffinity(0))), 0, 1, True)
        try:
            ready_only = self.profile != REFERENCE_PROFILE
            launched = launch_worker(loaded, assignment, config, entry=AUDIT_ENTRY, ready_only=ready_only)
        except OSError as exc:
            return f"could not start: {exc}"
        started = (launched.worker_id, assignment.cpus, now)
        self.children.adopt(self.child, launched.process, launched.link, started, self.take)
        self.state = AuditState.STARTING
        self.tree_root, self.progress_at, self.stopped_at = own_child(launched.process.pid), now, None
        self.cpu_s = 0.0
        log.info("audit_started", model=self.model, pid=launched.process.pid, profile=self.profile)
        return None

    def send(self, seq: int, inputs: Sequence[Any], answer: Sequence[Any]) -> bool:
        """Queue one sample on the link (never blocks: the event loop writes what waits); False when it is gone."""
        if self.state is not AuditState.READY:
            return False
        return self.children.links.send(self.child, wm.encode(wm.Audit(seq, len(inputs)), [*inputs, *answer]))

    def take(self, message: wm.WorkerMessage, frames: list[memoryview]) -> None:
        """One message of its link, as the event loop read it: READY, LOAD_ERROR, the gate's rejection, a result."""
        if isinstance(message, wm.Ready):
            self.state, self.child.ends_in_row = AuditState.READY, 0
            self.notes = list(message.build_notes)
        elif isinstance(message, wm.LoadError):
            self.error = f"{self.profile} did not load: {message.error}"
        elif isinstance(message, wm.Progress) and message.profile == self.profile:
            if message.phase == StartPhase.REJECTED.value:
                self.rejected = " ".join(message.detail.split())
        elif isinstance(message, wm.AuditResult):
            self.results.append(message)

    def receive(self) -> list[wm.AuditResult]:
        """The results read since the last call, in order."""
        results, self.results = self.results, []
        return results

    def exited(self) -> str | None:
        """How the process ended (crash, kill -9, load failure), as the reaper found it, else None while it lives.

        A link that broke while the process lives gets it killed: it cannot be talked to, and its end is then
        reaped like any other."""
        child = self.child
        if child.process is None:
            return None
        if child.exit_code is None:
            if child.link is None:
                child.process.kill()
            return None
        self.children.links.drain(child)  # what it said before it exited (its LOAD_ERROR, the gate's rejection)
        return describe_exit(child.exit_code)

    def stillness(self, waiting: int, now: float) -> tuple[float | None, float | None]:
        """While `waiting` samples wait for it: how long it has been seen stopped (None: it is not) and how long it
        has gained no CPU time; (None, None) with nothing waiting (idling is no fault and counts as progress), or
        when it cannot be read."""
        root = self.tree_root
        if root is None or not waiting:
            self.progress_at, self.stopped_at = now, None
            return None, None
        try:
            with root.oneshot():
                halted = root.status() in _HALTED
                times = root.cpu_times()
        except psutil.Error:
            return None, None  # it ended: exited() says how
        if times.user + times.system != self.cpu_s:
            self.cpu_s, self.progress_at = times.user + times.system, now
        self.stopped_at = (now if self.stopped_at is None else self.stopped_at) if halted else None
        return (now - self.stopped_at if self.stopped_at is not None else None), now - self.progress_at

    def ended(self, how: str, restart_in: float, ends_in_row: int, now: float) -> None:
        """The process is gone, killed or never started (lifecycle/exits.py `reap_runner` judged it): ended if it
        lives, counted, and started again after `restart_in`."""
        self.child.ended(how, restart_in, ends_in_row, now)
        self.state = AuditState.BACKOFF
        log.warning("audit_process_ended", model=self.model, how=how, error=self.error, restart_in_s=restart_in)

    def stop(self) -> None:
        """Not needed any more (budget 0, eager serves, the model left, the daemon stops): ended without a count."""
        if self.child.process is not None:
            log.info("audit_stopped", model=self.model, pid=self.child.pid)
        self.child.close()
        self.state, self.child.ends_in_row = AuditState.OFF, 0
