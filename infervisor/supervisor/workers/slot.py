"""One worker slot: its pinned cores, the one state machine that governs it, its current process, its notes.

Only the pool (lifecycle/pool.py, with its rollout steps and stop sequence) changes a slot's state;
everything else reads it. What belongs to one process is an `Incarnation`, replaced whole at each spawn.
"""

from __future__ import annotations

import collections
import enum
import signal
from dataclasses import dataclass, field

import psutil
import structlog

from infervisor.protocol.constants import WorkerExitCode
from infervisor.protocol.worker_link import Link
from infervisor.supervisor.host.planner import Assignment
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.launcher import Launched, WorkerProcess
from infervisor.supervisor.workers.process_tree import (
    descendants_of,
    end_group_if_exited,
    kill_all,
    kill_group,
    own_child,
)
from infervisor.supervisor.workers.start_clock import StartClock

log = structlog.get_logger("supervisor")


class SlotState(enum.Enum):
    """Life of a slot; only `WorkerSlot.transition`, called by the pool, changes it."""

    STOPPED = "stopped"  # no process, by intent
    STARTING = "starting"  # process spawned, loading and warming; READY not yet seen
    SERVING = "serving"  # READY seen; takes requests (busy or idle)
    DRAINING = "draining"  # takes nothing new; DRAIN sent, exits when its requests are answered
    STOPPING = "stopping"  # STOP sent or SIGKILL issued; waiting for the exit status
    BACKOFF = "backoff"  # process ended unexpectedly (or could not be started); respawn after a delay
    FAILED = "failed"  # failed too often within the restart window; no more respawns


#: Every move a slot may make, each with what causes it: the one table the pool is held to, and what
#: docs/architecture.md's state diagram is generated from (python -m infervisor.supervisor.core.state_diagram --write).
TRANSITIONS: dict[SlotState, dict[SlotState, str]] = {
    SlotState.STOPPED: {
        SlotState.STARTING: "spawn",
        # A spawn the OS refused (EAGAIN, ENOMEM) never had a process: it backs off from STOPPED directly.
        SlotState.BACKOFF: "spawn refused by the OS",
    },
    SlotState.STARTING: {
        SlotState.SERVING: "READY",
        # A worker that exits before READY backs off (or fails for good); one we gave up on is stopped.
        SlotState.BACKOFF: "exit before READY",
        SlotState.FAILED: "too many exits in the restart window",
        SlotState.STOPPING: "retire, or the daemon stops",
    },
    SlotState.SERVING: {
        SlotState.DRAINING: "retire (rolling)",
        SlotState.STOPPING: "the daemon stops",
        SlotState.BACKOFF: "exit not asked for (crash, kill)",
        SlotState.FAILED: "too many exits in the restart window",
    },
    # An exit while draining or stopping was asked for, so it ends in STOPPED, not BACKOFF.
    SlotState.DRAINING: {SlotState.STOPPING: "the daemon stops", SlotState.STOPPED: "exit"},
    SlotState.STOPPING: {SlotState.STOPPED: "exit"},
    SlotState.BACKOFF: {
        SlotState.STARTING: "delay elapsed: spawn",
        SlotState.FAILED: "too many failures",
        SlotState.STOPPED: "retire, or the daemon stops",
    },
    SlotState.FAILED: {SlotState.STOPPED: "retire"},
}


class RestartReason(enum.Enum):
    """Why a worker process was replaced: the label of `infervisor_worker_restarts_total` (docs/operations.md)."""

    CRASH = "crash"  # it ended on its own: a crash, an exit, a signal the supervisor did not send
    HANG = "hang"  # it held a request and made no progress within its hang budget
    HEARTBEAT = "heartbeat"  # it was idle and silent for heartbeat_liveness intervals
    START_TIMEOUT = "start_timeout"  # it was not READY within worker_start_timeout_s
    LINK_BROKEN = "link_broken"  # its link could not be written, or lost its framing
    MONITOR_KILL = "monitor_kill"  # a monitor killed it (rss_hard_mb)
    MONITOR_RECYCLE = "monitor_recycle"  # a monitor recycled it, rolling (RSS, leak, drift, age, requests, canary)
    OPERATOR = "operator"  # `infervisor restart`
    CONFIG = "config"  # a reload changed how its workers are built, or re-planned its cores
    MODEL_FILE = "model_file"  # its model file changed on disk
    ROLLBACK = "rollback"  # a rollout of its model failed: rebuilt from the config it serves with
    OPTIMIZED = "optimized"  # the background builder finished: the workers move to its pick


