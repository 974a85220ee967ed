"""Health per model, and the daemon's state derived from it: what READY=1, STATUS= and probes report."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from infervisor.common.text import clip
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot


class ModelHealth(enum.Enum):
    """How one model serves now."""

    STARTING = "starting"  # no worker has served yet; some are on their way
    SERVING = "serving"  # every member serves
    DEGRADED = "degraded"  # some members serve, others do not (backing off, starting, failed)
    UNAVAILABLE = "unavailable"  # it served before, no member serves now, some are on their way back
    FAILED = "failed"  # every member failed: it answers UNAVAILABLE until a reload or restart


class DaemonState(enum.Enum):
    """The daemon as a whole; `infervisor status --check` exits 0 for READY, 1 for DEGRADED, 2 otherwise."""

    STARTING = "starting"  # before READY=1: some model has neither a serving worker nor a reason it failed
    READY = "ready"  # every model serves with every worker
    DEGRADED = "degraded"  # some model serves with fewer workers or not at all, but some model serves
    DOWN = "down"  # no model serves
    STOPPING = "stopping"


@dataclass(frozen=True)
class ModelReport:
    """One model's health and, when it is not SERVING, why."""

    health: ModelHealth
    reason: str = ""


def _why(slot: WorkerSlot) -> str:
    return f"{slot.name} {slot.state.value}: {slot.reason}" if slot.reason else f"{slot.name} {slot.state.value}"


def model_report(members: Sequence[WorkerSlot], has_served: bool) -> ModelReport:
    """The health of a model from its members' states."""
    serving = [s for s in members if s.state is SlotState.SERVING]
    others = [s for s in members if s.state is not SlotState.SERVING]
    if members and not serving and all(s.state is SlotState.FAILED for s in members):
        return ModelReport(ModelHealth.FAILED, "; ".join(_why(s) for s in others))
    if serving and not others:
        return ModelReport(ModelHealth.SERVING)
    if serving:
        return ModelReport(ModelHealth.DEGRADED, "; ".join(_why(s) for s in others))
    if not has_served:
        return ModelReport(ModelHealth.STARTING, "; ".join(_why(s) for s in others) or "no worker yet")
    return ModelReport(ModelHealth.UNAVAILABLE, "; ".join(_why(s) for s in others) or "no worker in its pool")


def ready_to_announce(reports: Mapping[str, ModelReport]) -> bool:
    """READY=1 once every model either has a serving worker or has FAILED with a reason."""
    return all(r.health is not ModelHealth.STARTING for r in reports.values())


def daemon_state(reports: Mapping[str, ModelReport], announced: bool, stopping: bool) -> DaemonState:
    """The daemon's state from its models' health."""
    if stopping:
        return DaemonState.STOPPING
    if not announced:
        return DaemonState.STARTING
    healths = [r.health for r in reports.values()]
    if healths and all(h is ModelHealth.SERVING for h in healths):
        return DaemonState.READY
    if any(h in (ModelHealth.SERVING, ModelHealth.DEGRADED) for h in healths):
        return DaemonState.DEGRADED
    return DaemonState.DOWN


def status_line(reports: Mapping[str, ModelReport], state: DaemonState) -> str:
    """The sd_notify STATUS= text: the state, then each model that is not fully serving, and why."""
    serving = sum(1 for r in reports.values() if r.health in (ModelHealth.SERVING, ModelHealth.DEGRADED))
    parts = [f"{state.value}: {serving}/{len(reports)} model(s) serving"]
    parts += [f"{n} {r.health.value} ({r.reason})" for n, r in reports.items() if r.health is not ModelHealth.SERVING]
    # systemd shows one line; keep it readable in `systemctl status`, ending at a whole reason.
    return clip("; ".join(parts), 1000)
