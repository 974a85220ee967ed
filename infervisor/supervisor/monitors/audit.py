"""The live audit's monitor: the verdicts on sampled served answers, judged into findings, and each model's report.

A compiled or quantized profile's served answers are sampled within the model's CPU budget and re-run on eager
fp32 by the model's audit process; the sampler and the processes are the audit runner's
(lifecycle/audit_runner.py), which the pool ticks. This monitor only reads what the runner hands over
(monitors/audit_feed.py): at its turn it counts the verdicts collected since the last one, and a row below the
model's `tolerance` is a finding: by default the model falls back one step of its chain by the rolling
replacement a repeated canary mismatch takes (`audit.action: fallback`), else it is reported in status and
metrics only (`report`). It starts, feeds and ends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from infervisor.supervisor.monitors.audit_feed import NO_RUN, AuditFeed, AuditVerdict, NoFeed
from infervisor.supervisor.monitors.audit_tally import AuditTally
from infervisor.supervisor.monitors.findings import Action, Finding
from infervisor.supervisor.monitors.readings import Reading, Readings, Scope
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.audit_keys import AuditAction
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import SlotState

log = structlog.get_logger("supervisor")

#: A profile still served this long after a finding acted on it (its fallback refused, rolled back or undone by
#: the operator's reset) is acted on again at its next row below tolerance.
ACT_AGAIN_S = 600.0

#: Status `models.NAME.audit`, nested; its metric families (a 0/1 series per process state, the worst row's
#: cosine inside `worst`) keep a shape of their own, rendered from this reading by observe/audit_metrics.py.
AUDIT_READINGS = (Reading("audit", Scope.MODEL, "the model's live audit: what it reran, what it found, its process"),)


@dataclass
class ModelJudgement:
    """What the monitor keeps of one model's audit: its tally, and the profiles a finding acted on."""

    tally: AuditTally = field(default_factory=AuditTally)
    #: Profile -> when a finding acted on it (monotonic): one action per profile while its fallback rolls out;
    #: forgotten once it serves nowhere, or after ACT_AGAIN_S if it still serves (that fallback did not take).
    acted_on: dict[str, float] = field(default_factory=dict)
    #: The runner's count of the model's changes last seen: a changed model's profiles are judged afresh.
    changes: int = 0

    def follow(self, changes: int) -> None:
        """The model changed since the last count seen: its profiles may be acted on again."""
        if changes > self.changes:
            self.changes = changes
            self.acted_on.clear()


class AuditWatch:
    """Judges the verdicts the audit runner collected, reports rows below tolerance and each model's audit."""

    def __init__(self) -> None:
        #: The audit runner's read side, wired by core/assembly.py.
        self.feed: AuditFeed = NoFeed()
        self.models: dict[str, ModelJudgement] = {}

    def read_from(self, feed: AuditFeed) -> None:
        """Judge the verdicts `feed` hands over, and report its figures."""
        self.feed = feed

    # ---- the monitor turn ---------------------------------------------------------------------

    def check(self, now: float, view: MonitorView) -> list[Finding]:
        """Judge the verdicts collected since the last turn; a finding per profile first seen below tolerance."""
        for name in [name for name in self.models if name not in view.config.models]:
            del self.models[name]
        for name, judged in self.models.items():
            if (facts := self.feed.facts(name)) is not None:
                judged.follow(facts.changes)
            served = {s.proc.profile for s in view.serving.get(name, ()) if s.proc.profile}
            judged.acted_on = {p: at for p, at in judged.acted_on.items() if p in served and now - at < ACT_AGAIN_S}
        findings = []
        for verdict in self.feed.hand_over():
            model = view.config.models.get(verdict.model)
            if model is None:
                continue
            judged = self.models.setdefault(verdict.model, ModelJudgement(changes=verdict.changes))
            judged.follow(verdict.changes)
            if (finding := self.judge(judged, model, verdict, now)) is not None:
                findings.append(finding)
        return findings

    def judge(self, judged: ModelJudgement, model: ModelConfig, verdict: AuditVerdict, now: float) -> Finding | None:
        """Count one verdict; a finding (fallback or note) the first time a profile answers a row below tolerance."""
        result, slot = verdict.result, verdict.slot
        if result.rows == 0:
            log.warning("audit_sample_unreadable", model=model.name, why=result.failure)
        found = judged.tally.take(result, verdict.profile, verdict.pid)
        if found is None or verdict.profile in judged.acted_on:
            return None
        if slot.state is not SlotState.SERVING or slot.proc.profile != verdict.profile:
            return None  # the profile already left this worker (a rollout); the next sample of it will say
        judged.acted_on[verdict.profile] = now
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
        judged = self.models.get(name)
        run = self.feed.facts(name)
        if model is None or (run is None and judged is None and model.audit.budget <= 0):
            return None
        tally = judged.tally if judged is not None else AuditTally()
        run = run if run is not None else NO_RUN
        return {
            "budget": model.audit.budget,
            "action": model.audit.action.value,
            "summary": tally.line(run.dropped),
            "requests_audited": tally.requests,
            "rows_audited": tally.rows,
            "rows_below_tolerance": tally.rows_below,
            "dropped": run.dropped,
            "unreadable": tally.unreadable,
            "held": run.held,
            "cost_ms_per_row": round(run.cost_ms_per_row, 3) if run.cost_ms_per_row is not None else None,
            "cpu_s": round(tally.cpu_ms / 1000.0, 3),
            "worst": tally.worst or None,
            "last_finding": tally.last_finding.report() if tally.last_finding is not None else None,
            "process": {
                "state": run.state.value,
                "pid": run.pid,
                "restarts": run.restarts,
                "last_exit": run.last_exit,
                "error": run.error,
            },
        }
