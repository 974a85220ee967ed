"""The shadow: a lossy candidate the background builder picked runs beside the exact profile that serves, on live
requests, before it may serve.

A sample of the model's successful answers (their inputs and the exact answer served; inputs a client left in
shared memory are never sampled, as for the audit) is held in memory, within `shadow_budget` of one core and at
most one every MIN_INTERVAL_S, and sent to the model's shadow process: the live audit's process
(workers/audit_process.py, worker/audit_loop.py) loaded with the candidate instead of eager, at the lowest CPU
priority, which runs the request on the candidate and judges its answer against the served one by the gate's
measures and the model's `tolerance`. The candidate passes after `shadow_rows` rows within it (and 3 input
shapes when an input has an open dim besides the batch); the first row outside refuses it with that row's figures.
No traffic, no verdict: the candidate waits, and the workers keep serving exact answers.
"""

from __future__ import annotations

import collections
import enum
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from infervisor.common.accuracy import cosine_text
from infervisor.common.recorded_inputs import served_shape_in
from infervisor.common.verdicts import SPEC_KEY_NOTE, lossy
from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.lifecycle.exit_decision import ChildExitVerdict, Then
from infervisor.supervisor.lifecycle.exits import reap_runner
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.audit_process import AuditProcess, AuditState
from infervisor.supervisor.workers.children import Children
from infervisor.supervisor.workers.slot import WorkerSlot

log = structlog.get_logger("supervisor")

#: Samples held (waiting and sent): the shadow's memory stays small and bounded.
MAX_HELD = 8
#: At most this many samples a second: each has a fixed cost (messages, caches) the CPU budget does not count.
MIN_INTERVAL_S = 0.1
#: Distinct input shapes (the batch aside) a candidate must have matched on when an input has another open dim.
SHAPE_GROUPS = 3
#: Before the shadow process has timed a row: the candidate is taken to cost this many times the served time.
_FIRST_GUESS_FACTOR = 2.0
_BATCH_DIM = re.compile(r"\[\d+")


class ShadowOutcome(enum.Enum):
    """Where a candidate's shadow stands."""

    RUNNING = "running"  # comparing, or waiting for traffic
    PASSED = "passed"  # shadow_rows rows within tolerance: it may serve
    REFUSED = "refused"  # a row outside tolerance: recorded, never served for this spec
    FAILED = "failed"  # the shadow process could not run it: not served, not recorded


@dataclass
class _Held:
    seq: int
    inputs: list[Any]
    answer: list[bytes]
    sent_at: float | None = None


def spec_key_in(notes: list[str]) -> str | None:
    """The spec key a worker's READY notes name (what its verdicts are recorded under), if any."""
    keys = [n.removeprefix(SPEC_KEY_NOTE) for n in notes if n.startswith(SPEC_KEY_NOTE)]
    return keys[0] if keys else None


