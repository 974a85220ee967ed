"""The live audit's runner: each audited model's sampler and audit process, and the verdicts they return.

The broker offers every successful answer (`offer`); within the model's CPU budget (audit_sampler.py) the
request's frames and the served answer are held and sent to the model's audit process
(workers/audit_process.py; while it starts, one sample waits and nothing more is taken), which re-runs them on
eager fp32 at the lowest CPU priority and judges them by the gate's own measures and the model's `tolerance`.
The runner collects those verdicts; the audit monitor (monitors/audit.py) takes them at its turn, counts them
and reports a row below tolerance as a finding. The pool ticks the runner (`tick`), as it does the background
builds: it starts the process when samples wait, restarts it after its back-off, kills it when it hangs or is
stuck (lifecycle/exits.py `reap_runner`: the limits and the back-off are lifecycle/exit_decision.py's), and stops
it when the model serves nothing to audit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from infervisor.supervisor.lifecycle.audit_sampler import HeldSamples, Sample, audited
from infervisor.supervisor.lifecycle.exits import reap_runner
from infervisor.supervisor.monitors.audit_feed import AuditRunFacts, AuditVerdict
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.audit_process import AuditProcess, AuditState
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot

log = structlog.get_logger("supervisor")


def model_fingerprint(model: ModelConfig) -> tuple[object, ...]:
    """What eager fp32 and the verdict depend on: the source (and its file's size and mtime), specs, tolerance."""
    stat: tuple[int, int] | None = None
    if model.source.path is not None:
        try:
            found = os.stat(model.source.path)
            stat = (found.st_mtime_ns, found.st_size)
        except OSError:
            stat = None
    return (model.source, stat, model.inputs, model.outputs, tuple(sorted(model.tolerance.items())))


#: How often the model file and the audit processes' state are looked at (the verdicts: every tick).
CHECK_EVERY_S = 0.25


@dataclass
class ModelAuditRun:
    """One model's audit as the runner keeps it: its samples, its process, and the model it judges by."""

    process: AuditProcess
    samples: HeldSamples = field(default_factory=HeldSamples)
    #: What the audit process loads and judges by (model_fingerprint), when it was last seen unchanged, and the
    #: earliest moment the change can have happened (monotonic): a worker spawned after it serves the new model.
    fingerprint: tuple[object, ...] | None = None
    checked_at: float = 0.0
    changed_at: float = 0.0
    #: Changes seen: each verdict carries the count, so the monitor knows when to judge a profile afresh.
    changes: int = 0


class AuditRunner:
    """Samples served answers within each model's budget, keeps each model's audit process, collects verdicts."""

    def __init__(
        self, config: Callable[[], Config], members: Callable[[str], Sequence[WorkerSlot] | None], children: Children
    ) -> None:
        self.config = config
        #: Where an audit process's end is noticed and its link read.
        self.children = children
        #: The model's worker slots: which profiles it serves, and the cores its audit process shares.
        self.members = members
        self.runs: dict[str, ModelAuditRun] = {}
        self.seq = 0
        self.checked_at = -CHECK_EVERY_S
        #: Verdicts collected since the monitor's last turn; at most one a second per model (MIN_INTERVAL_S).
        self.verdicts: list[AuditVerdict] = []

    # ---- the broker's side: one call per successful answer --------------------------------------

    def offer(self, slot: WorkerSlot, request: PendingRequest, answer: list[Any]) -> None:
        """Hold this answer for the audit if its model is audited and the budget has room (never blocks, never
        raises: a bug here costs a sample, never the reply the broker sends next)."""
        try:
            self.take(slot, request, answer)
        except Exception:  # noqa: BLE001 - the audit must not reach serving
            log.exception("audit_offer_failed", model=slot.model.name)

    def take(self, slot: WorkerSlot, request: PendingRequest, answer: list[Any]) -> None:
        """Hold the answer and send it on when the model is audited, the budget allows and the queue has room."""
        model = self.config().models.get(slot.model.name)
        profile = slot.proc.profile
        if model is None or profile is None or not audited(model, profile) or request.reader is not None:
            return
        run = self.runs.get(model.name)
        if run is None:
            run = self.runs[model.name] = ModelAuditRun(AuditProcess(model.name, self.children))
        samples = run.samples
        if run.process.state is not AuditState.READY and samples.count():
            return  # one sample waits for the process to (re)start: nothing more is held, and nothing is dropped
        if slot.proc.spawned_at < run.changed_at:
            return  # a worker of the model as it was before its file or config changed: eager is the new one
        now = time.monotonic()
        if not samples.interval_passed(now):
            return
        cost = samples.cost_ms(slot, request.rows)
        if not samples.bucket_holds(model.audit.budget, cost, now):
            return
        size = sum(len(f) for f in request.frames) + sum(len(f) for f in answer)
        # Verdicts read now, not only at the tick: the queue then holds what the process has not done yet.
        self.collect(model.name, run)
        if not samples.room_for(size):
            samples.dropped += 1
            return
        self.seq += 1
        # The client's frames are immutable and only referenced; the answer is copied (its link buffer is reused).
        sample = Sample(self.seq, list(request.frames), [bytes(f) for f in answer], request.rows, slot, profile, size)
        samples.hold(sample, cost, now)
        self.send_waiting(run, now)

    def send_waiting(self, run: ModelAuditRun, now: float) -> None:
        """Hand the waiting samples to a ready audit process."""
        samples = run.samples
        while samples.waiting and run.process.state is AuditState.READY:
            sample = samples.waiting[0]
            if not run.process.send(sample.seq, sample.inputs, sample.answer):
                return
            samples.waiting.popleft()
            sample.sent_at = now
            samples.sent[sample.seq] = sample

    def collect(self, name: str, run: ModelAuditRun) -> None:
        """Take in the verdicts the model's audit process sent so far (the monitor judges them at its turn)."""
        for result in run.process.receive():
            sample = run.samples.answered(result)
            if sample is not None:
                self.verdicts.append(
                    AuditVerdict(name, sample.profile, sample.slot, sample.slot.pid, result, run.changes)
                )

    # ---- the pool's tick ------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Keep each audited model's process, collect its verdicts and send what waits."""
        config = self.config()
        for name in list(self.runs):
            if name not in config.models:
                self.runs.pop(name).process.stop()
        # The model file's stat and the process's /proc reads every CHECK_EVERY_S, not at every 20 ms tick.
        checking = now - self.checked_at >= CHECK_EVERY_S
        if checking:
            self.checked_at = now
        for name, run in self.runs.items():
            model = config.models[name]
            if checking:
                self.follow_changes(run, model, now)
            serving = [slot for slot in self.members(name) or () if slot.state is SlotState.SERVING]
            served = {slot.proc.profile for slot in serving if slot.proc.profile}
            if not any(audited(model, p) for p in served) or model.audit.budget <= 0:
                run.samples.forget(dropped=False)
                run.process.stop()
                continue
            if checking or not run.process.running:
                self.keep_process(run, config, model, serving, now)
            self.collect(name, run)
            self.send_waiting(run, now)

    def follow_changes(self, run: ModelAuditRun, model: ModelConfig, now: float) -> None:
        """A changed model file, source, spec or tolerance: the process loads it afresh, and answers of workers
        ready before the change are not judged against it (a rollout replaces them), lest the old weights'
        answers be called wrong by the new weights' eager."""
        fingerprint = model_fingerprint(model)
        if run.fingerprint is None or fingerprint == run.fingerprint:
            run.fingerprint, run.checked_at = fingerprint, now
            return
        # Not `now`: a rollout's worker (forked in a fraction of a second) may be serving the new model already.
        # A new file is no older than its mtime; a new config no older than the last tick that saw the old one.
        changed_at = run.checked_at
        stat = fingerprint[1]
        if stat is not None and stat != run.fingerprint[1]:
            written = stat[0] / 1e9  # type: ignore[index]
            changed_at = max(changed_at, now - max(0.0, time.time() - written))
        run.fingerprint, run.changed_at, run.checked_at = fingerprint, changed_at, now
        run.changes += 1
        run.samples.forget(dropped=False)
        run.process.stop()

    def keep_process(
        self, run: ModelAuditRun, config: Config, model: ModelConfig, serving: Sequence[WorkerSlot], now: float
    ) -> None:
        """Start the process when samples wait, restart it after its back-off, end it when it hangs or is stuck."""
        process, samples = run.process, run.samples
        oldest = min((s.sent_at for s in samples.sent.values() if s.sent_at is not None), default=None)
        if reap_runner(process, now, waiting=samples.count(), oldest_sent_at=oldest, watch=True) is not None:
            samples.forget(dropped=True)
        due = process.state is AuditState.OFF or now >= process.child.next_start
        if not process.running and samples.waiting and due:
            cpus = [cpu for slot in serving for cpu in slot.assignment.cpus]
            failed = process.start(config, model, cpus or sorted(os.sched_getaffinity(0)), now)
            if failed is not None:
                reap_runner(process, now, failed_start=failed)

    # ---- what the audit monitor reads (monitors/audit_feed.py: AuditFeed) ------------------------

    def hand_over(self) -> list[AuditVerdict]:
        """The verdicts collected since the last call, in the order they came."""
        verdicts, self.verdicts = self.verdicts, []
        return verdicts

    def facts(self, name: str) -> AuditRunFacts | None:
        """The model's samples, cost estimate, changes seen and process now (None when it was never sampled)."""
        run = self.runs.get(name)
        if run is None:
            return None
        process, samples = run.process, run.samples
        return AuditRunFacts(
            held=samples.count(),
            dropped=samples.dropped,
            cost_ms_per_row=samples.cost_ms_per_row,
            changes=run.changes,
            state=process.state,
            pid=process.pid,
            restarts=process.child.ends,
            last_exit=process.child.last_exit,
            error=process.error,
        )

    def stop_all(self) -> None:
        """The daemon stops: every audit process goes."""
        for run in self.runs.values():
            run.process.stop()
