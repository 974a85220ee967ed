"""What the loop records as things happen: counters the broker and the reloader write to, and nothing else reads
until a snapshot copies them (infervisor/supervisor/observe/snapshot.py).

A leaf: it imports nothing of the daemon, so the broker and the reloader write here without an import cycle.
"""

from __future__ import annotations

import collections
import enum
from bisect import bisect_left
from dataclasses import dataclass

#: Upper bounds (seconds) of the request-time histograms: 0.1 ms (a tiny model's queue wait) to 30 s.
BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: How many recent request times status takes its percentiles over.
RECENT = 4096


class ModelTimes:
    """One model's successful requests: how many, their three histograms as per-bucket counts (not cumulative)
    and sums, and the recent total times status takes percentiles of. Written by the loop only."""

    __slots__ = ("completed", "total", "queue", "service", "total_sum", "queue_sum", "service_sum", "recent_ms")

    def __init__(self) -> None:
        self.completed = 0
        # One count per bound, then the +Inf bucket.
        self.total = [0] * (len(BUCKETS_S) + 1)
        self.queue = [0] * (len(BUCKETS_S) + 1)
        self.service = [0] * (len(BUCKETS_S) + 1)
        self.total_sum = self.queue_sum = self.service_sum = 0.0
        self.recent_ms: collections.deque[float] = collections.deque(maxlen=RECENT)

    def request_done(self, accepted_at: float, dispatched_at: float, now: float) -> None:
        """Count one successful reply (monotonic seconds): three bisections, a few additions, one append."""
        # bisect_left: the first bound >= the value, which is the bucket `le` counts it in.
        total, queue, service = now - accepted_at, dispatched_at - accepted_at, now - dispatched_at
        self.completed += 1
        self.total[bisect_left(BUCKETS_S, total)] += 1
        self.queue[bisect_left(BUCKETS_S, queue)] += 1
        self.service[bisect_left(BUCKETS_S, service)] += 1
        self.total_sum += total
        self.queue_sum += queue
        self.service_sum += service
        self.recent_ms.append(total * 1000.0)


class ReloadOutcome(enum.Enum):
    """How a reload of config.json ended (`infervisor_config_reloads_total{outcome}`)."""

    SUCCESS = "success"  # the file was valid: applied, or the same as the running one
    FAILURE = "failure"  # refused: nothing changed


@dataclass
class ReloadStats:
    """What reloads did since start (the reloader counts them; the first config is not a reload)."""

    #: Unix time of the last successful reload, or of the start when none happened yet.
    last_success_at: float
    success: int = 0
    failure: int = 0
    #: False after a refused file, until a good one is read.
    last_ok: bool = True

    def record(self, outcome: ReloadOutcome, now: float) -> None:
        """Count one reload."""
        if outcome is ReloadOutcome.SUCCESS:
            self.success += 1
            self.last_success_at = now
            self.last_ok = True
        else:
            self.failure += 1
            self.last_ok = False
