"""Acting on what the monitors find: one response per `Action`, in one table.

A finding is logged as data and noted on its slot for status; then its action's response probes,
recycles, kills or moves the model down its chain, or, for a finding about the box (SHED), sheds load.
Canary answers come back here to be judged, and the `profile` command's probe leaves from here too,
since both number their questions in one sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.core.fallback_control import FallbackControl
from infervisor.supervisor.lifecycle.pool import WorkerPool
from infervisor.supervisor.monitors.canary import CanaryWatch
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.slot import RestartReason, WorkerSlot
from infervisor.supervisor.workers.worker_links import WorkerLinks

log = structlog.get_logger("supervisor")


class Responses:
    """Carries out findings on the workers they name, and numbers the probes sent to workers."""

    def __init__(
        self,
        serving: ServingConfig,
        pool: WorkerPool,
        broker: Broker,
        links: WorkerLinks,
        fallback: FallbackControl,
        canaries: CanaryWatch,
    ) -> None:
        self.serving = serving
        self.pool = pool
        self.broker = broker
        self.links = links
        self.fallback = fallback
        self.canaries = canaries
        #: Sequence numbers of canary and profile requests, so an answer matches its question.
        self.probe_seq = 0

    def act(self, finding: Finding) -> None:
        """Log a finding as data, show it in status, and respond to it as its action says."""
        slot = finding.slot
        if finding.action not in (Action.RECORD, Action.CANARY):
            where = {"slot": slot.name, "pid": slot.pid} if slot is not None else {}
            action = finding.action.value
            log.warning("monitor_fired", monitor=finding.monitor, action=action, **where, **finding.detail)
        RESPONSES[finding.action](self, finding)

    def judge_canary(self, slot: WorkerSlot, result: wm.CanaryResult) -> None:
        """Judge a canary: outputs on the golden inputs must still match this worker's own warm-up outputs."""
        model = self.serving.model(slot.model.name) or slot.model
        self.act(self.canaries.judge(slot, model, result, time.monotonic()))

    def send_probe(self, slot: WorkerSlot, probe: Callable[[int], wm.Canary | wm.Profile]) -> int | None:
        """Send a numbered probe to a worker; its number, or None when its link does not carry."""
        self.probe_seq += 1
        return self.probe_seq if self.links.send_control(slot, probe(self.probe_seq)) else None

    def start_profile(self, model: str, requests: int) -> dict[str, Any]:
        """Ask one serving worker of `model` to profile its next requests; the report appears in its status."""
        serving = self.pool.roster.serving_members().get(model, [])
        if not serving:
            return {"ok": False, "error": f"model {model[:128]!r} has no serving worker"}
        slot = serving[0]
        seq = self.send_probe(slot, lambda seq: wm.Profile(seq, requests))
        if seq is None:
            return {"ok": False, "error": f"{slot.name} is not connected"}
        slot.proc.profile_started_at = time.monotonic()
        return {"ok": True, "slot": slot.assignment.slot, "pid": slot.pid, "seq": seq}


def _record(responses: Responses, slot: WorkerSlot, finding: Finding) -> None:
    slot.notes.last_event = {"monitor": finding.monitor, **finding.detail}


def _note(responses: Responses, slot: WorkerSlot, finding: Finding) -> None:
    slot.notes.last_event = {"monitor": finding.monitor, "action": finding.action.value, **finding.detail}


def _canary(responses: Responses, slot: WorkerSlot, finding: Finding) -> None:
    responses.send_probe(slot, wm.Canary)


def _recycle(responses: Responses, slot: WorkerSlot, finding: Finding) -> None:
    _note(responses, slot, finding)
    responses.pool.recycle(slot, f"monitor {finding.monitor}")


def _kill(responses: Responses, slot: WorkerSlot, finding: Finding) -> None:
    _note(responses, slot, finding)
    slot.kill(f"monitor {finding.monitor}", RestartReason.MONITOR_KILL)


def _fall_back(responses: Responses, slot: WorkerSlot, finding: Finding) -> None:
    _note(responses, slot, finding)
    if responses.fallback.for_finding(slot, finding):
        responses.canaries.forget(slot.model.name)  # a fresh count for the profile it falls back to
    else:
        responses.pool.recycle(slot, f"monitor {finding.monitor}")  # nothing below in its chain


def _shed(responses: Responses, finding: Finding) -> None:
    responses.broker.shed_load(bool(finding.detail.get("shed")))


Response = Callable[[Responses, Finding], None]


def _on_slot(respond: Callable[[Responses, WorkerSlot, Finding], None]) -> Response:
    """A response to the worker a finding names; a finding about the box alone is only logged."""

    def on_finding(responses: Responses, finding: Finding) -> None:
        if finding.slot is not None:
            respond(responses, finding.slot, finding)

    return on_finding


#: What each action does: to the slot a finding names, or (SHED) to the box.
RESPONSES: dict[Action, Response] = {
    Action.RECORD: _on_slot(_record),
    Action.NOTE: _on_slot(_note),
    Action.CANARY: _on_slot(_canary),
    Action.RECYCLE: _on_slot(_recycle),
    Action.KILL: _on_slot(_kill),
    Action.FALLBACK: _on_slot(_fall_back),
    Action.SHED: _shed,
}
