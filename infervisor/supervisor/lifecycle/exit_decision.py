"""What a child's exit means, decided in one place: each kind's retry policy as one pure function.

Every function here reads only its arguments (like routing/batcher.py's `decide`): the facts its owner read once
when the process ended, or was found hung or stuck, and returns a verdict in one vocabulary (`Then`: restart now,
restart after a back-off, fail with the reason, done):

- a serving worker, `decide_exit(ExitFacts, config) -> ExitVerdict`: the slot's new state and why, when it
  respawns, whether the exit counts toward `max_restarts`, the restart reason counted in
  `infervisor_worker_restarts_total`, and the one order the broker gets about the requests the worker held
  (`RequestOrder`: whom it `Charge`s). The pool's exit reaper applies it (lifecycle/exits.py `on_exit`); the broker
  carries out the order on the request side (`worker_lost`, which reads it as its `LostWork`);
- a background builder, `decide_build_exit(BuildExitFacts) -> BuildExitVerdict`: done, failed, or started again
  at once with the profile it was on blamed or not (lifecycle/background_build.py `settle` applies it);
- an audit or shadow process and the OIP gateway, `decide_child_exit(ChildExitFacts) -> ChildExitVerdict`: their
  hang and stuck limits, the back-off before the next start and when to give up, one row per kind in
  `CHILD_LIMITS` (lifecycle/exits.py `reap_runner` and `reap_gateway` apply it).

How long each kind waits is a row of workers/retry_policy.py `POLICIES`, read here through `retry_in`.
"""

from __future__ import annotations

import enum
import re
import signal
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


class Then(enum.Enum):
    """What follows a child's end, for every kind."""

    RESTART_NOW = "restart now"
    #: Started again once its back-off (the verdict's `restart_in`) has passed.
    RESTART_LATER = "restart after back-off"
    #: Not started again: the reason says why (a slot FAILED, a build failed, a shadow given up).
    FAIL = "fail"
    #: Its work is over (a drained or stopped worker, a builder that finished).
    DONE = "done"


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

    @property
    def then(self) -> Then:
        """The verdict in every kind's words."""
        if self.state is SlotState.FAILED:
            return Then.FAIL
        if self.state is not SlotState.BACKOFF:
            return Then.DONE
        return Then.RESTART_NOW if not self.respawn_in else Then.RESTART_LATER


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


# ---- a background builder ------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildExitFacts:
    """What the background build knew when its builder process ended."""

    code: int
    #: The exit as status says it (`describe_exit`).
    how: str
    #: Builder processes started for this build, this one included.
    attempts: int
    #: Profiles in the model's chain.
    chain: int
    #: Where the builder was (its last PROGRESS): the phase, and the profile ("" before it reached one).
    phase: str
    profile: str
    #: Ends by a signal earlier builders of this build took on that profile.
    kills_before: int


@dataclass(frozen=True)
class BuildExitVerdict:
    """What follows a builder's end: DONE (switch to its pick), FAIL (the reason), or RESTART_NOW (next tick)."""

    then: Then
    why: str
    #: Ends by a signal on the profile, this one included (None: no profile is blamed, nothing passed on).
    kills: int | None = None
    #: Passed on to the next builder as an interruption (the profile is built again), else as that profile's
    #: native crash (the next builder refuses it, worker/profiles/attempts.py).
    interrupted: bool = False
    #: Seconds before the next builder starts (RESTART_NOW: the builder's row of retry_policy.py).
    restart_in: float = 0.0


def decide_build_exit(facts: BuildExitFacts) -> BuildExitVerdict:
    """A builder's end: done at 0; failed on an exit code or past its attempts; else started again at once.

    A first SIGKILL on a profile (the OOM killer, kill -9, a reboot's stop) is an interruption and the profile is
    built again; any other signal, or a second end on it, refuses that profile and the chain goes on. A builder
    killed before it reached a profile blames nothing.
    """
    code, how = facts.code, facts.how
    if code == 0:
        return BuildExitVerdict(Then.DONE, "built")
    if code > 0 or facts.attempts > facts.chain + 1:
        why = f"the builder ended with {how} while {facts.phase or 'starting'} {facts.profile}".rstrip()
        return BuildExitVerdict(Then.FAIL, why)
    restart_in = retry_in(ChildKind.BUILDER, facts.attempts)
    if not facts.profile:
        why = f"{how} before it reached a profile: nothing to blame"
        return BuildExitVerdict(Then.RESTART_NOW, why, restart_in=restart_in)
    kills = facts.kills_before + 1
    interrupted = -code == signal.SIGKILL and kills == 1
    then = "built again" if interrupted else "refused by the next builder"
    return BuildExitVerdict(Then.RESTART_NOW, f"{how} on {facts.profile}: {then}", kills, interrupted, restart_in)


