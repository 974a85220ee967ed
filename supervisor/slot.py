"""One worker slot: its pinned cores, its current process and the one state machine that governs it."""

from __future__ import annotations

import collections
import enum
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from protocol.constants import MAX_HEADER_BYTES, WorkerExitCode
from protocol.launch import LaunchSpec
from protocol.worker_link import WORKER_LINK_FRAMES, Link
from supervisor.cache_dir import resolve_cache_dir
from supervisor.config import Config, ModelConfig
from supervisor.planner import Assignment

if TYPE_CHECKING:
    from supervisor.pending import PendingRequest

log = structlog.get_logger("supervisor")


class SlotState(enum.Enum):
    """Life of a slot; only `WorkerSlot.transition` changes it."""

    STOPPED = "stopped"  # no process, by intent
    STARTING = "starting"  # process spawned, loading and warming; READY not yet seen
    SERVING = "serving"  # READY seen; takes requests (busy or idle)
    DRAINING = "draining"  # takes nothing new; DRAIN sent, exits when its request is answered
    STOPPING = "stopping"  # STOP sent or SIGKILL issued; waiting for the exit status
    BACKOFF = "backoff"  # process ended unexpectedly; respawn scheduled after a delay
    FAILED = "failed"  # failed too often within the restart window; no more respawns


_ALLOWED: dict[SlotState, frozenset[SlotState]] = {
    SlotState.STOPPED: frozenset({SlotState.STARTING}),
    # A worker that exits before READY backs off; one we gave up on is stopped.
    SlotState.STARTING: frozenset({SlotState.SERVING, SlotState.BACKOFF, SlotState.STOPPING}),
    SlotState.SERVING: frozenset({SlotState.DRAINING, SlotState.STOPPING, SlotState.BACKOFF}),
    # An exit while draining or stopping was asked for, so it ends in STOPPED, not BACKOFF.
    SlotState.DRAINING: frozenset({SlotState.STOPPING, SlotState.STOPPED}),
    SlotState.STOPPING: frozenset({SlotState.STOPPED}),
    SlotState.BACKOFF: frozenset({SlotState.STARTING, SlotState.FAILED, SlotState.STOPPED}),
    SlotState.FAILED: frozenset({SlotState.STOPPED}),
}

#: States whose process is alive (or not yet reaped).
LIVE_STATES = frozenset({SlotState.STARTING, SlotState.SERVING, SlotState.DRAINING, SlotState.STOPPING})

_generations = itertools.count(1)

#: Send buffer asked for on each end of a worker link (Linux doubles it, up to 2 x net.core.wmem_max).
_LINK_BUFFER_BYTES = 4 * 2**20

#: Read once by the OpenMP/MKL runtimes when torch loads, so they are set at exec, not later.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def worker_environment(threads: int, cache_dir: Path) -> dict[str, str]:
    """The supervisor's environment with thread pools sized to the worker's core set, inductor's cache in ours."""
    env = dict(os.environ)
    for name in THREAD_ENV_VARS:
        env[name] = str(threads)
    # torch.compile's own on-disk caches then survive reboots and are shared with our packages' lifetime.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    return env