@dataclass
class ShadowRun:
    """One model's candidate in shadow: its process, its samples and what they showed."""

    model: str
    candidate: str
    rows_needed: int
    #: Whether an input has an open dim besides the batch: then SHAPE_GROUPS shapes are needed too.
    open_dims: bool
    started_at: float
    #: Where the shadow process's end is noticed and its link read.
    children: Children = field(repr=False)
    process: AuditProcess = field(init=False)
    outcome: ShadowOutcome = ShadowOutcome.RUNNING
    rows: int = 0
    requests: int = 0
    groups: set[str] = field(default_factory=set)
    worst: dict[str, Any] = field(default_factory=dict)
    #: The refusing row's figures (and its input shape), or why the shadow could not run.
    verdict: dict[str, Any] = field(default_factory=dict)
    waiting: collections.deque[_Held] = field(default_factory=collections.deque)
    sent: dict[int, _Held] = field(default_factory=dict)
    seq: int = 0
    tokens_ms: float | None = None
    filled_at: float = 0.0
    sampled_at: float | None = None
    cost_ms_per_row: float | None = None
    cpu_ms: float = 0.0
    dropped: int = 0
    ended_at: float | None = None

    def __post_init__(self) -> None:
        self.process = AuditProcess(self.model, self.children, self.candidate)

    @property
    def spec_key(self) -> str | None:
        """The spec key the shadow process loaded the candidate under (its READY note), once it is up."""
        return spec_key_in(self.process.notes)

    # ---- the broker's side ----------------------------------------------------------------------

    def offer(self, slot: WorkerSlot, request: PendingRequest, answer: list[Any], budget: float) -> None:
        """Hold this exact answer for the shadow when the budget has room (never blocks)."""
        profile = slot.proc.profile
        if self.outcome is not ShadowOutcome.RUNNING or request.reader is not None or profile is None:
            return
        if lossy(profile):
            return  # only exact answers are the shadow's reference
        now = time.monotonic()
        if self.sampled_at is not None and now - self.sampled_at < MIN_INTERVAL_S:
            return
        if len(self.waiting) + len(self.sent) >= MAX_HELD:
            self.dropped += 1
            return
        per_row = self.cost_ms_per_row
        served = slot.proc.latencies_ms[-1] if slot.proc.latencies_ms else 1.0
        cost = per_row * request.rows if per_row is not None else _FIRST_GUESS_FACTOR * served
        cap = max(budget * 1000.0, cost)
        earned = budget * (now - self.filled_at) * 1000.0 if self.tokens_ms is not None else cap
        self.tokens_ms, self.filled_at = min(cap, (self.tokens_ms or 0.0) + earned), now
        if self.tokens_ms < cost:
            return
        self.tokens_ms -= cost
        self.sampled_at = now
        self.seq += 1
        # The client's frames are immutable and only referenced; the answer is copied (its link buffer is reused).
        self.waiting.append(_Held(self.seq, list(request.frames), [bytes(f) for f in answer]))

    # ---- the builder's turn ---------------------------------------------------------------------

    def tick(self, now: float, config: Config, model: ModelConfig, cpus: list[int]) -> ShadowOutcome:
        """Keep the process, send what waits, judge what came back: the outcome so far."""
        if self.outcome is not ShadowOutcome.RUNNING:
            return self.outcome
        process = self.process
        oldest = min((h.sent_at for h in self.sent.values() if h.sent_at is not None), default=None)
        verdict = reap_runner(process, now, waiting=len(self.waiting) + len(self.sent), oldest_sent_at=oldest)
        if verdict is not None:
            self.dropped += len(self.sent)
            self.sent.clear()
        if verdict is not None and verdict.then is Then.FAIL:
            return self.given_up(verdict)
        due = process.state is AuditState.OFF or now >= process.child.next_start
        if not process.running and self.waiting and due:
            failed = process.start(config, model, cpus or sorted(os.sched_getaffinity(0)), now)
            verdict = reap_runner(process, now, failed_start=failed) if failed is not None else None
            if verdict is not None and verdict.then is Then.FAIL:
                return self.given_up(verdict)
        for result in process.receive():
            self.judge(result)
            if self.outcome is not ShadowOutcome.RUNNING:
                return self.outcome
        if process.rejected is not None:
            return self.end(ShadowOutcome.REFUSED, self.rejected_at_load(process.rejected))
        while self.waiting and process.state is AuditState.READY:
            held = self.waiting[0]
            if not process.send(held.seq, held.inputs, held.answer):
                break
            self.waiting.popleft()
            held.sent_at = now
            self.sent[held.seq] = held
        if self.rows >= self.rows_needed and (not self.open_dims or len(self.groups) >= SHAPE_GROUPS):
            cosine = self.worst.get("cosine")
            shapes = f"{len(self.groups)} input shape" + ("s" if len(self.groups) != 1 else "")
            why = f"{self.rows} live rows in {shapes} within tolerance" + (
                f", worst cosine {cosine_text(float(cosine))} ({self.worst.get('input_shape')})" if cosine else ""
            )
            return self.end(ShadowOutcome.PASSED, {"why": why, "rows": self.rows, "worst": dict(self.worst)})
        return self.outcome

    def given_up(self, verdict: ChildExitVerdict) -> ShadowOutcome:
        """The shadow process ended once too often (lifecycle/exit_decision.py): the candidate is not served, and
        not recorded."""
        why = self.process.error or verdict.how
        return self.end(ShadowOutcome.FAILED, {"why": f"the shadow process could not run {self.candidate}: {why}"})

    def judge(self, result: wm.AuditResult) -> None:
        """One sample's verdict: counted, and the candidate refused at its first row outside tolerance."""
        held = self.sent.pop(result.seq, None)
        self.cpu_ms += result.cpu_ms
        if held is None or result.rows == 0:
            return  # unreadable: no verdict on the candidate
        per_row = result.cpu_ms / result.rows
        self.cost_ms_per_row = per_row if self.cost_ms_per_row is None else 0.8 * self.cost_ms_per_row + 0.2 * per_row
        self.requests += 1
        self.rows += result.rows
        self.groups.add(_BATCH_DIM.sub("[", result.shapes))
        figures = {
            "cosine": result.cosine,
            "row": result.worst_row,
            "max_abs_error": result.max_abs_error,
            "relative_error": result.relative_error if result.relative_output else None,
            "relative_output": result.relative_output or None,
            "input_shape": result.shapes,
        }
        if not self.worst or result.cosine < float(self.worst["cosine"]):
            self.worst = figures
        if result.rows_below:
            why = (
                f"shadow: {self.candidate} answered row {result.worst_row} of a live request of {result.shapes} "
                f"off the served exact answer ({result.failure}) after {self.rows - result.rows} rows within tolerance"
            )
            self.end(ShadowOutcome.REFUSED, {"why": why, "measure": result.failure, **figures})

    def rejected_at_load(self, detail: str) -> dict[str, Any]:
        """The verdict when the shadow process's own gate refused the candidate: served inputs recorded since the
        builder's gate ran (the same rows the shadow would have compared) are off."""
        why = f"shadow: {self.candidate} refused by the gate of the shadow's start on recorded served inputs: {detail}"
        return {"why": why, "measure": "gate", "input_shape": served_shape_in(detail)}

    def end(self, outcome: ShadowOutcome, verdict: dict[str, Any]) -> ShadowOutcome:
        """The candidate's shadow is over: its process goes, its samples are let go."""
        self.outcome, self.verdict, self.ended_at = outcome, verdict, time.monotonic()
        self.process.stop()
        self.waiting.clear()
        self.sent.clear()
        log.info("shadow_" + outcome.value, model=self.model, profile=self.candidate, rows=self.rows, verdict=verdict)
        return outcome

    def stop(self) -> None:
        """Not needed any more (the build restarts, the daemon stops)."""
        self.process.stop()
        self.waiting.clear()
        self.sent.clear()

    # ---- what operators see ---------------------------------------------------------------------

    def waits_for(self) -> str:
        """What the candidate still needs before it may serve."""
        if self.outcome is not ShadowOutcome.RUNNING:
            return ""
        if self.process.state is AuditState.STARTING:
            return f"the shadow process to load {self.candidate}"
        wants = []
        if self.rows < self.rows_needed:
            wants.append(f"{self.rows_needed - self.rows} more live rows")
        if self.open_dims and len(self.groups) < SHAPE_GROUPS:
            wants.append(f"{SHAPE_GROUPS - len(self.groups)} more input shapes")
        tail = " (no traffic = no switch)" if self.rows == 0 and not self.sent else ""
        return " and ".join(wants) + tail

    def line(self) -> str:
        """`shadow: bf16 37 of 200 rows within tolerance, worst cosine 0.99995; waits for 163 more live rows`."""
        text = f"shadow: {self.candidate} {self.rows} of {self.rows_needed} rows within tolerance"
        if self.worst:
            text += f", worst cosine {cosine_text(float(self.worst['cosine']))} ({self.worst['input_shape']})"
        if self.outcome is ShadowOutcome.RUNNING:
            return f"{text}; waits for {self.waits_for()}"
        return f"shadow: {self.candidate} {self.outcome.value}: {self.verdict.get('why', '')}"

    def report(self) -> dict[str, object]:
        """The `shadow` object of the model's build in status."""
        return {
            "profile": self.candidate,
            "state": self.outcome.value,
            "summary": self.line(),
            "rows_compared": self.rows,
            "rows_needed": self.rows_needed,
            "requests_compared": self.requests,
            "input_shapes": sorted(self.groups),
            "worst": self.worst or None,
            "waits_for": self.waits_for() or None,
            "verdict": self.verdict or None,
            "dropped": self.dropped,
            "cpu_s": round(self.cpu_ms / 1000.0, 3),
            "process": {"state": self.process.state.value, "pid": self.process.pid, "error": self.process.error},
        }
