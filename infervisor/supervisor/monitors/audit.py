"""The live audit: a sampled share of what a compiled or quantized profile answers, re-run on eager fp32.

The gate certifies a profile on the samples it sees; the audit keeps checking it on real traffic. The broker
offers every successful answer (`offer`); within the model's CPU budget (`audit.budget`, a share of one core)
the request's frames and the served answer are held in a bounded queue (full: dropped and counted) and sent to
the model's audit process (workers/audit_process.py; while it starts, one sample waits and nothing more is
taken), which re-runs them on eager fp32 at the lowest CPU
priority and judges them by the gate's own measures and the model's `tolerance`. A row below it is a finding:
by default the model falls back one step of its chain by the rolling replacement a repeated canary mismatch
takes (`audit.action: fallback`), else it is reported in status and metrics only (`report`).

What is sampled: requests whose inputs travelled in the message. Inputs a client left in shared memory are
never sampled: the broker never copies them (the worker reads them), and reading them later could see what
the client wrote there since, so a verdict on them could blame the profile for the client's next request.

The budget is spent by an estimate: the audit process reports the CPU time each audit took, and a sample is
taken when the bucket (filled at `budget` CPU-ms per ms, holding 1 s of it, or one audit) has that much for its
rows: a burst after a quiet spell stays one second's share. And at most one sample a second (MIN_INTERVAL_S):
a fast model's P99 feels each sample's fixed cost, which the CPU budget does not count.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.monitors.audit_tally import AuditTally
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.readings import Reading, Readings, Scope
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.audit_keys import AuditAction
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.audit_process import HANG_S, AuditProcess, AuditState
from infervisor.supervisor.workers.slot import SlotState, WorkerSlot

log = structlog.get_logger("supervisor")

#: Samples held per model (waiting and sent), and their bytes: the audit's memory stays small and bounded.
MAX_HELD = 8
MAX_HELD_BYTES = 64 * 2**20
#: Seconds of budget the bucket holds: a burst after a quiet spell stays this small.
_BUCKET_S = 1.0
#: A profile still served this long after a finding acted on it (its fallback refused, rolled back or undone by
#: the operator's reset) is acted on again at its next row below tolerance.
ACT_AGAIN_S = 600.0
#: Before the audit process has timed one row: eager is taken to cost this many times the served service time.
_FIRST_GUESS_FACTOR = 2.0
#: At most one sample a second per model, whatever the budget allows. Each sample has a cost the budget does not
#: count: the messages, the supervisor's share, and the audit's pass evicting the worker's caches on its core. A
#: millisecond model audited 29 times a second (0.02 of a core) had its P99 raised 1.2-1.5x; once a second, not.
MIN_INTERVAL_S = 1.0


@dataclass
class Sample:
    """One served request held for the audit: its frames as the worker got them, and the answer it gave."""

    seq: int
    inputs: list[Any]
    answer: list[bytes]
    rows: int
    slot: WorkerSlot
    profile: str
    nbytes: int
    sent_at: float | None = None


@dataclass
class ModelAudit:
    """One model's audit: its budget bucket, held samples, process and tally."""

    process: AuditProcess
    tally: AuditTally = field(default_factory=AuditTally)
    waiting: collections.deque[Sample] = field(default_factory=collections.deque)
    sent: dict[int, Sample] = field(default_factory=dict)
    tokens_ms: float | None = None
    filled_at: float = 0.0
    #: When the last sample was taken (monotonic): the next one waits MIN_INTERVAL_S.
    sampled_at: float | None = None
    #: Profile -> when a finding acted on it (monotonic): one action per profile while its fallback rolls out;
    #: forgotten once it serves nowhere, or after ACT_AGAIN_S if it still serves (that fallback did not take).
    acted_on: dict[str, float] = field(default_factory=dict)
    #: What the audit process loads and judges by (model_fingerprint), when it was last seen unchanged, and the
    #: earliest moment the change can have happened (monotonic): a worker spawned after it serves the new model.
    fingerprint: tuple[object, ...] | None = None
    checked_at: float = 0.0
    changed_at: float = 0.0

    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.waiting) + sum(s.nbytes for s in self.sent.values())


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


def audited(model: ModelConfig | None, profile: str | None) -> bool:
    """Whether answers of `profile` for `model` are audited: a budget, and a profile other than eager fp32."""
    return model is not None and model.audit.budget > 0 and profile is not None and profile != REFERENCE_PROFILE


#: Status `models.NAME.audit`, nested; its metric families (a 0/1 series per process state, the worst row's
#: cosine inside `worst`) keep a shape of their own, rendered from this reading by observe/audit_metrics.py.
AUDIT_READINGS = (Reading("audit", Scope.MODEL, "the model's live audit: what it reran, what it found, its process"),)


