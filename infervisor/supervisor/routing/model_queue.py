"""One model's line of accepted requests and that model's counters (kept while the model is configured)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from infervisor.supervisor.instruments.recorders import ModelTimes
from infervisor.supervisor.routing.pending import PendingRequest


@dataclass
class ModelQueue:
    """Requests of one model waiting for an idle worker, plus that model's counters."""

    capacity: int
    waiting: collections.deque[PendingRequest] = field(default_factory=collections.deque)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Its successful requests: how many and how long (dropped with the queue when the model leaves).
    times: ModelTimes = field(default_factory=ModelTimes)
    #: With batching: how many batches of each size (rows) were sent, and how long requests waited to be batched.
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    batch_wait_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=4096))

    def oldest_wait(self, now: float) -> float | None:
        """How long (s) the longest-waiting request has waited at `now`, or None when none waits.

        Not simply the head: a request a lost worker held goes back to the head with its own acceptance time.
        """
        return max((now - request.accepted_at for request in self.waiting), default=None)

    @property
    def completed(self) -> int:
        """Requests of the model answered with a result."""
        return self.times.completed
