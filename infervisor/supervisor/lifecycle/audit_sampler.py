"""The live audit's sampler: which served answers of a model are held for its audit process, within its CPU budget.

What is sampled: requests whose inputs travelled in the message. Inputs a client left in shared memory are
never sampled: the broker never copies them (the worker reads them), and reading them later could see what
the client wrote there since, so a verdict on them could blame the profile for the client's next request.

The budget is spent by an estimate: the audit process reports the CPU time each audit took, and a sample is
taken when the bucket (filled at `budget` CPU-ms per ms, holding 1 s of it, or one audit) has that much for its
rows: a burst after a quiet spell stays one second's share. And at most one sample a second (MIN_INTERVAL_S):
a fast model's P99 feels each sample's fixed cost, which the CPU budget does not count. The samples held
(waiting for the process, and sent to it) are bounded in number and bytes (MAX_HELD, MAX_HELD_BYTES): a full
queue drops the sample and counts it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.protocol import worker_messages as wm
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.slot import WorkerSlot

#: Samples held per model (waiting and sent), and their bytes: the audit's memory stays small and bounded.
MAX_HELD = 8
MAX_HELD_BYTES = 64 * 2**20
#: Seconds of budget the bucket holds: a burst after a quiet spell stays this small.
_BUCKET_S = 1.0
#: Before the audit process has timed one row: eager is taken to cost this many times the served service time.
_FIRST_GUESS_FACTOR = 2.0
#: At most one sample a second per model, whatever the budget allows. Each sample has a cost the budget does not
#: count: the messages, the supervisor's share, and the audit's pass evicting the worker's caches on its core. A
#: millisecond model audited 29 times a second (0.02 of a core) had its P99 raised 1.2-1.5x; once a second, not.
MIN_INTERVAL_S = 1.0


def audited(model: ModelConfig | None, profile: str | None) -> bool:
    """Whether answers of `profile` for `model` are audited: a budget, and a profile other than eager fp32."""
    return model is not None and model.audit.budget > 0 and profile is not None and profile != REFERENCE_PROFILE


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
class HeldSamples:
    """One model's sampler: its budget bucket, its cost estimate, and the samples waiting and sent."""

    waiting: collections.deque[Sample] = field(default_factory=collections.deque)
    sent: dict[int, Sample] = field(default_factory=dict)
    #: Samples not audited: the queue was full, or the audit process ended while holding them.
    dropped: int = 0
    tokens_ms: float | None = None
    filled_at: float = 0.0
    #: When the last sample was taken (monotonic): the next one waits MIN_INTERVAL_S.
    sampled_at: float | None = None
    #: Estimated CPU ms one row costs on eager fp32 in the audit process (None before the first result).
    cost_ms_per_row: float | None = None

    def count(self) -> int:
        """Samples held: waiting for the process and sent to it."""
        return len(self.waiting) + len(self.sent)

    def held_bytes(self) -> int:
        """Bytes of the samples held."""
        return sum(s.nbytes for s in self.waiting) + sum(s.nbytes for s in self.sent.values())

    def interval_passed(self, now: float) -> bool:
        """Whether MIN_INTERVAL_S has passed since the last sample (the budget keeps filling meanwhile)."""
        return self.sampled_at is None or now - self.sampled_at >= MIN_INTERVAL_S

    def cost_ms(self, slot: WorkerSlot, rows: int) -> float:
        """CPU ms auditing `rows` rows is expected to take (the audit's own timing once it has one)."""
        if self.cost_ms_per_row is not None:
            return self.cost_ms_per_row * rows
        served = slot.proc.latencies_ms[-1] if slot.proc.latencies_ms else 1.0
        return _FIRST_GUESS_FACTOR * served

    def bucket_holds(self, budget: float, cost: float, now: float) -> bool:
        """Fill the bucket up to `now`; whether it holds `cost` (it holds 1 s of budget, or one audit)."""
        cap = max(budget * _BUCKET_S * 1000.0, cost)
        earned = budget * (now - self.filled_at) * 1000.0 if self.tokens_ms is not None else cap
        self.tokens_ms, self.filled_at = min(cap, (self.tokens_ms or 0.0) + earned), now
        return self.tokens_ms >= cost

    def room_for(self, nbytes: int) -> bool:
        """Whether one more sample of `nbytes` stays within MAX_HELD and MAX_HELD_BYTES."""
        return self.count() < MAX_HELD and self.held_bytes() + nbytes <= MAX_HELD_BYTES

    def hold(self, sample: Sample, cost: float, now: float) -> None:
        """Keep `sample` waiting for the process, its cost spent from the bucket."""
        self.tokens_ms = (self.tokens_ms or 0.0) - cost
        self.sampled_at = now
        self.waiting.append(sample)

    def answered(self, result: wm.AuditResult) -> Sample | None:
        """The sample a result is of (None when it was let go meanwhile); a readable one teaches the cost."""
        sample = self.sent.pop(result.seq, None)
        if sample is None or result.rows == 0:
            return sample
        per_row = result.cpu_ms / result.rows
        # A moving estimate: recent timings weigh most (a box under load, another shape of input).
        self.cost_ms_per_row = per_row if self.cost_ms_per_row is None else 0.8 * self.cost_ms_per_row + 0.2 * per_row
        return sample

    def forget(self, dropped: bool) -> None:
        """Let go of what was sent to a process that ended (counted as dropped), or of everything when not needed."""
        if dropped:
            self.dropped += len(self.sent)
            self.sent.clear()
        else:
            self.sent.clear()
            self.waiting.clear()