#: States whose process is alive (or not yet reaped).
LIVE_STATES = frozenset({SlotState.STARTING, SlotState.SERVING, SlotState.DRAINING, SlotState.STOPPING})


class IllegalTransition(Exception):
    """A state change the machine does not allow: a supervisor bug, reported loudly."""


def allowed_transitions(state: SlotState) -> frozenset[SlotState]:
    """The states a slot in `state` may move to."""
    return frozenset(TRANSITIONS[state])


def describe_exit(code: int) -> str:
    """Human form of a Popen return code (negative = killed by a signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    try:
        return f"exit {code} ({WorkerExitCode(code).name})"
    except ValueError:
        return f"exit {code}"


@dataclass
class Incarnation:
    """One process of a slot, from its spawn until the next: replaced whole at spawn, so nothing is reset by hand.

    Before the first spawn a slot holds an empty one (no process). After an exit it stays, as the record of that
    process, until the slot spawns again.
    """

    process: WorkerProcess | None = None
    #: The process's id (model.slot.generation) and the supervisor's end of its link.
    worker_id: str = ""
    link: Link | None = None
    spawned_at: float = 0.0
    last_heard: float = 0.0
    ready_at: float = 0.0
    ready_ms: float = 0.0
    #: One request's service time as warm-up measured it: the unit of the hang budget.
    expected_ms: float = 0.0
    #: Heartbeat period and liveness this process was launched with (a reload must not change them under it).
    heartbeat_s: float = 0.5
    liveness: int = 10
    next_heartbeat: float = 0.0
    #: When a process that was asked to go is SIGKILLed if it has not.
    kill_at: float | None = None
    #: SIGKILL already sent: its exit is pending, a second kill would only log again.
    killed: bool = False
    #: Why the supervisor killed it, for status (`last_exit`).
    kill_reason: str = ""
    #: Why it was killed, when that kill is a reason to replace it (None: a stop that was asked for).
    kill_cause: RestartReason | None = None
    #: The kill was for a request that overran its hang budget: not a failure of the model.
    hung_request: bool = False
    threads_seen: int | None = None
    #: Requests this process answered, and their service times: what the age and drift monitors look at.
    requests: int = 0
    latencies_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))
    #: The profile this process serves with, and why earlier ones in the chain were skipped (one reason each).
    profile: str | None = None
    profile_notes: list[str] = field(default_factory=list)
    build_notes: list[str] = field(default_factory=list)
    #: Why this process could not load its model, in the worker's words (its LOAD_ERROR message).
    load_error: str = ""
    #: When a `profile` command was sent: starting torch.profiler takes seconds, which is not a hang.
    profile_started_at: float | None = None
    #: This process was killed because a profile's build overran the compile limit (its exit record).
    compile_overrun: dict[str, object] | None = None
    #: Its phases before READY (PROGRESS messages) and the limits they count against.
    start: StartClock = field(default_factory=StartClock)
    #: The process as psutil sees it (None unless it is our child), and the processes below it at the last look
    #: (infervisor/supervisor/workers/process_tree.py): killed with it.
    tree_root: psutil.Process | None = None
    descendants: list[psutil.Process] = field(default_factory=list)

    @classmethod
    def spawned(cls, launched: Launched, heartbeat_s: float, liveness: int, now: float) -> Incarnation:
        """A freshly started process, with the heartbeat settings it was launched with."""
        return cls(
            process=launched.process,
            worker_id=launched.worker_id,
            link=launched.link,
            spawned_at=now,
            last_heard=now,
            heartbeat_s=heartbeat_s,
            liveness=liveness,
            start=StartClock.started(now),
            tree_root=own_child(launched.process.pid),
        )


@dataclass
class SlotNotes:
    """What status shows of a slot across its processes."""

    #: Processes replaced after the first, and requests answered by all of them.
    restarts: int = 0
    requests: int = 0
    #: How the last process ended.
    last_exit: str | None = None
    #: The last load error of this slot, kept across respawns until a worker serves: status shows it, and the
    #: same error twice in a row fails the slot at once (a load that can never succeed is no crash loop).
    last_load_error: str = ""
    #: The last torch.profiler report: seq, requests profiled, top operators.
    last_profile: dict[str, object] | None = None
    #: The newest monitor finding about this slot.
    last_event: dict[str, object] | None = None


@dataclass
class WorkerSlot:
    """A pinned place for one worker of a model: its state machine, its current process, and notes for status.

    `model` is the config this slot's processes are built from (its rolling keys); live keys such
    as `prefetch` or the monitor limits are read from the serving config, never from here.
    """

    model: ModelConfig
    assignment: Assignment
    state: SlotState = SlotState.STOPPED
    #: Why the slot is in its state now (the reason of its last transition), for status.
    reason: str = ""
    #: Exits counted against the restart window, and when a BACKOFF slot spawns again.
    failures: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=1000))
    respawn_at: float = 0.0
    #: The current (or last) process: replaced whole at each spawn.
    proc: Incarnation = field(default_factory=Incarnation)
    notes: SlotNotes = field(default_factory=SlotNotes)

    @property
    def name(self) -> str:
        """`model/slot` as used in logs and status."""
        return f"{self.model.name}/{self.assignment.slot}"

    @property
    def pid(self) -> int | None:
        """The live process id, if any."""
        process = self.proc.process
        return process.pid if process is not None and self.state in LIVE_STATES else None

    def transition(self, new: SlotState, reason: str) -> None:
        """Move to `new`, refusing moves the machine does not allow, and log the change as data."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {new.value} ({reason})")
        pid = self.proc.process.pid if self.proc.process is not None else None
        log.info("worker_state", slot=self.name, pid=pid, old=self.state.value, new=new.value, reason=reason)
        self.state = new
        self.reason = reason

    def kill(self, reason: str, cause: RestartReason | None = None) -> bool:
        """SIGKILL the process now (once: later calls while it dies are no-ops); True when a signal was sent.

        `cause` is what the restart that follows is counted as; None for a kill that ends a stop.
        """
        proc = self.proc
        if proc.process is None or proc.killed or proc.process.poll() is not None:
            return False
        log.warning("worker_killed", slot=self.name, pid=proc.process.pid, reason=reason)
        # Walked before the kill: once the worker is gone its orphans are re-parented out of its tree.
        proc.descendants = descendants_of(proc.tree_root)
        proc.process.kill()
        kill_group(proc.process.pid)  # not reaped yet: the group's id is still the worker's
        kill_all(proc.descendants, self.name)
        proc.killed, proc.kill_reason, proc.kill_cause = True, reason, cause
        return True

    def track_descendants(self) -> None:
        """Remember what runs below the live process, so what a crash leaves behind can be killed at its reap."""
        # A process that ended (not reaped yet) has no children left: keep the last look for its reap.
        proc = self.proc
        if proc.process is not None and self.state in LIVE_STATES and self.exit_code() is None:
            proc.descendants = descendants_of(proc.tree_root)

    def exit_code(self) -> int | None:
        """The process's exit code, None while it runs; an exit is reaped only after its process group is killed."""
        process = self.proc.process
        if process is None:
            return None
        end_group_if_exited(process.pid)
        return process.poll()

    def end_descendants(self) -> None:
        """Kill what the ended process left running (as last seen), then forget it."""
        kill_all(self.proc.descendants, self.name)
        self.proc.descendants = []

    def adopt_process(self, launched: Launched, heartbeat_s: float, liveness: int, now: float) -> None:
        """Take on a freshly started process: a new incarnation replaces the last one whole."""
        if self.failures or self.notes.last_exit:
            self.notes.restarts += 1
        self.proc = Incarnation.spawned(launched, heartbeat_s, liveness, now)

    def failures_within(self, now: float, window_s: float) -> int:
        """How many failures fell inside the restart window."""
        return sum(1 for t in self.failures if now - t <= window_s)

    def record_failure(self, now: float) -> None:
        """Remember a failure (lifecycle/exit_decision.py says which exits are)."""
        self.failures.append(now)
