"""The one picture of the daemon that `status` and the Prometheus exposition both render.

The loop takes it (infervisor/supervisor/observe/capture.py) from the broker, the pool and the monitors without
changing any of them; it holds copies and immutable values only, so the metrics HTTP thread can render
one while the loop goes on.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infervisor.supervisor.instruments.recorders import BUCKETS_S
from infervisor.supervisor.monitors.readings import MonitorReadings, Reading, Scope, Value
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.workers.health import ModelReport
from infervisor.supervisor.workers.slot import SlotState


@dataclass(frozen=True, slots=True)
class Histogram:
    """Per-bucket counts (one per bound of BUCKETS_S, then +Inf) and the sum of the observed values."""

    counts: tuple[int, ...]
    total: float

    def cumulative(self) -> list[tuple[str, float]]:
        """The `le` buckets as Prometheus has them: each counts every value at or below its bound."""
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*BUCKETS_S, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return buckets


class Role(enum.Enum):
    """Where a slot stands in its model's pool."""

    MEMBER = "member"  # serves the model's share of workers
    SUCCESSOR = "successor"  # started to replace a member (rolling restart)
    RETIRING = "retiring"  # replaced, finishing what it holds


@dataclass(frozen=True, slots=True)
class SlotSample:
    """One worker slot as the loop saw it: what status shows of it and what the metrics count."""

    model: str
    slot: int
    role: Role
    pid: int | None
    state: SlotState
    reason: str
    inflight: int
    cores: tuple[int, ...]
    node: int
    shared_cores: bool
    threads: int
    requests: int
    #: Service times of its recent successful requests.
    latencies_ms: tuple[float, ...]
    ready_ms: float
    profile: str | None
    profile_skipped: tuple[str, ...]
    profile_build: tuple[str, ...]
    #: Its model names a validation set (what a numerics-changing profile was judged on).
    validated: bool
    last_profile: Mapping[str, object] | None
    restarts: int
    last_exit: str | None
    load_error: str
    last_event: Mapping[str, object] | None
    #: Before READY: the phase and how long each limit has counted (None once it left STARTING).
    starting: Mapping[str, object] | None


@dataclass(frozen=True, slots=True)
class ModelSample:
    """One served model: its health, queue, counters and request times."""

    name: str
    #: The config its queue and status describe (source, inputs, profiles, batching policy).
    config: ModelConfig
    report: ModelReport
    #: Why it cannot load now, in its worker's words (None when nothing failed).
    load_error: str | None
    load_failures: int
    completed: int
    #: (code, count) of its error replies and admission refusals, in the order they first happened.
    errors: tuple[tuple[str, int], ...]
    queued: int
    capacity: int
    total: Histogram
    queue: Histogram
    service: Histogram
    #: Total times of its recent successful requests.
    latencies_ms: tuple[float, ...]
    #: With batching: (rows, batches sent of that size), and how long recent requests waited to be batched.
    batch_sizes: tuple[tuple[int, int], ...]
    batch_wait_ms: tuple[float, ...]
    fallback: Mapping[str, object] | None
    #: Where the last applied config stands for it: "applied", "rolling" or "failed" (with the error).
    config_state: str
    config_error: str | None
    #: Its background build (lifecycle/background_build.py: ModelBuild.report), None when it has none.
    build: Mapping[str, object] | None = None
    #: A stateful model's streams (routing/streams.py: StreamTable.report), None for a stateless one.
    streams: Mapping[str, Any] | None = None
    #: Profiles refused on live traffic and recorded in the cache (common/verdicts.py): profile -> its record.
    refusals: Mapping[str, object] | None = None
    #: Its recorded served inputs (lifecycle/input_recorder.py: InputRecorder.report), None when it records none.
    recorded_inputs: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class RolloutSample:
    """The rolling-restart queue."""

    pending: int
    current: str | None
    completed: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything status and the metrics show of the broker, the pool and the monitors, at `taken_at` (Unix time)."""

    taken_at: float
    models: tuple[ModelSample, ...]
    #: Every slot with a process to watch: the members (model by model), then successors and retiring ones.
    slots: tuple[SlotSample, ...]
    #: Requests refused before they named a served model, per code.
    refused: tuple[tuple[str, int], ...]
    #: (model, reason, count) of every model and every restart reason, from 0.
    restarts: tuple[tuple[str, str, int], ...]
    rollout: RolloutSample
    stopping: bool
    reloads_success: int
    reloads_failure: int
    last_reload_ok: bool
    last_reload_success_at: float
    config_digest: str
    #: (kind, count) of every anomaly counted, in the order they first happened.
    anomalies: tuple[tuple[str, int], ...]
    #: What each monitor that declares readings reported (monitors/readings.py), in table order.
    monitors: tuple[MonitorReadings, ...]

    def reports(self) -> dict[str, ModelReport]:
        """Each model's health."""
        return {model.name: model.report for model in self.models}

    def slots_of(self, model: str) -> list[SlotSample]:
        """A model's slots: its members, then its successors and retiring ones."""
        return [s for s in self.slots if s.model == model]

    def model_readings(self, model: str) -> list[tuple[Reading, Value]]:
        """Every declared per-model reading with the value reported for `model` (None when none was)."""
        return [
            (reading, sample.values.models.get(model, {}).get(reading.key))
            for sample in self.monitors
            for reading in sample.of(Scope.MODEL)
        ]

    def worker_readings(self, pid: int | None) -> list[tuple[Reading, Value]]:
        """Every declared per-worker reading with the value reported for the process `pid` (None when none was)."""
        return [
            (reading, None if pid is None else sample.values.workers.get(pid, {}).get(reading.key))
            for sample in self.monitors
            for reading in sample.of(Scope.WORKER)
        ]