class AuditWatch:
    """Samples served answers within each model's budget, keeps each model's audit process, reports findings."""

    def __init__(self) -> None:
        self.audits: dict[str, ModelAudit] = {}
        self.config: Config | None = None
        self.seq = 0
        #: Findings of verdicts read between monitor turns (when a sample is taken), reported at the next turn.
        self.found: list[Finding] = []

    # ---- the broker's side: one call per successful answer --------------------------------------

    def offer(self, slot: WorkerSlot, request: PendingRequest, answer: list[Any]) -> None:
        """Hold this answer for the audit if its model is audited and the budget has room (never blocks, never
        raises: a bug here costs a sample, never the reply the broker sends next)."""
        try:
            self.take(slot, request, answer)
        except Exception:  # noqa: BLE001 - the audit must not reach serving
            log.exception("audit_offer_failed", model=slot.model.name)

    def take(self, slot: WorkerSlot, request: PendingRequest, answer: list[Any]) -> None:
        model = self.config.models.get(slot.model.name) if self.config is not None else None
        profile = slot.proc.profile
        if model is None or not audited(model, profile) or request.reader is not None or profile is None:
            return
        audit = self.audits.get(model.name)
        if audit is None:
            audit = self.audits[model.name] = ModelAudit(AuditProcess(model.name))
        if audit.process.state is not AuditState.READY and (audit.waiting or audit.sent):
            return  # one sample waits for the process to (re)start: nothing more is held, and nothing is dropped
        if slot.proc.spawned_at < audit.changed_at:
            return  # a worker of the model as it was before its file or config changed: eager is the new one
        now = time.monotonic()
        if audit.sampled_at is not None and now - audit.sampled_at < MIN_INTERVAL_S:
            return  # the budget keeps filling meanwhile: it is counted from `filled_at`
        cost = self.cost_ms(audit, slot, request.rows)
        cap = max(model.audit.budget * _BUCKET_S * 1000.0, cost)
        earned = model.audit.budget * (now - audit.filled_at) * 1000.0 if audit.tokens_ms is not None else cap
        audit.tokens_ms, audit.filled_at = min(cap, (audit.tokens_ms or 0.0) + earned), now
        if audit.tokens_ms < cost:
            return
        size = sum(len(f) for f in request.frames) + sum(len(f) for f in answer)
        # Verdicts read now, not only at the monitor turn: the queue then holds what the process has not done yet.
        self.read_verdicts(audit, model)
        if len(audit.waiting) + len(audit.sent) >= MAX_HELD or audit.held_bytes() + size > MAX_HELD_BYTES:
            audit.tally.dropped += 1
            return
        audit.tokens_ms -= cost
        audit.sampled_at = now
        self.seq += 1
        # The client's frames are immutable and only referenced; the answer is copied (its link buffer is reused).
        sample = Sample(self.seq, list(request.frames), [bytes(f) for f in answer], request.rows, slot, profile, size)
        audit.waiting.append(sample)
        self.send_waiting(audit, now)

    @staticmethod
    def cost_ms(audit: ModelAudit, slot: WorkerSlot, rows: int) -> float:
        """CPU ms auditing `rows` rows is expected to take (the audit's own timing once it has one)."""
        per_row = audit.tally.cost_ms_per_row
        if per_row is not None:
            return per_row * rows
        served = slot.proc.latencies_ms[-1] if slot.proc.latencies_ms else 1.0
        return _FIRST_GUESS_FACTOR * served

    def send_waiting(self, audit: ModelAudit, now: float) -> None:
        """Hand the waiting samples to a ready audit process."""
        while audit.waiting and audit.process.state is AuditState.READY:
            sample = audit.waiting[0]
            if not audit.process.send(sample.seq, sample.inputs, sample.answer):
                return
            audit.waiting.popleft()
            sample.sent_at = now
            audit.sent[sample.seq] = sample

    # ---- the monitor turn ---------------------------------------------------------------------

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Keep each audited model's process, read its verdicts, and report rows below tolerance."""
        self.config = view.config
        for name in list(self.audits):
            if name not in view.config.models:
                self.audits.pop(name).process.stop()
        for name, audit in self.audits.items():
            model = view.config.models[name]
            self.follow_changes(audit, model, now)
            serving = view.serving.get(name, ())
            served = {s.proc.profile for s in serving if s.proc.profile}
            audit.acted_on = {p: at for p, at in audit.acted_on.items() if p in served and now - at < ACT_AGAIN_S}
            if not any(audited(model, p) for p in served) or model.audit.budget <= 0:
                self.forget_samples(audit, dropped=False)
                audit.process.stop()
                continue
            self.keep_process(audit, model, view, now)
            self.read_verdicts(audit, model)
            self.send_waiting(audit, now)
        findings, self.found = self.found, []
        return findings

    def read_verdicts(self, audit: ModelAudit, model: ModelConfig) -> None:
        """Judge the verdicts the audit process sent so far (the findings wait for the monitor turn)."""
        for result in audit.process.receive():
            finding = self.judge(audit, model, result)
            if finding is not None:
                self.found.append(finding)

    def follow_changes(self, audit: ModelAudit, model: ModelConfig, now: float) -> None:
        """A changed model file, source, spec or tolerance: the process loads it afresh, and answers of workers
        ready before the change are not judged against it (a rollout replaces them), lest the old weights'
        answers be called wrong by the new weights' eager."""
        fingerprint = model_fingerprint(model)
        if audit.fingerprint is None or fingerprint == audit.fingerprint:
            audit.fingerprint, audit.checked_at = fingerprint, now
            return
        # Not `now`: a rollout's worker (forked in a fraction of a second) may be serving the new model already.
        # A new file is no older than its mtime; a new config no older than the last turn that saw the old one.
        changed_at = audit.checked_at
        stat = fingerprint[1]
        if stat is not None and stat != audit.fingerprint[1]:
            written = stat[0] / 1e9  # type: ignore[index]
            changed_at = max(changed_at, now - max(0.0, time.time() - written))
        audit.fingerprint, audit.changed_at, audit.checked_at = fingerprint, changed_at, now
        self.forget_samples(audit, dropped=False)
        audit.acted_on.clear()
        audit.process.stop()

    def keep_process(self, audit: ModelAudit, model: ModelConfig, view: MonitorView, now: float) -> None:
        """Start the process when samples wait, restart it after its back-off, end it when it hangs."""
        process = audit.process
        if process.settle(now):
            self.forget_samples(audit, dropped=True)
        oldest = min((s.sent_at for s in audit.sent.values() if s.sent_at is not None), default=None)
        stuck = process.stuck(len(audit.waiting) + len(audit.sent), now) if process.launched is not None else None
        if stuck is not None:
            process.kill(f"{stuck}: killed", now)
            self.forget_samples(audit, dropped=True)
        elif oldest is not None and now - oldest > HANG_S:
            process.kill(f"no verdict for {HANG_S:.0f} s: ended as hung", now)
            self.forget_samples(audit, dropped=True)
        due = process.state is AuditState.OFF or now >= process.next_start
        if process.launched is None and audit.waiting and due:
            cpus = [cpu for slot in view.serving.get(model.name, ()) for cpu in slot.assignment.cpus]
            process.start(view.config, model, cpus or sorted(os.sched_getaffinity(0)), now)

    def forget_samples(self, audit: ModelAudit, dropped: bool) -> None:
        """Let go of what was sent to a process that ended (counted as dropped), or of everything when not needed."""
        if dropped:
            audit.tally.dropped += len(audit.sent)
            audit.sent.clear()
        else:
            audit.sent.clear()
            audit.waiting.clear()

    def judge(self, audit: ModelAudit, model: ModelConfig, result: wm.AuditResult) -> Finding | None:
        """Count one verdict; a finding (fallback or note) the first time a profile answers a row below tolerance."""
        sample = audit.sent.pop(result.seq, None)
        if sample is None:
            return None
        if result.rows == 0:
            log.warning("audit_sample_unreadable", model=model.name, why=result.failure)
        found = audit.tally.take(result, sample.profile, sample.slot.pid)
        if found is None or sample.profile in audit.acted_on:
            return None
        slot = sample.slot
        if slot.state is not SlotState.SERVING or slot.proc.profile != sample.profile:
            return None  # the profile already left this worker (a rollout); the next sample of it will say
        audit.acted_on[sample.profile] = time.monotonic()
        reason = found.reason(float(model.tolerance.get("min_cosine", 0.999)))
        detail: dict[str, object] = {"reason": reason, **found.report()}
        action = Action.FALLBACK if model.audit.action is AuditAction.FALLBACK else Action.NOTE
        return Finding("audit_below_tolerance", action, slot, detail)

    # ---- what operators see -------------------------------------------------------------------

    def readings(self, config: Config) -> Readings:
        """Each audited model's report (a model not audited and never audited has none)."""
        models = config.models
        return Readings(
            models={
                name: {"audit": report} for name in models if (report := self.report(name, models[name])) is not None
            }
        )

    def report(self, name: str, model: ModelConfig | None) -> dict[str, object] | None:
        """The model's `audit` object in status (None when it is not audited and never was)."""
        audit = self.audits.get(name)
        if model is None or (audit is None and model.audit.budget <= 0):
            return None
        tally = audit.tally if audit is not None else AuditTally()
        process = audit.process if audit is not None else None
        state = process.state.value if process is not None else AuditState.OFF.value
        return {
            "budget": model.audit.budget,
            "action": model.audit.action.value,
            "summary": tally.line(),
            "requests_audited": tally.requests,
            "rows_audited": tally.rows,
            "rows_below_tolerance": tally.rows_below,
            "dropped": tally.dropped,
            "unreadable": tally.unreadable,
            "held": (len(audit.waiting) + len(audit.sent)) if audit is not None else 0,
            "cost_ms_per_row": round(tally.cost_ms_per_row, 3) if tally.cost_ms_per_row is not None else None,
            "cpu_s": round(tally.cpu_ms / 1000.0, 3),
            "worst": tally.worst or None,
            "last_finding": tally.last_finding.report() if tally.last_finding is not None else None,
            "process": {
                "state": state,
                "pid": process.pid if process is not None else None,
                "restarts": process.restarts if process is not None else 0,
                "last_exit": process.last_exit if process is not None else None,
                "error": process.error if process is not None else None,
            },
        }

    def stop_all(self) -> None:
        """The daemon stops: every audit process goes."""
        for audit in self.audits.values():
            audit.process.stop()
