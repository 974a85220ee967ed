"""One model's audit process: started, fed, read, and restarted with back-off, never in the way of serving.

The process (`python -P -m infervisor.worker.audit`, worker/audit.py) runs at the lowest CPU priority on the
model's cores and the supervisor's, with one thread and its own memory cap. Everything here is non-blocking: a
send that does not fit waits in the link's outbox, a dead process is noticed by its exit code, and how long it has
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
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.worker_link import LinkClosed
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.launcher import AUDIT_ENTRY, Launched, launch_worker
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

    def __init__(self, model: str, profile: str = REFERENCE_PROFILE) -> None:
        self.model = model
        #: What the process runs: eager fp32 (the audit), or a lossy candidate (the shadow, lifecycle/shadow.py).
        self.profile = profile
        #: The build notes of its READY (the shadow's: the spec key its verdict is recorded under).
        self.notes: list[str] = []
        self.state = AuditState.OFF
        self.launched: Launched | None = None
        self.restarts = 0
        self.failures_in_row = 0
        self.next_start = 0.0
        self.last_exit: str | None = None
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
        return self.launched.process.pid if self.launched is not None else None

    @property
    def kind(self) -> ChildKind:
        """An audit process (eager fp32) or a shadow (a lossy candidate): their limits and back-off differ."""
        return ChildKind.AUDIT if self.profile == REFERENCE_PROFILE else ChildKind.SHADOW

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
            self.launched = launch_worker(loaded, assignment, config, entry=AUDIT_ENTRY, ready_only=ready_only)
        except OSError as exc:
            return f"could not start: {exc}"
        self.state = AuditState.STARTING
        self.tree_root, self.progress_at, self.stopped_at = own_child(self.launched.process.pid), now, None
        self.cpu_s = 0.0
        log.info("audit_started", model=self.model, pid=self.launched.process.pid, profile=self.profile)
        return None

    def send(self, seq: int, inputs: Sequence[Any], answer: Sequence[Any]) -> bool:
        """Queue one sample on the link (never blocks); False when the process is gone."""
        launched = self.launched
        if launched is None or launched.link is None or self.state is not AuditState.READY:
            return False
        try:
            launched.link.send(wm.encode(wm.Audit(seq, len(inputs)), [*inputs, *answer]))
            launched.link.flush()
        except LinkClosed:
            return False
        return True

    def receive(self) -> list[wm.AuditResult]:
        """The results readable now (READY and LOAD_ERROR are taken in on the way)."""
        launched = self.launched
        if launched is None or launched.link is None:
            return []
        results: list[wm.AuditResult] = []
        try:
            launched.link.flush()
            while launched.link.wait_readable(0.0):
                messages = launched.link.receive()
                if not messages:
                    break
                for frames in messages:
                    message = wm.decode(frames[0])
                    if isinstance(message, wm.Ready):
                        self.state, self.failures_in_row = AuditState.READY, 0
                        self.notes = list(message.build_notes)
                    elif isinstance(message, wm.LoadError):
                        self.error = f"{self.profile} did not load: {message.error}"
                    elif isinstance(message, wm.Progress) and message.profile == self.profile:
                        if message.phase == StartPhase.REJECTED.value:
                            self.rejected = " ".join(message.detail.split())
                    elif isinstance(message, wm.AuditResult):
                        results.append(message)
        except (LinkClosed, ProtocolError):
            launched.link.close()
            launched.link = None
        return results

    def exited(self) -> str | None:
        """How the process ended (crash, kill -9, load failure, a broken link), else None while it lives."""
        launched = self.launched
        if launched is None:
            return None
        code = launched.process.poll()
        if code is None and launched.link is not None:
            return None
        if code is None:  # the link broke while the process lives: end it, it cannot be talked to
            launched.process.kill()
            code = launched.process.wait()
        self.receive()  # what it said before it exited (its LOAD_ERROR, the gate's rejection) is read, not lost
        return describe_exit(code)

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
        self.close()
        self.restarts += 1
        self.failures_in_row = ends_in_row
        self.last_exit = how
        self.state, self.next_start = AuditState.BACKOFF, now + restart_in
        log.warning("audit_process_ended", model=self.model, how=how, error=self.error, restart_in_s=restart_in)

    def stop(self) -> None:
        """Not needed any more (budget 0, eager serves, the model left, the daemon stops): ended without a count."""
        if self.launched is not None:
            log.info("audit_stopped", model=self.model, pid=self.launched.process.pid)
        self.close()
        self.state, self.failures_in_row = AuditState.OFF, 0

    def close(self) -> None:
        launched, self.launched = self.launched, None
        if launched is None:
            return
        if launched.process.poll() is None:
            launched.process.kill()
        launched.process.wait()
        if launched.link is not None:
            launched.link.close()
