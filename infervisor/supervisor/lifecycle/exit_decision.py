"""What a worker's exit means, decided in one place: the retry policy as one pure function.

`decide_exit` reads only its arguments (like routing/batcher.py's `decide`): what the pool knew of the
slot when its process ended (`ExitFacts`) and the serving config. Its `ExitVerdict` says everything
that follows: the slot's new state and why, when it respawns, whether the exit counts toward
`max_restarts`, the restart reason counted in `infervisor_worker_restarts_total`, and the one order
the broker gets about the requests the worker held (`RequestOrder`: whom it `Charge`s), both defined here.
The pool's exit reaper applies the verdict (lifecycle/exits.py `on_exit`); the broker carries out the order
on the request side (`worker_lost`, which reads it as its `LostWork`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from infervisor.protocol.constants import WorkerExitCode
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.workers.retry_policy import POLICIES, ChildKind, retry_in
from infervisor.supervisor.workers.slot import RestartReason, SlotState

#: Back-off of an exit not asked for (workers/retry_policy.py): 1, 2, 4 s ... from a never-ready worker's first exit,
#: and from a serving worker's second (its first respawns at once, and so does any that answered a request), up to
#: the maximum.
BACKOFF_MAX_S = POLICIES[ChildKind.WORKER].max_s
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class Charge(enum.Enum):
    """Who pays for a dead worker's running requests."""

    #: The oldest request ran alone: it alone is charged a retry; those behind it go back in line as they were.
    HEAD = "head"
    #: A batch ran: which request killed the worker is unknown, so the batch is split in two halves and nobody
    #: is charged; halving finds a poison request in log2(size) deaths.
    SPLIT = "split"


@dataclass(frozen=True)
class RequestOrder:
    """The one order the pool gives the broker about the requests a dead worker held."""

    charge: Charge
    #: The slot failed for good: if no member of its model can serve any more, what waits is answered now.
    slot_failed: bool

    @property
    def split(self) -> bool:
        """The running batch is split in two halves, nobody charged (else the head alone is charged a retry)."""
        return self.charge is Charge.SPLIT


def same_error(one: str, other: str) -> bool:
    """Two load errors say the same thing: equal once object addresses (`at 0x7f...`), which differ by process, go."""
    return _ADDRESS.sub("0x", one) == _ADDRESS.sub("0x", other)


@dataclass(frozen=True)
class ExitFacts:
    """What the pool knew of a slot when its process ended, read once at the reap."""

    state: SlotState
    code: int
    #: The exit as status says it (`describe_exit`, with the worker's load error).
    how: str
    #: Why the supervisor killed it (hang, heartbeat, start timeout ...), CRASH when it ended on its own.
    cause: RestartReason
    #: It exited LOAD_FAILED with the same error as the slot's previous process.
    repeated_load_error: bool
    #: It was killed for a request that overran its hang budget.
    hung: bool
    #: How many requests ran in its head when it ended (more than one: a batch).
    running: int
    #: Failures of the slot inside the restart window before this exit.
    failures_before: int
    #: Requests this process answered: one that answered any proved that its model loads and serves.
    answered: int = 0


@dataclass(frozen=True)
class ExitVerdict:
    """Everything that follows from one exit."""

    state: SlotState
    #: The transition's reason (status's `reason`).
    why: str
    #: Seconds until the respawn (BACKOFF only).
    respawn_in: float | None
    #: The exit is a failure toward `max_restarts` (the pool records it on the slot).
    counts: bool
    #: Counted in `infervisor_worker_restarts_total` (None: the slot stops or fails, it is not restarted).
    restart: RestartReason | None
    requests: RequestOrder
    #: Failures inside the window, this one included, when it counts (what a FAILED slot's log says).
    failures: int


def decide_exit(facts: ExitFacts, config: Config) -> ExitVerdict:
    """The verdict on one exit: STOPPED if asked for, else BACKOFF with a respawn time, or FAILED after too many."""
    charge = Charge.SPLIT if facts.running > 1 else Charge.HEAD
    how = facts.how

    def verdict(state: SlotState, why: str, respawn_in: float | None, counts: bool, failures: int) -> ExitVerdict:
        restart = facts.cause if state is SlotState.BACKOFF else None
        order = RequestOrder(charge, slot_failed=state is SlotState.FAILED)
        return ExitVerdict(state, why, respawn_in, counts, restart, order, failures)

    if facts.state in (SlotState.DRAINING, SlotState.STOPPING):
        return verdict(SlotState.STOPPED, how, None, False, facts.failures_before)  # asked for: not a failure
    failures = facts.failures_before + 1
    if facts.repeated_load_error:
        # The same load error twice: a load that can never succeed (a bad spec, a factory that raises) is not
        # retried as a crash loop; a reload or `infervisor restart` tries again.
        why = f"{how} (twice in a row: not retried until a reload or restart)"
        return verdict(SlotState.FAILED, why, None, True, 2)
    too_many = f"{failures} failures within {config.restart_window_s:.0f} s; last: {how}"
    if facts.hung:
        # A hung worker is handled as a crash (counted toward max_restarts); the request itself is charged a
        # retry by the broker. The respawn is at once: one over-long request says little about the next start.
        if failures >= config.max_restarts:
            return verdict(SlotState.FAILED, too_many, None, True, failures)
        why = f"{how} after a request overran its hang budget; respawn now"
        return verdict(SlotState.BACKOFF, why, 0.0, True, failures)
    if charge is Charge.SPLIT:
        # A batch was running: the broker splits it to find the request that kills (each split costs one death,
        # a poison request alone is charged as usual), so these deaths are not the model's crash loop.
        why = f"{how} while running a batch; it is split, respawn now"
        return verdict(SlotState.BACKOFF, why, 0.0, False, facts.failures_before)
    if failures >= config.max_restarts:
        return verdict(SlotState.FAILED, too_many, None, True, failures)
    # A worker that never got ready (bad model, bad spec) backs off harder than one that crashed while serving.
    never_ready = facts.state is SlotState.STARTING or facts.code == WorkerExitCode.LOAD_FAILED
    delay = retry_in(ChildKind.WORKER, failures if never_ready else failures - 1)
    # One that answered requests before it ended is respawned at once, as a first crash is: waiting would only cost
    # capacity (a killed worker's slot was 1, 2, 4 s longer away at its second, third kill). The back-off is for
    # processes that end before answering anything (at their start, or on their first request), and
    # `max_restarts` in the window still fails a slot whose workers keep ending.
    served = facts.answered > 0 and not never_ready
    respawn_in = delay if never_ready or (failures > 1 and not served) else 0.0
    return verdict(SlotState.BACKOFF, f"{how}; respawn in {respawn_in:.1f} s", respawn_in, True, failures)
