"""Settling children's exits: each ended process's last words read, its exit judged by lifecycle/exit_decision.py,
the verdict applied. The end itself is noticed by the one reaper (workers/reaper.py), polled once per pool tick.

A serving worker's (`ExitReaper`, told by the reaper at once): the verdict's one order about the dead worker's
requests goes to the broker (`worker_lost`), only once the slot no longer serves, so none of them is routed back
to it. An audit or shadow
process's (`reap_runner`, at its owner's tick: lifecycle/audit_runner.py, lifecycle/shadow.py) and the OIP
gateway's (`keep_gateway`, at the arbiter's housekeeping) through `decide_child_exit`. A background builder's
end is judged by `decide_build_exit` in lifecycle/background_build.py `settle`, beside the build it ends.
"""

from __future__ import annotations

import collections

import structlog

from infervisor.protocol.constants import WorkerExitCode
from infervisor.supervisor.lifecycle.exit_decision import (
    ChildExitFacts,
    ChildExitVerdict,
    ExitFacts,
    decide_child_exit,
    decide_exit,
    same_error,
)
from infervisor.supervisor.lifecycle.roster import Roster
from infervisor.supervisor.routing.broker import Broker
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.serving_config import ServingConfig
from infervisor.supervisor.workers.audit_process import AuditProcess
from infervisor.supervisor.workers.gateway_process import GatewayProcess
from infervisor.supervisor.workers.launcher import ExitRecord, WorkerProcess
from infervisor.supervisor.workers.retry_policy import ChildKind
from infervisor.supervisor.workers.slot import LIVE_STATES, RestartReason, SlotState, WorkerSlot, describe_exit
from infervisor.supervisor.workers.worker_links import WorkerLinks

log = structlog.get_logger("supervisor")

#: Exits remembered per model: enough for every worker of a model to have crashed a few times over.
_EXITS_KEPT = 64


class ExitReaper:
    """Collects exited workers and settles their slots; keeps how each model's last workers ended."""

    def __init__(
        self,
        roster: Roster,
        serving: ServingConfig,
        links: WorkerLinks,
        broker: Broker,
        restarts: collections.Counter[tuple[str, RestartReason]],
    ) -> None:
        self.roster = roster
        self.serving = serving
        self.links = links
        self.broker = broker
        self.restarts = restarts
        #: Per model, how its last workers ended: a new worker tells a crashing profile from a stopped one by it.
        self.recent_exits: dict[str, collections.deque[ExitRecord]] = {}
        #: Workers that exited LOAD_FAILED, per model (`infervisor_worker_load_failures_total`).
        self.load_failures: collections.Counter[str] = collections.Counter()

    def reaped(self, slot: WorkerSlot, process: WorkerProcess, code: int, now: float) -> None:
        """The reaper saw the slot's `process` end: settled, unless the slot holds another process by now."""
        if slot.proc.process is process and slot.state in LIVE_STATES:
            self.on_exit(slot, code, now)

    def on_exit(self, slot: WorkerSlot, code: int, now: float) -> None:
        """Handle one worker exit: deliver what it wrote, settle the slot, then re-dispatch what it held."""
        # First: its last words (a LOAD_ERROR written just before it exited) may still be in the link, unread when
        # the exit is reaped; the exit's reason and the crash-loop verdict need them.
        self.links.drain(slot)
        how = describe_exit(code)
        slot.end_descendants()
        if code == WorkerExitCode.LOAD_FAILED:
            self.load_failures[slot.model.name] += 1
            if slot.proc.load_error:
                # The worker's own words (what to declare, which file is missing) reach status, not only its log.
                how = f"{how}: {slot.proc.load_error}"
        # Status says why we killed it (which profile overran its build, which request hung), not only the signal.
        proc = slot.proc
        slot.notes.last_exit = f"{how} ({proc.kill_reason})" if proc.killed and proc.kill_reason else how
        exits = self.recent_exits.setdefault(slot.model.name, collections.deque(maxlen=_EXITS_KEPT))
        pid = proc.process.pid if proc.process is not None else None
        signal_number = -code if code < 0 else None
        exits.append(
            {
                "pid": pid,
                "how": how,
                "signal": signal_number,
                "killed_by_supervisor": proc.killed,
                # The next worker of the model skips a profile whose build keeps overrunning (profiles/attempts.py).
                "compile_overrun": proc.compile_overrun,
            }
        )
        self.links.detach(slot)
        if slot.state not in (SlotState.DRAINING, SlotState.STOPPING):
            log.warning("worker_exited", slot=slot.name, pid=pid, how=how)
        facts = self.exit_facts(slot, code, how, now)
        verdict = decide_exit(facts, self.serving.current)
        if verdict.counts:
            slot.record_failure(now)
        if verdict.restart is not None:
            self.restarts[(slot.model.name, verdict.restart)] += 1  # a FAILED slot is not restarted: the gauge shows it
        if verdict.respawn_in is not None:
            slot.respawn_at = now + verdict.respawn_in
        slot.transition(verdict.state, verdict.why)
        if verdict.state is SlotState.FAILED:
            load_error = {"load_error": slot.notes.last_load_error} if facts.repeated_load_error else {}
            log.error("worker_slot_failed", slot=slot.name, failures=verdict.failures, last_exit=how, **load_error)
        # Only now, with the slot no longer SERVING, can its requests not be routed back to it.
        self.broker.worker_lost(slot, how, verdict.requests)

    def exit_facts(self, slot: WorkerSlot, code: int, how: str, now: float) -> ExitFacts:
        """What the exit decision reads of an ended process: its slot, its load error, and what it was running."""
        proc = slot.proc
        repeated = False
        if slot.state not in (SlotState.DRAINING, SlotState.STOPPING):
            load_error = proc.load_error if code == WorkerExitCode.LOAD_FAILED else ""
            repeated = bool(load_error) and same_error(load_error, slot.notes.last_load_error)
            slot.notes.last_load_error = load_error
        return ExitFacts(
            state=slot.state,
            code=code,
            how=how,
            cause=(proc.kill_cause if proc.killed else None) or RestartReason.CRASH,
            repeated_load_error=repeated,
            hung=proc.hung_request,
            running=self.broker.load_of(slot).running_count(),
            failures_before=slot.failures_within(now, self.serving.current.restart_window_s),
            answered=proc.requests,
        )


