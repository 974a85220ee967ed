"""The Prometheus exposition: prometheus_client families rendered from the latest published snapshot.

No thread races the loop. The loop alone writes everything measured; once per monitor turn it takes
a `Snapshot` (infervisor/supervisor/observe/capture.py) and swaps it into the collector with one reference
assignment. The HTTP endpoint's one thread (infervisor/supervisor/observe/http_endpoint.py), and `infervisor
metrics` on the loop itself, only read the snapshot they find there and render it here. So a scrape
costs the loop nothing but that snapshot.

Names follow Prometheus's rules: the `infervisor_` prefix, base units (`_seconds`, `_bytes`),
counters end in `_total`; the list with labels and meaning is in docs/operations.md ("Metrics").
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from infervisor.common.text import clip
from infervisor.protocol.constants import PROTOCOL_VERSION, ErrorCode
from infervisor.supervisor.instruments.recorders import ReloadOutcome
from infervisor.supervisor.monitors.readings import Scope, Value
from infervisor.supervisor.observe.audit_metrics import audit_families
from infervisor.supervisor.observe.http_endpoint import HttpEndpoint
from infervisor.supervisor.observe.snapshot import Role, Snapshot
from infervisor.supervisor.workers.slot import SlotState

#: The load error in `infervisor_model_load_error_info` is shortened to whole sentences within this: a label is no
#: place for a traceback.
LOAD_ERROR_LABEL_CHARS = 200
#: The codes a model's error counter starts at 0 for, so rate() and increase() see the first one (TIMEOUT is the
#: Python client's own, never sent).
ERROR_CODES = tuple(code.value for code in ErrorCode if code is not ErrorCode.TIMEOUT)
#: Upper bounds of the batch-size histogram, in rows.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def _installed(distribution: str) -> str:
    """A distribution's version from its metadata (never an import: the supervisor does not load torch)."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def build_labels() -> dict[str, str]:
    """The labels of `infervisor_build_info`."""
    return {
        "version": _installed("infervisor"),
        "torch_version": _installed("torch"),
        "protocol_version": str(PROTOCOL_VERSION),
        "python_version": platform.python_version(),
    }


class SnapshotCollector:
    """A prometheus_client collector over the latest published snapshot; it reads one reference and nothing else."""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        #: Replaced whole by the loop (`Metrics.publish`); never changed in place.
        self.snapshot = snapshot
        self.build = build_labels()

    def collect(self) -> Iterator[Metric]:
        """The metric families of the snapshot there is now (only the build info before the first one)."""
        yield InfoMetricFamily(
            "infervisor_build", "the daemon's version, the torch it serves with, the wire protocol", self.build
        )
        snapshot = self.snapshot  # one read: the loop may publish another meanwhile
        if snapshot is None:
            return
        yield from _request_families(snapshot)
        yield from _worker_families(snapshot)
        yield from _build_families(snapshot)
        yield from audit_families(snapshot)
        yield from reading_families(snapshot)
        yield from _daemon_families(snapshot)


class Metrics:
    """The registry that renders the loop's latest snapshot, and the opt-in HTTP endpoint serving it."""

    def __init__(self) -> None:
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # the supervisor's own process_* figures, the standard names
        self.endpoint = HttpEndpoint()

    @property
    def url(self) -> str | None:
        """Where scrapes go once listening."""
        return self.endpoint.url

    @property
    def error(self) -> str | None:
        """Why the endpoint does not listen, when binding failed."""
        return self.endpoint.error

    def publish(self, snapshot: Snapshot) -> None:
        """Swap in a new snapshot: one reference assignment, so a reader sees the old one or the new one whole."""
        self.collector.snapshot = snapshot

    def render(self) -> str:
        """The text exposition format of the latest snapshot (what a scrape of /metrics returns)."""
        return generate_latest(self.registry).decode()

    def listen(self, address: str) -> None:
        """Serve /metrics on HOST:PORT from a thread of its own; a failure is logged and shown, serving goes on."""
        self.endpoint.listen(address, make_wsgi_app(self.registry))

    def close(self) -> None:
        """Stop the HTTP endpoint and close its socket."""
        self.endpoint.close()