class IllegalTransition(Exception):
    """A state change the machine does not allow: a supervisor bug, reported loudly."""


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
class WorkerSlot:
    """A pinned place for one worker of a model, kept across respawns of its process."""

    model: ModelConfig
    assignment: Assignment
    state: SlotState = SlotState.STOPPED
    process: subprocess.Popen[bytes] | None = None
    #: The current process's id (model.slot.generation) and the supervisor's end of its link.
    worker_id: str = ""
    link: Link | None = None
    spawned_at: float = 0.0
    last_heard: float = 0.0
    ready_ms: float = 0.0
    expected_ms: float = 0.0
    #: Requests handed to the current process, in dispatch order (it serves them in that order).
    inflight: dict[int, PendingRequest] = field(default_factory=dict)
    #: When the head of the pipeline last moved (a reply, or a dispatch into an empty pipeline).
    progress_at: float = 0.0
    respawn_at: float = 0.0
    kill_at: float | None = None
    failures: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=1000))
    restarts: int = 0
    requests: int = 0
    threads_seen: int | None = None
    #: The process's rehearsals of its request path, from its last STATS (worker/request_path.py).
    rehearsals_seen: int = 0
    last_exit: str | None = None
    latencies_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2048))
    # Per process (reset at spawn): what the monitors look at.
    ready_at: float = 0.0
    process_requests: int = 0
    last_canary_at: float = 0.0
    #: Heartbeat period and liveness this process was launched with (a reload must not change them under it).
    heartbeat_s: float = 0.5
    liveness: int = 10
    next_heartbeat: float = 0.0
    #: The profile this process serves with, and why earlier ones in the chain were skipped.
    profile: str | None = None
    profile_notes: str = ""
    build_notes: str = ""
    #: The last torch.profiler report of this process: seq, requests profiled, top operators.
    last_profile: dict[str, object] | None = None
    #: The newest monitor finding about this slot, for status.
    last_event: dict[str, object] | None = None

    @property
    def name(self) -> str:
        """`model/slot` as used in logs and status."""
        return f"{self.model.name}/{self.assignment.slot}"

    @property
    def can_take(self) -> bool:
        """Serving with room in its pipeline (`prefetch` requests in hand at most) and a link that still carries."""
        return (
            self.state is SlotState.SERVING
            and len(self.inflight) < self.model.prefetch
            and self.link is not None
            and self.link.sendable
        )

    @property
    def pid(self) -> int | None:
        """The live process id, if any."""
        return self.process.pid if self.process is not None and self.state in LIVE_STATES else None

    def transition(self, new: SlotState, reason: str) -> None:
        """Move to `new`, refusing moves the machine does not allow, and log the change as data."""
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {new.value} ({reason})")
        pid = self.process.pid if self.process is not None else None
        log.info("worker_state", slot=self.name, pid=pid, old=self.state.value, new=new.value, reason=reason)
        self.state = new

    def spawn(self, config: Config) -> None:
        """Start a fresh interpreter for this slot (exec, never a fork of a torch process), linked by a socketpair."""
        generation = next(_generations)
        cache_dir = resolve_cache_dir(config.cache_dir)
        worker_id = f"{self.model.name}.{self.assignment.slot}.{generation}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for end in (ours, theirs):
                # Room for a whole image in one write: with the default 208 KB a 600 KB tensor goes over
                # in three turns of write, wake the reader, wait for room. The kernel caps it at wmem_max.
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _LINK_BUFFER_BYTES)
            launch = LaunchSpec(
                worker_id=worker_id,
                model=self.model.name,
                link_fd=theirs.fileno(),
                source=self.model.source,
                inputs=self.model.inputs,
                output_names=self.model.outputs,
                cpus=self.assignment.cpus,
                threads=self.assignment.threads,
                warmup_iterations=self.model.warmup_iterations,
                heartbeat_interval_ms=config.heartbeat_interval_ms,
                heartbeat_liveness=config.heartbeat_liveness,
                max_frame_bytes=config.max_frame_bytes,
                max_memory_mb=self.model.max_memory_mb,
                profiles=self.model.profiles,
                pick=self.model.pick,
                tolerance=self.model.tolerance,
                channels_last=self.model.channels_last,
                cache_dir=str(cache_dir),
                calibration=self.model.calibration,
                validation=self.model.validation,
            )
            self.process = subprocess.Popen(
                [sys.executable, "-m", "worker", launch.to_json()],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                # The only descriptor the worker inherits besides stdio: its end of the link.
                pass_fds=(theirs.fileno(),),
                env=worker_environment(self.assignment.threads, cache_dir),
                # Its own session: a Ctrl-C or a group-wide SIGTERM reaches the supervisor, which then
                # drains and stops workers in order instead of losing them mid-request.
                start_new_session=True,
            )
        except BaseException:  # nothing may keep our end open when no process got the other
            ours.close()
            raise
        finally:
            theirs.close()  # the child has its copy; ours would only hide the worker's EOF
        # Workers refuse to send an output frame over max_frame_bytes, so a longer one is a garbled stream.
        self.link = Link(ours, WORKER_LINK_FRAMES, max(config.max_frame_bytes, MAX_HEADER_BYTES))
        self.worker_id = worker_id
        self.spawned_at = self.last_heard = time.monotonic()
        self.kill_at = None
        self.threads_seen = None
        self.rehearsals_seen = 0
        self.latencies_ms.clear()
        self.heartbeat_s = config.heartbeat_interval_ms / 1000.0
        self.liveness = config.heartbeat_liveness
        self.ready_at = 0.0
        self.process_requests = 0
        self.last_canary_at = 0.0
        if self.failures or self.last_exit:
            self.restarts += 1
        self.transition(SlotState.STARTING, f"spawned pid {self.process.pid} on cpus {list(self.assignment.cpus)}")

    def kill(self, reason: str) -> None:
        """SIGKILL the process now; the exit is reaped like any other."""
        if self.process is not None and self.process.poll() is None:
            log.warning("worker_killed", slot=self.name, pid=self.process.pid, reason=reason)
            self.process.kill()

    def record_failure(self, now: float, window_s: float) -> int:
        """Remember a failure and return how many fell inside the restart window."""
        self.failures.append(now)
        return sum(1 for t in self.failures if now - t <= window_s)
