"""Prometheus metrics: what the loop records and publishes, and the opt-in HTTP endpoint that serves it.

No thread races the loop. The loop alone writes everything measured (request times here, counters in
the broker, the pool and the arbiter); once per monitor turn it builds an immutable `Snapshot` and
swaps it into the collector with one reference assignment. The HTTP server's one thread, and
`infervisor metrics` on the loop itself, only read the snapshot they find there and render it with
prometheus_client. So a scrape costs the loop nothing but that snapshot, and a slow or hostile
scraper holds only the server's thread (each connection has a read timeout).

Names follow Prometheus's rules: the `infervisor_` prefix, base units (`_seconds`, `_bytes`),
counters end in `_total`; the list with labels and meaning is in docs/operations.md ("Metrics").
"""

from __future__ import annotations

import enum
import platform
import socket
import socketserver
import threading
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
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
from infervisor.supervisor.lifecycle.slot import RestartReason, SlotState

if TYPE_CHECKING:  # types only: the broker imports this module
    from infervisor.supervisor.lifecycle.pool import WorkerPool
    from infervisor.supervisor.routing.broker import Broker

log = structlog.get_logger("supervisor")

#: Upper bounds (seconds) of the request-time histograms: 0.1 ms (a tiny model's queue wait) to 30 s.
BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: The load error in `infervisor_model_load_error_info` is shortened to whole sentences within this: a label is no
#: place for a traceback.
LOAD_ERROR_LABEL_CHARS = 200
#: The HTTP endpoint drops a connection that sends nothing for this long (a stuck scraper holds one thread).
READ_TIMEOUT_S = 5.0
MB = 2**20
#: The codes a model's error counter starts at 0 for, so rate() and increase() see the first one (TIMEOUT is the
#: Python client's own, never sent).
ERROR_CODES = tuple(code.value for code in ErrorCode if code is not ErrorCode.TIMEOUT)


class ReloadOutcome(enum.Enum):
    """How a reload of config.json ended (`infervisor_config_reloads_total{outcome}`)."""

    SUCCESS = "success"  # the file was valid: applied, or the same as the running one
    FAILURE = "failure"  # refused: nothing changed


# ---- recorded on the request path (the loop only) ---------------------------------------------


class ModelTimes:
    """One model's three histograms as per-bucket counts (not cumulative) and sums, written by the loop only."""

    __slots__ = ("total", "queue", "service", "total_sum", "queue_sum", "service_sum")

    def __init__(self) -> None:
        # One count per bound, then the +Inf bucket.
        self.total = [0] * (len(BUCKETS_S) + 1)
        self.queue = [0] * (len(BUCKETS_S) + 1)
        self.service = [0] * (len(BUCKETS_S) + 1)
        self.total_sum = self.queue_sum = self.service_sum = 0.0


class RequestTimes:
    """Per model: how long each successful request took in all, waited in the queue, and took its worker."""

    def __init__(self) -> None:
        self.models: dict[str, ModelTimes] = {}

    def request_done(self, model: str, accepted_at: float, dispatched_at: float, now: float) -> None:
        """Count one successful reply (monotonic seconds): three bisections and six additions."""
        times = self.models.get(model)
        if times is None:
            times = self.models[model] = ModelTimes()
        # bisect_left: the first bound >= the value, which is the bucket `le` counts it in.
        total, queue, service = now - accepted_at, dispatched_at - accepted_at, now - dispatched_at
        times.total[bisect_left(BUCKETS_S, total)] += 1
        times.queue[bisect_left(BUCKETS_S, queue)] += 1
        times.service[bisect_left(BUCKETS_S, service)] += 1
        times.total_sum += total
        times.queue_sum += queue
        times.service_sum += service


@dataclass
class ReloadStats:
    """What reloads did since start (the arbiter counts them; the first config is not a reload)."""

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


# ---- the snapshot: immutable, handed from the loop to the readers ------------------------------


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