def _request_families(snapshot: Snapshot) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "infervisor_requests",
        'requests answered, by model, outcome and code; model "" for those refused before naming a served model',
        labels=["model", "outcome", "code"],
    )
    queued = GaugeMetricFamily("infervisor_requests_queued", "requests waiting for a worker", labels=["model"])
    capacity = GaugeMetricFamily("infervisor_queue_capacity", "queue_size: one more is OVERLOADED", labels=["model"])
    in_flight = GaugeMetricFamily("infervisor_requests_in_flight", "requests held by workers", labels=["model"])
    histograms = {
        "total": HistogramMetricFamily(
            "infervisor_request_duration_seconds",
            "successful requests, from acceptance to the reply",
            labels=["model"],
            unit="seconds",
        ),
        "queue": HistogramMetricFamily(
            "infervisor_request_queue_seconds",
            "successful requests, from acceptance to the dispatch to the worker that answered",
            labels=["model"],
            unit="seconds",
        ),
        "service": HistogramMetricFamily(
            "infervisor_request_service_seconds",
            "successful requests, from the dispatch to the worker's reply",
            labels=["model"],
            unit="seconds",
        ),
    }
    for model in snapshot.models:
        slots = snapshot.slots_of(model.name)
        requests.add_metric([model.name, "success", "ok"], model.completed)
        errors = dict(model.errors)
        for code in (*ERROR_CODES, *sorted(set(errors) - set(ERROR_CODES))):
            requests.add_metric([model.name, "error", code], errors.get(code, 0))
        queued.add_metric([model.name], model.queued)
        capacity.add_metric([model.name], model.capacity)
        in_flight.add_metric([model.name], sum(s.inflight for s in slots))
        for which, histogram in (("total", model.total), ("queue", model.queue), ("service", model.service)):
            histograms[which].add_metric([model.name], histogram.cumulative(), histogram.total)
    for code, count in snapshot.refused:
        requests.add_metric(["", "error", code], count)
    yield from (requests, queued, capacity, in_flight, *histograms.values())
    yield _batch_sizes(snapshot)
    yield from _stream_families(snapshot)


#: A stateful model's stream figures: (status key, metric name, help, a counter rather than a gauge).
_STREAM_FIGURES = (
    ("open", "infervisor_streams_open", "streams of a stateful model open now", False),
    ("state_bytes", "infervisor_stream_state_bytes", "bytes of state the supervisor holds for its open streams", False),
    ("opened", "infervisor_streams_opened", "streams started", True),
    ("expired", "infervisor_streams_expired", "streams dropped after stream_idle_s without a step", True),
    (
        "resumed",
        "infervisor_stream_steps_resumed",
        "stream steps re-run from the committed state after a worker loss",
        True,
    ),
    ("ended_by_config", "infervisor_streams_ended_by_config", "streams ended because the state pairs changed", True),
)


def _stream_families(snapshot: Snapshot) -> Iterator[Metric]:
    """Streams per stateful model: open, state held, and the counters of how they ended or resumed."""
    for key, name, documentation, counter in _STREAM_FIGURES:
        family: CounterMetricFamily | GaugeMetricFamily = (
            CounterMetricFamily(name, documentation, labels=["model"])
            if counter
            else GaugeMetricFamily(name, documentation, labels=["model"])
        )
        for model in snapshot.models:
            if model.streams is not None:
                family.add_metric([model.name], float(model.streams[key]))
        yield family


