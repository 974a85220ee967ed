"""The build gate: a background builder's process group is stopped while a request is in flight.

On a box whose builder shares cores (or a core's hyperthreads, caches and memory bandwidth) with serving, even a
SCHED_IDLE compile slows the requests running beside it: bench/build_p99.py measured serving P99 x1.6 during a build
on 2 vCPUs, and x1.02-1.22 with the builder's group stopped whenever a request was in flight. The gate does that
from the supervisor's loop, with two limits so that a build still ends and its figures still hold:

- a floor: while serving stays busy, the builder keeps at least `build_min_share` of the wall time (a credit of
  pause seconds, earned while it runs, spent while it is stopped; at most `MAX_PAUSE_S` in a row), so a box that is
  never idle still finishes its build, more slowly;
- never while the builder times or warms up its candidates: a stop inside a timed run would be counted as that
  profile's latency and could change the pick.

The decision is pure (`GateClock.wanted`); `BuildGate` carries it out with SIGSTOP/SIGCONT to the group. A builder
stopped when the supervisor dies is continued by its stop sentinel (worker/stop_sentinel.py), so it can act on its
parent-death signal and end its tree.
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass

import structlog

from infervisor.protocol.constants import StartPhase

log = structlog.get_logger("supervisor")

#: The longest the builder stays stopped in a row while requests keep coming.
MAX_PAUSE_S = 1.0
#: The shortest run the floor gives a builder it wakes (shorter runs would cost more in signals than they build).
MIN_RUN_S = 0.1
#: The builder phases never paused: a stop inside a timed run would be counted as the profile's latency.
UNPAUSED_PHASES = frozenset({StartPhase.TIMING.value, StartPhase.WARMING.value})


class GateState(enum.Enum):
    """Whether the builder's group runs or is stopped."""

    RUNNING = "running"
    PAUSED = "paused"


@dataclass
class GateClock:
    """When to stop and continue a builder: stopped while serving is busy, within the floor's credit."""

    #: The least share of wall time the builder runs while serving stays busy (0: it waits for an idle moment).
    min_share: float
    state: GateState = GateState.RUNNING
    #: Seconds of stop the builder may still take in a row (refilled while it runs, at most MAX_PAUSE_S).
    credit_s: float = MAX_PAUSE_S
    updated_at: float | None = None
    #: A run the floor started lasts until then, busy or not.
    forced_until: float = 0.0

    def advance(self, now: float) -> None:
        """Spend the credit for the time stopped, or earn it for the time run, since the last call."""
        elapsed = 0.0 if self.updated_at is None else max(0.0, now - self.updated_at)
        self.updated_at = now
        if self.state is GateState.PAUSED:
            self.credit_s -= elapsed
        elif self.min_share <= 0.0:
            self.credit_s = MAX_PAUSE_S
        else:
            earned = elapsed * (1.0 - self.min_share) / self.min_share
            self.credit_s = min(MAX_PAUSE_S, self.credit_s + earned)

    def wanted(self, now: float, busy: bool, may_pause: bool) -> tuple[GateState, bool]:
        """The state the builder should be in, and whether the floor forces this run."""
        self.advance(now)
        if not busy or not may_pause or self.min_share >= 1.0 or now < self.forced_until:
            return GateState.RUNNING, False
        if self.min_share > 0.0 and self.credit_s <= 0.0:
            if self.state is GateState.PAUSED:
                self.forced_until = now + MIN_RUN_S
                return GateState.RUNNING, True
            return GateState.RUNNING, False
        return GateState.PAUSED, False


@dataclass
class GateTally:
    """What the gate did to one builder, for status."""

    paused_s: float = 0.0
    pauses: int = 0
    #: Runs the floor gave the builder while serving was still busy.
    forced_runs: int = 0
    paused_at: float | None = None
    #: Whether the gate was on at its last look (config build_yield).
    on: bool = True

    def report(self, now: float) -> dict[str, object]:
        """The `build.gate` object of a model's status."""
        current = now - self.paused_at if self.paused_at is not None else 0.0
        return {
            "on": self.on,
            "paused": self.paused_at is not None,
            "paused_s": round(self.paused_s + current, 2),
            "pauses": self.pauses,
            "forced_runs": self.forced_runs,
        }


class BuildGate:
    """Stops one builder's process group while serving is busy, and continues it, within the floor."""

    def __init__(self, group: int, min_share: float) -> None:
        #: The builder's pid, which leads its process group (an unreaped child of ours, so it names no other group).
        self.group = group
        self.clock = GateClock(min_share)
        self.tally = GateTally()

    def reconcile(self, now: float, busy: bool, phase: str, enabled: bool, min_share: float) -> None:
        """Bring the group to the state the clock wants for `busy` serving and the builder's `phase`."""
        self.clock.min_share, self.tally.on = min_share, enabled
        wanted, forced = self.clock.wanted(now, busy and enabled, phase not in UNPAUSED_PHASES)
        if forced:
            self.tally.forced_runs += 1
        if wanted is not self.clock.state:
            self.transition(wanted, now)

    def transition(self, state: GateState, now: float) -> None:
        """Signal the group into `state` and count it."""
        try:
            os.killpg(self.group, signal.SIGSTOP if state is GateState.PAUSED else signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            return  # the builder is gone: its end is settled by the builds' turn
        self.clock.state = state
        if state is GateState.PAUSED:
            self.tally.pauses += 1
            self.tally.paused_at = now
        elif self.tally.paused_at is not None:
            self.tally.paused_s += now - self.tally.paused_at
            self.tally.paused_at = None

    def close(self, now: float) -> None:
        """The builder has ended (or is being killed): a stop in progress ends with it in the tally."""
        if self.tally.paused_at is not None:
            self.tally.paused_s += now - self.tally.paused_at
            self.tally.paused_at = None
        self.clock.state = GateState.RUNNING