EMPTY = Histogram((0,) * (len(BUCKETS_S) + 1), 0.0)


@dataclass(frozen=True, slots=True)
class ModelSample:
    """One model at the time of the snapshot."""

    name: str
    completed: int
    #: (code, count) of its error replies and admission refusals.
    errors: tuple[tuple[str, int], ...]
    queued: int
    capacity: int
    in_flight: int
    #: (state, count) of its worker processes, every state listed.
    workers: tuple[tuple[str, int], ...]
    total: Histogram
    queue: Histogram
    service: Histogram
    #: With batching: (rows, batches sent of that size); empty otherwise.
    batch_sizes: tuple[tuple[int, int], ...] = ()
    #: Workers of the model that exited LOAD_FAILED, and why it cannot load now ("" when nothing failed).
    load_failures: int = 0
    load_error: str = ""


#: Upper bounds of the batch-size histogram, in rows.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One live worker process: its RSS as last sampled by the memory monitor, and the profile it serves."""

    model: str
    slot: int
    pid: int
    rss_bytes: int | None
    #: Set for the pool's serving workers only: one profile per (model, slot).
    profile: str | None
    #: Its proportional set size (shared pages divided among their users) as last sampled.
    pss_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the endpoint shows, as the loop saw it at `taken_at` (Unix time)."""

    taken_at: float
    models: tuple[ModelSample, ...]
    refused: tuple[tuple[str, int], ...]
    workers: tuple[WorkerSample, ...]
    #: (model, reason, count)
    restarts: tuple[tuple[str, str, int], ...]
    reloads_success: int
    reloads_failure: int
    last_reload_ok: bool
    last_reload_success_at: float
    config_digest: str
    throttled: bool
    shedding: bool
    max_temp_c: float | None
    throttle_events: int | None
    min_freq_ratio: float | None
    #: (kind, count) of the broker's anomalies other than refused requests (those are in `refused` and `models`).
    anomalies: tuple[tuple[str, int], ...]


def _histogram(counts: list[int], total: float) -> Histogram:
    return Histogram(tuple(counts), total)


def take_snapshot(
    pool: WorkerPool,
    broker: Broker,
    rss_mb: Mapping[int, float],
    thermal: Mapping[str, Any],
    reloads: ReloadStats,
    anomalies: Mapping[str, int],
    now: float,
    pss_mb: Mapping[int, float] | None = None,
) -> Snapshot:
    """Copy what the loop knows now into a Snapshot; `rss_mb` (and `pss_mb`) the memory monitor's last sample per pid.

    The request times of a model no longer served are dropped here, with its other series.
    """
    slots = pool.all_slots()
    load_errors = pool.load_errors()
    models: list[ModelSample] = []
    times = broker.times.models
    for name in list(times):
        if name not in pool.members:  # a removed model's histograms go with it
            del times[name]
    for name in pool.members:
        queue = broker.queues.get(name)
        if queue is None:
            continue
        mine = [s for s in slots if s.model.name == name]
        states = {state.value: 0 for state in SlotState}
        for slot in mine:
            states[slot.state.value] += 1
        model_times = times.get(name)
        models.append(
            ModelSample(
                name=name,
                completed=queue.completed,
                errors=tuple(sorted(queue.errors.items())),
                queued=len(queue.waiting),
                capacity=queue.capacity,
                in_flight=sum(broker.pipelines.of(s).size for s in mine),
                workers=tuple(states.items()),
                total=EMPTY if model_times is None else _histogram(model_times.total, model_times.total_sum),
                queue=EMPTY if model_times is None else _histogram(model_times.queue, model_times.queue_sum),
                service=EMPTY if model_times is None else _histogram(model_times.service, model_times.service_sum),
                batch_sizes=tuple(sorted(queue.batch_sizes.items())),
                load_failures=pool.load_failures[name],
                load_error=clip(load_errors.get(name, ""), LOAD_ERROR_LABEL_CHARS),
            )
        )
    serving = {id(s) for members in pool.members.values() for s in members if s.state is SlotState.SERVING}
    workers = tuple(
        WorkerSample(
            model=slot.model.name,
            slot=slot.assignment.slot,
            pid=pid,
            rss_bytes=round(rss_mb[pid] * MB) if pid in rss_mb else None,
            profile=slot.profile if id(slot) in serving else None,
            pss_bytes=round(pss_mb[pid] * MB) if pss_mb and pid in pss_mb else None,
        )
        for slot in slots
        if (pid := slot.pid) is not None
    )
    return Snapshot(
        taken_at=now,
        models=tuple(models),
        refused=tuple(sorted(broker.refused.items())),
        workers=workers,
        # Every reason of every model, from 0: a first crash then shows in increase().
        restarts=tuple(
            (name, reason.value, pool.restarts[(name, reason)]) for name in pool.members for reason in RestartReason
        ),
        reloads_success=reloads.success,
        reloads_failure=reloads.failure,
        last_reload_ok=reloads.last_ok,
        last_reload_success_at=reloads.last_success_at,
        config_digest=pool.serving.current.digest,
        throttled=bool(thermal.get("throttled", False)),
        shedding=broker.shed,
        max_temp_c=thermal.get("max_temp_c"),
        throttle_events=thermal.get("throttle_events"),
        min_freq_ratio=thermal.get("min_freq_ratio"),
        anomalies=tuple(sorted((k, n) for k, n in anomalies.items() if not k.startswith("rejected_"))),
    )


# ---- rendering: runs on whichever thread reads -------------------------------------------------


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
        yield from _daemon_families(snapshot)


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
        requests.add_metric([model.name, "success", "ok"], model.completed)
        errors = dict(model.errors)
        for code in (*ERROR_CODES, *sorted(set(errors) - set(ERROR_CODES))):
            requests.add_metric([model.name, "error", code], errors.get(code, 0))
        queued.add_metric([model.name], model.queued)
        capacity.add_metric([model.name], model.capacity)
        in_flight.add_metric([model.name], model.in_flight)
        for which, histogram in (("total", model.total), ("queue", model.queue), ("service", model.service)):
            histograms[which].add_metric([model.name], histogram.cumulative(), histogram.total)
    for code, count in snapshot.refused:
        requests.add_metric(["", "error", code], count)
    yield from (requests, queued, capacity, in_flight, *histograms.values())
    yield _batch_sizes(snapshot)


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
        for state, count in model.workers:
            states.add_metric([model.name, state], count)
    rss = GaugeMetricFamily(
        "infervisor_worker_resident_memory_bytes",
        "RSS of each serving or draining worker, as the memory monitor last sampled it",
        labels=["model", "slot", "pid"],
        unit="bytes",
    )
    pss = GaugeMetricFamily(
        "infervisor_worker_proportional_memory_bytes",
        "PSS of each serving or draining worker (shared pages divided among the processes mapping them): "
        "what the box pays for it",
        labels=["model", "slot", "pid"],
        unit="bytes",
    )
    profile = InfoMetricFamily(
        "infervisor_worker_profile", "the optimisation profile each serving worker runs", labels=["model", "slot"]
    )
    for worker in snapshot.workers:
        if worker.rss_bytes is not None:
            rss.add_metric([worker.model, str(worker.slot), str(worker.pid)], worker.rss_bytes)
        if worker.pss_bytes is not None:
            pss.add_metric([worker.model, str(worker.slot), str(worker.pid)], worker.pss_bytes)
        if worker.profile is not None:
            profile.add_metric([worker.model, str(worker.slot)], {"profile": worker.profile})
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
            load_error.add_metric([model.name], {"error": model.load_error})
    yield from (states, rss, pss, profile, restarts, load_failures, load_error)


def _daemon_families(snapshot: Snapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "infervisor_thermal_throttled", "1 while the CPU throttles or runs too hot", float(snapshot.throttled)
    )
    yield GaugeMetricFamily(
        "infervisor_thermal_shedding",
        "1 while throttling routes to half of each model's workers",
        float(snapshot.shedding),
    )
    if snapshot.max_temp_c is not None:
        yield GaugeMetricFamily("infervisor_cpu_temperature_celsius", "hottest thermal zone", snapshot.max_temp_c)
    if snapshot.throttle_events is not None:
        yield CounterMetricFamily(
            "infervisor_cpu_throttle_events",
            "the kernel's core and package throttle counts, summed",
            snapshot.throttle_events,
        )
    if snapshot.min_freq_ratio is not None:
        yield GaugeMetricFamily(
            "infervisor_cpu_frequency_ratio", "lowest current/maximum clock over the CPUs", snapshot.min_freq_ratio
        )
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
    anomalies = CounterMetricFamily(
        "infervisor_anomalies", "things that should not happen, by kind (status counters)", labels=["kind"]
    )
    for kind, count in snapshot.anomalies:
        anomalies.add_metric([kind], count)
    yield anomalies
    yield GaugeMetricFamily(
        "infervisor_metrics_snapshot_timestamp_seconds",
        "Unix time the loop took these figures (it lags while the loop stalls)",
        snapshot.taken_at,
    )


# ---- the registry and the HTTP endpoint --------------------------------------------------------


def parse_listen(address: str) -> tuple[str, int, socket.AddressFamily]:
    """HOST:PORT (as config validation accepts it) as bind arguments: `[::1]:9464` is IPv6, `localhost` 127.0.0.1."""
    host, _, port = address.rpartition(":")
    if host.startswith("["):
        return host[1:-1], int(port), socket.AF_INET6
    return ("127.0.0.1" if host == "localhost" else host), int(port), socket.AF_INET


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (stdout and stderr are the JSON log); a read timeout per connection."""

    timeout = READ_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's parameter name
        """Scrapes are not logged."""