def _batch_sizes(snapshot: Snapshot) -> HistogramMetricFamily:
    """Rows per forward pass of each batching model (the wait to be batched is the queue histogram)."""
    family = HistogramMetricFamily(
        "infervisor_batch_size_rows", "rows joined into one forward pass, per batching model", labels=["model"]
    )
    for model in snapshot.models:
        if not model.batch_sizes:
            continue
        counts = dict(model.batch_sizes)
        buckets = [(str(bound), sum(n for rows, n in counts.items() if rows <= bound)) for bound in BATCH_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        family.add_metric([model.name], buckets, float(sum(rows * n for rows, n in counts.items())))
    return family


def _worker_families(snapshot: Snapshot) -> Iterator[Metric]:
    states = GaugeMetricFamily("infervisor_workers", "worker processes by state", labels=["model", "state"])
    for model in snapshot.models:
        counts = {state.value: 0 for state in SlotState}
        for slot in snapshot.slots_of(model.name):
            counts[slot.state.value] += 1
        for state, count in counts.items():
            states.add_metric([model.name, state], count)
    profile = InfoMetricFamily(
        "infervisor_worker_profile", "the optimisation profile each serving worker runs", labels=["model", "slot"]
    )
    for slot in snapshot.slots:
        if slot.pid is None:
            continue
        # One profile per (model, slot): the serving members' only.
        if slot.profile is not None and slot.role is Role.MEMBER and slot.state is SlotState.SERVING:
            profile.add_metric([slot.model, str(slot.slot)], {"profile": slot.profile})
    restarts = CounterMetricFamily(
        "infervisor_worker_restarts", "worker processes replaced, by model and reason", labels=["model", "reason"]
    )
    for model_name, reason, count in snapshot.restarts:
        restarts.add_metric([model_name, reason], count)
    load_failures = CounterMetricFamily(
        "infervisor_worker_load_failures", "worker processes that could not load their model", labels=["model"]
    )
    # One series per model at most, and only while it cannot load: the reason text stays a bounded label.
    load_error = InfoMetricFamily(
        "infervisor_model_load_error", "why a model cannot load now, in its worker's words", labels=["model"]
    )
    for model in snapshot.models:
        load_failures.add_metric([model.name], model.load_failures)
        if model.load_error:
            load_error.add_metric([model.name], {"error": clip(model.load_error, LOAD_ERROR_LABEL_CHARS)})
    yield from (states, profile, restarts, load_failures, load_error)


#: The states of a model's background build (lifecycle/background_build.py: BuildState), each a 0/1 series.
_BUILD_STATES = ("waiting", "building", "shadow", "done", "failed")


def _build_families(snapshot: Snapshot) -> Iterator[Metric]:
    """What serves now, and where each model's background build stands (docs/operations.md)."""
    serving = GaugeMetricFamily(
        "infervisor_workers_serving_profile", "serving workers by the profile they serve", labels=["model", "profile"]
    )
    state = GaugeMetricFamily(
        "infervisor_model_build_state", "the model's background build: 1 for its state", labels=["model", "state"]
    )
    step = GaugeMetricFamily(
        "infervisor_model_build_profile_index", "while building: which profile of the chain (1-based)", labels=["model"]
    )
    elapsed = GaugeMetricFamily(
        "infervisor_model_build_seconds", "time the background build took so far", labels=["model"]
    )
    outcomes = GaugeMetricFamily(
        "infervisor_model_build_profiles",
        "profiles of the chain the build decided, by outcome",
        labels=["model", "outcome"],
    )
    shadow_rows = GaugeMetricFamily(
        "infervisor_model_shadow_rows", "live rows the lossy candidate in shadow matched so far", labels=["model"]
    )
    shadow_worst = GaugeMetricFamily(
        "infervisor_model_shadow_worst_cosine", "the lowest row cosine the shadow measured", labels=["model"]
    )
    refusals = GaugeMetricFamily(
        "infervisor_model_recorded_refusals", "profiles refused on live traffic (in the cache)", labels=["model"]
    )
    for model in snapshot.models:
        counts: dict[str, int] = {}
        for slot in snapshot.slots_of(model.name):
            if slot.state is SlotState.SERVING and slot.profile:
                counts[slot.profile] = counts.get(slot.profile, 0) + 1
        for profile, count in sorted(counts.items()):
            serving.add_metric([model.name, profile], count)
        refusals.add_metric([model.name], float(len(model.refusals or {})))
        build = model.build
        if build is None:
            continue
        for value in _BUILD_STATES:
            state.add_metric([model.name, value], 1.0 if build.get("state") == value else 0.0)
        step.add_metric([model.name], float(build.get("index") or 0))  # type: ignore[arg-type]
        elapsed.add_metric([model.name], float(build.get("elapsed_s") or 0.0))  # type: ignore[arg-type]
        refused = build.get("refused") or {}
        passed = build.get("passed") or []
        outcomes.add_metric([model.name, "passed"], float(len(passed)))  # type: ignore[arg-type]
        outcomes.add_metric([model.name, "refused"], float(len(refused)))  # type: ignore[arg-type]
        shadow = build.get("shadow")
        if isinstance(shadow, Mapping):
            shadow_rows.add_metric([model.name], float(shadow.get("rows_compared") or 0))
            worst = shadow.get("worst")
            if isinstance(worst, Mapping):
                shadow_worst.add_metric([model.name], float(worst["cosine"]))
    yield from (serving, state, step, elapsed, outcomes, shadow_rows, shadow_worst, refusals)


def _daemon_families(snapshot: Snapshot) -> Iterator[Metric]:
    yield from _reload_families(snapshot)
    anomalies = CounterMetricFamily(
        "infervisor_anomalies", "things that should not happen, by kind (status counters)", labels=["kind"]
    )
    # Refused requests are in infervisor_requests_total already.
    for kind, count in sorted(snapshot.anomalies):
        if not kind.startswith("rejected_"):
            anomalies.add_metric([kind], count)
    yield anomalies
    yield GaugeMetricFamily(
        "infervisor_metrics_snapshot_timestamp_seconds",
        "Unix time the loop took these figures (it lags while the loop stalls)",
        snapshot.taken_at,
    )


#: The labels of a reading's family, by its scope (monitors/readings.py).
_READING_LABELS = {Scope.BOX: [], Scope.MODEL: ["model"], Scope.WORKER: ["model", "slot", "pid"]}


def _number(value: Value) -> float | None:
    """A reading's value as a sample (a bool as 0/1), or None when it is no number (status shows it)."""
    return float(value) if isinstance(value, bool | int | float) else None


def reading_families(snapshot: Snapshot) -> Iterator[Metric]:
    """One family per declared reading that names a metric, labelled by its scope; one without a value is left out."""
    for sample in snapshot.monitors:
        for reading in sample.declared:
            if reading.metric is None:
                continue
            labels = _READING_LABELS[reading.scope]
            family: CounterMetricFamily | GaugeMetricFamily = (
                CounterMetricFamily(reading.metric, reading.help, labels=labels, unit=reading.unit)
                if reading.counter
                else GaugeMetricFamily(reading.metric, reading.help, labels=labels, unit=reading.unit)
            )
            values: list[tuple[list[str], Value]] = []
            if reading.scope is Scope.BOX:
                values.append(([], sample.values.box.get(reading.key)))
            elif reading.scope is Scope.MODEL:
                models = sample.values.models
                values += [([m.name], models.get(m.name, {}).get(reading.key)) for m in snapshot.models]
            else:
                workers = sample.values.workers
                values += [
                    ([slot.model, str(slot.slot), str(slot.pid)], workers.get(slot.pid, {}).get(reading.key))
                    for slot in snapshot.slots
                    if slot.pid is not None
                ]
            for label_values, value in values:
                if (number := _number(value)) is not None:
                    family.add_metric(label_values, number)
            if family.samples:
                yield family


def _reload_families(snapshot: Snapshot) -> Iterator[Metric]:
    outcomes = CounterMetricFamily("infervisor_config_reloads", "reloads of config.json by outcome", labels=["outcome"])
    outcomes.add_metric([ReloadOutcome.SUCCESS.value], snapshot.reloads_success)
    outcomes.add_metric([ReloadOutcome.FAILURE.value], snapshot.reloads_failure)
    yield outcomes
    yield GaugeMetricFamily(
        "infervisor_config_last_reload_successful",
        "0 after a refused file, until a good one",
        float(snapshot.last_reload_ok),
    )
    yield GaugeMetricFamily(
        "infervisor_config_last_reload_success_timestamp_seconds",
        "Unix time of the last successful reload (of the start before any)",
        snapshot.last_reload_success_at,
    )
    yield InfoMetricFamily("infervisor_config", "the digest of the config served", {"digest": snapshot.config_digest})