def reap_runner(
    process: AuditProcess,
    now: float,
    *,
    failed_start: str | None = None,
    waiting: int = 0,
    oldest_sent_at: float | None = None,
    watch: bool = False,
) -> ChildExitVerdict | None:
    """An audit or shadow process's turn: its exit (or a start that failed), else, with `watch`, how long it has
    been stopped or without CPU time while `waiting` samples wait, and the oldest sample's age, judged by
    `decide_child_exit`; the verdict applied (ended, killed first if it lives, counted, its next start set)."""
    how = failed_start or process.exited()
    stopped = stalled = None
    if how is None and watch and process.running:
        stopped, stalled = process.stillness(waiting, now)
    facts = ChildExitFacts(
        kind=process.kind,
        how=how,
        ends_in_row=process.child.ends_in_row,
        ends=process.child.ends,
        waiting=waiting,
        oldest_sent_s=now - oldest_sent_at if oldest_sent_at is not None else None,
        stopped_s=stopped,
        stalled_s=stalled,
    )
    verdict = decide_child_exit(facts)
    if verdict is not None:
        process.ended(verdict.how, verdict.restart_in, verdict.ends_in_row, now)
    return verdict


def keep_gateway(gateway: GatewayProcess, now: float, config: Config) -> None:
    """The OIP gateway's turn: its exit (or a start that failed) judged by `decide_child_exit` and its back-off
    applied; started when config wants it and the back-off has passed."""
    ended = gateway.exited(now)
    if ended is not None:
        back_off_gateway(gateway, now, *ended)
    failed = gateway.tick(now, config)
    if failed is not None:
        back_off_gateway(gateway, now, failed, None)


def back_off_gateway(gateway: GatewayProcess, now: float, how: str, ran_s: float | None) -> None:
    """Apply the verdict on one end of the gateway: wait before its next start."""
    child = gateway.child
    facts = ChildExitFacts(ChildKind.GATEWAY, how, child.ends_in_row, child.ends, ran_s=ran_s)
    verdict = decide_child_exit(facts)
    if verdict is not None:
        gateway.ended(now, how, verdict.restart_in, verdict.ends_in_row)