# ---- an audit or shadow process, the OIP gateway -------------------------------------------------


@dataclass(frozen=True)
class ChildLimits:
    """One kind's rules beside its back-off: when a live process is ended, when its ends stop counting, when to
    give up. None: no such rule for the kind."""

    #: A sample sent and unanswered this long: the process hangs, it is killed (at idle priority on a busy box it
    #: may be slow, not dead).
    hang_s: float | None = None
    #: Stopped (SIGSTOP, a debugger) this long while samples wait: stuck, killed.
    stopped_s: float | None = None
    #: No CPU time gained this long while samples wait: stuck, killed. Even at idle priority on a saturated box a
    #: live process gains some (SCHED_IDLE has a small weight, not none), so this is a wedged process, not a slow one.
    stalled_s: float | None = None
    #: After this many ends the process's work is given up (FAIL).
    max_ends: int | None = None
    #: A process that ran this long before ending starts its back-off afresh.
    stable_s: float | None = None


#: Each kind's limits. The shadow's tick reads no /proc state, so it is never judged stuck; its candidate is given
#: up, unrecorded, after three ends (crash, load failure, hang).
CHILD_LIMITS: dict[ChildKind, ChildLimits] = {
    ChildKind.AUDIT: ChildLimits(hang_s=300.0, stopped_s=3.0, stalled_s=60.0),
    ChildKind.SHADOW: ChildLimits(hang_s=300.0, max_ends=3),
    ChildKind.GATEWAY: ChildLimits(stable_s=60.0),
}


@dataclass(frozen=True)
class ChildExitFacts:
    """What the owner of an audit, shadow or gateway process read of it, once, at its tick."""

    kind: ChildKind
    #: How it ended on its own (exit, broken link, could not start); None while it lives.
    how: str | None
    #: Its ends in a row before this one (reset by a READY, or by a stable run).
    ends_in_row: int
    #: Its ends so far, before this one.
    ends: int = 0
    #: How long it ran before it ended (None: it never started).
    ran_s: float | None = None
    #: Samples waiting for it (held or sent), and the age of the oldest one sent and unanswered.
    waiting: int = 0
    oldest_sent_s: float | None = None
    #: While samples wait: how long it has been seen stopped, how long it gained no CPU time (None: not read).
    stopped_s: float | None = None
    stalled_s: float | None = None


@dataclass(frozen=True)
class ChildExitVerdict:
    """What follows: RESTART_LATER (after `restart_in`), or FAIL (its work given up)."""

    then: Then
    #: The end as status says it (`last_exit`).
    how: str
    #: Why that follows.
    why: str
    restart_in: float
    #: Its ends in a row, this one included (what the next back-off reads).
    ends_in_row: int
    #: It still lives: end it first (hung or stuck).
    kill: bool


def why_ended(facts: ChildExitFacts, limits: ChildLimits) -> str | None:
    """Why a live process is ended (stuck, then hung), else None."""
    waiting = facts.waiting
    if limits.stopped_s is not None and facts.stopped_s is not None and facts.stopped_s >= limits.stopped_s:
        return f"stuck: stopped for {facts.stopped_s:.0f} s with {waiting} samples waiting: killed"
    if limits.stalled_s is not None and facts.stalled_s is not None and facts.stalled_s >= limits.stalled_s:
        return f"stuck: no CPU time for {facts.stalled_s:.0f} s with {waiting} samples waiting: killed"
    if limits.hang_s is not None and facts.oldest_sent_s is not None and facts.oldest_sent_s > limits.hang_s:
        return f"no verdict for {limits.hang_s:.0f} s: ended as hung"
    return None


def decide_child_exit(facts: ChildExitFacts) -> ChildExitVerdict | None:
    """The verdict on an audit, shadow or gateway process: None while it lives within its limits; else it is
    started again after its kind's back-off, or given up after its kind's last end."""
    limits = CHILD_LIMITS[facts.kind]
    how, kill = facts.how, False
    if how is None:
        how, kill = why_ended(facts, limits), True
        if how is None:
            return None
    stable = limits.stable_s is not None and facts.ran_s is not None and facts.ran_s >= limits.stable_s
    in_row = (0 if stable else facts.ends_in_row) + 1
    restart_in = retry_in(facts.kind, in_row)
    if limits.max_ends is not None and facts.ends + 1 >= limits.max_ends:
        return ChildExitVerdict(Then.FAIL, how, f"{facts.ends + 1} ends: given up", restart_in, in_row, kill)
    return ChildExitVerdict(Then.RESTART_LATER, how, f"{how}; restart in {restart_in:.1f} s", restart_in, in_row, kill)