class _Server(WSGIServer):
    """wsgiref's server, one request at a time on its one thread, without a reverse DNS lookup at bind."""

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks getfqdn(host), which can stall start-up on a box without DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("metrics_request_failed", client=str(client_address), exc_info=True)


class _Server6(_Server):
    """The same on IPv6."""

    address_family = socket.AF_INET6


class Metrics:
    """The registry that renders the loop's latest snapshot, and the opt-in HTTP endpoint serving it."""

    def __init__(self) -> None:
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # the supervisor's own process_* figures, the standard names
        self.server: _Server | None = None
        self.thread: threading.Thread | None = None
        #: Where scrapes go once listening, and why not when binding failed.
        self.url: str | None = None
        self.error: str | None = None

    def publish(self, snapshot: Snapshot) -> None:
        """Swap in a new snapshot: one reference assignment, so a reader sees the old one or the new one whole."""
        self.collector.snapshot = snapshot

    def render(self) -> str:
        """The text exposition format of the latest snapshot (what a scrape of /metrics returns)."""
        return generate_latest(self.registry).decode()

    def listen(self, address: str) -> None:
        """Serve /metrics on HOST:PORT from a thread of its own; a failure is logged and shown, serving goes on."""
        host, port, family = parse_listen(address)
        server_class = _Server6 if family == socket.AF_INET6 else _Server
        try:
            server = make_server(host, port, make_wsgi_app(self.registry), server_class, _QuietHandler)
        except OSError as exc:
            self.error = f"cannot listen on {address}: {exc.strerror or exc}"
            log.error("metrics_listen_failed", listen=address, error=self.error)
            return
        self.server = server
        # poll_interval bounds how long close() waits for the thread to notice.
        self.thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )
        self.thread.start()
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.url = f"http://{shown}:{port}/metrics"
        log.info("metrics_listening", url=self.url)

    def close(self) -> None:
        """Stop the HTTP endpoint and close its socket."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
