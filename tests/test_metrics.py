"""Prometheus metrics: a real daemon scraped over HTTP and read with prometheus_client's own parser."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from infervisor.protocol.client import Client
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import InferenceError
from infervisor.supervisor.instruments.recorders import BUCKETS_S, ModelTimes, ReloadStats
from infervisor.supervisor.monitors.audit import AUDIT_READINGS
from infervisor.supervisor.monitors.memory import MEMORY_READINGS
from infervisor.supervisor.monitors.readings import MonitorReadings, Readings
from infervisor.supervisor.observe import status
from infervisor.supervisor.observe.capture import Figures, take_snapshot
from infervisor.supervisor.observe.exposition import Metrics
from infervisor.supervisor.observe.snapshot import Snapshot
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.config import ConfigError, parse_config
from infervisor.supervisor.workers.slot import RestartReason, SlotState
from tests.conftest import ROOT, TINY_INPUTS, Daemon, free_loopback_port, model_entry, wait_for, write_thermal_sysfs
from tests.test_pool_states import Rig

DASHBOARD = ROOT / "deploy" / "grafana" / "infervisor.json"
#: Samples by name, then by their labels as a sorted tuple of pairs.
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _samples(text: str) -> Samples:
    """Every sample of an exposition text, parsed by prometheus_client's parser."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert isinstance(sample, Sample)
            found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample of `name` with exactly these labels, or None."""
    return samples.get(name, {}).get(tuple(sorted(labels.items())))


def _scrape(url: str) -> Samples:
    """GET the endpoint as Prometheus does."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return _samples(response.read().decode())


def _scrape_until(url: str, ready: Callable[[Samples], bool], what: str, timeout: float = 10.0) -> Samples:
    """Scrape until `ready` holds: the loop publishes a new snapshot every monitor turn."""

    def attempt() -> Samples | None:
        samples = _scrape(url)
        return samples if ready(samples) else None

    found: Samples = wait_for(attempt, timeout, what)
    return found


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon serving `tiny` with metrics on a free loopback port, its thermal sysfs faked hot."""
    folder = tmp_path_factory.mktemp("metrics")
    sysfs = folder / "sysfs"
    write_thermal_sysfs(sysfs, 95.0, 0)
    config = {
        "metrics_listen": f"127.0.0.1:{free_loopback_port()}",
        "monitor_interval_s": 0.1,
        "thermal_sysfs_root": str(sysfs),
        "thermal_max_c": 90.0,
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)},
    }
    started = Daemon(folder, config)
    try:
        started.wait_ready(timeout=120)
        yield started
    finally:
        code = started.stop()
        assert code == 0, started.log_text()[-3000:]


def _url(daemon: Daemon) -> str:
    url = daemon.status()["endpoints"]["metrics"]
    assert isinstance(url, str) and url.endswith("/metrics"), url
    return url


def test_buckets_count_a_value_on_its_bound_and_past_the_last_in_inf() -> None:
    """`le` is inclusive: 0.1 ms lands in the first bucket, 31 s only in +Inf; the sums add up."""
    model = ModelTimes()
    model.request_done(0.0, 0.0001, 0.0002)  # queue 0.1 ms, service 0.1 ms, total 0.2 ms
    model.request_done(0.0, 1.0, 32.0)  # queue 1 s, service 31 s, total 32 s
    assert model.queue[0] == 1 and model.queue[BUCKETS_S.index(1.0)] == 1
    assert model.service[0] == 1 and model.service[-1] == 1
    assert model.total[BUCKETS_S.index(0.00025)] == 1 and model.total[-1] == 1
    assert model.service_sum == pytest.approx(31.0001) and sum(model.total) == 2


def test_restarts_are_counted_by_reason_and_asked_for_exits_are_not(rig: Rig) -> None:
    """A crash, an operator restart, a monitor recycle and a silent worker each count once, under their reason."""
    rig.pool.start()
    (slot,) = rig.slots()
    rig.ready(slot)
    rig.exit(slot, -9)  # killed by someone else: a crash, respawned at once
    rig.tick()
    assert dict(rig.pool.restarts) == {("tiny", RestartReason.CRASH): 1}
    rig.ready(slot)
    rig.pool.restart("tiny", "operator command")
    rig.tick()
    successor = rig.pool.rollout.successor
    assert successor is not None
    rig.ready(successor)
    rig.tick()
    assert slot.state is SlotState.DRAINING
    rig.exit(slot, 0)  # the replaced worker drained and left, as asked: not a restart of its own
    rig.tick()
    assert slot.state is SlotState.STOPPED and rig.slots() == [successor]
    rig.pool.recycle(successor, "monitor memory")
    rig.tick()
    config = rig.pool.serving.current
    rig.tick(config.heartbeat_interval_ms / 1000.0 * (config.heartbeat_liveness + 1))  # silent: killed
    rig.tick()  # and reaped
    assert dict(rig.pool.restarts) == {
        ("tiny", RestartReason.CRASH): 1,
        ("tiny", RestartReason.OPERATOR): 1,
        ("tiny", RestartReason.MONITOR_RECYCLE): 1,
        ("tiny", RestartReason.HEARTBEAT): 1,
    }


def _finish_successes(rig: Rig, model: str, count: int) -> None:
    """Answer `count` requests of `model` with a result, as the broker does for a worker's reply."""
    client = (rig.endpoints.sockets[0], b"a client that left")
    now = time.monotonic()
    for i in range(count):
        request = PendingRequest(i, client, i, model, [], now - 0.002, None, dispatched_at=now - 0.001)
        rig.broker.streams.finish(request, None, b"{}", [])


def _snapshot(rig: Rig) -> Snapshot:
    figures = Figures((), ReloadStats(time.time()), {})
    return take_snapshot(rig.pool, rig.broker, figures, None, time.time(), time.monotonic())


def test_status_and_the_exposition_render_one_snapshot_that_changes_nothing(rig: Rig) -> None:
    """A success counts once in the record status and the exposition both render; taking the snapshot leaves the
    broker's record as it was; a model removed and added back starts from zero in both, histograms included."""
    rig.pool.start()
    (slot,) = rig.slots()
    rig.ready(slot)
    _finish_successes(rig, "tiny", 2)
    times = rig.broker.queues["tiny"].times
    before = (times.completed, list(times.total), list(times.recent_ms))
    snapshot = _snapshot(rig)
    assert (times.completed, list(times.total), list(times.recent_ms)) == before
    metrics = Metrics()
    for completed in (2, 0):
        metrics.publish(snapshot)
        samples = _samples(metrics.render())
        shown = status.models_status(snapshot)["tiny"]
        assert shown["completed"] == completed
        assert (shown["p50_ms"] is None) == (completed == 0)
        assert _value(samples, "infervisor_requests_total", model="tiny", outcome="success", code="ok") == completed
        assert _value(samples, "infervisor_request_duration_seconds_count", model="tiny") == completed
        rig.broker.remove_model("tiny")  # a reload drops the model, and the next one adds it back
        rig.broker.sync_queues()
        snapshot = _snapshot(rig)


def test_status_shows_the_memory_sample_the_metrics_show(rig: Rig) -> None:
    """A worker's rss and pss in status are the monitor's sample in the one snapshot that /metrics renders."""
    rig.pool.start()
    (slot,) = rig.slots()
    rig.ready(slot)
    pid = slot.pid
    assert pid is not None
    memory = Readings(workers={pid: {"rss": 123 * 2**20, "pss": 45 * 2**20}})
    figures = Figures((MonitorReadings("memory", MEMORY_READINGS, memory),), ReloadStats(time.time()), {})
    snapshot = take_snapshot(rig.pool, rig.broker, figures, None, time.time(), time.monotonic())
    metrics = Metrics()
    metrics.publish(snapshot)
    samples = _samples(metrics.render())
    (worker,) = status.models_status(snapshot)["tiny"]["workers"]
    labels = {"model": "tiny", "slot": "0", "pid": str(pid)}
    assert worker["rss"] == _value(samples, "infervisor_worker_resident_memory_bytes", **labels) == 123 * 2**20
    assert worker["pss"] == _value(samples, "infervisor_worker_proportional_memory_bytes", **labels) == 45 * 2**20


def test_the_audit_reading_is_its_status_key_and_its_own_families(rig: Rig) -> None:
    """The audit's one nested reading shows whole in status, and its families pick their figures out of it."""
    rig.pool.start()
    report = {"rows_audited": 5, "rows_below_tolerance": 1, "dropped": 2, "worst": {"cosine": 0.97},
              "process": {"state": "ready", "restarts": 3}}  # fmt: skip
    audit = MonitorReadings("audit", AUDIT_READINGS, Readings(models={"tiny": {"audit": report}}))
    snapshot = take_snapshot(
        rig.pool, rig.broker, Figures((audit,), ReloadStats(time.time()), {}), None, time.time(), time.monotonic()
    )
    assert status.models_status(snapshot)["tiny"]["audit"] == report
    metrics = Metrics()
    metrics.publish(snapshot)
    samples = _samples(metrics.render())
    assert _value(samples, "infervisor_audit_rows_total", model="tiny") == 5
    assert _value(samples, "infervisor_audit_rows_below_tolerance_total", model="tiny") == 1
    assert _value(samples, "infervisor_audit_dropped_total", model="tiny") == 2
    assert _value(samples, "infervisor_audit_worst_cosine", model="tiny") == 0.97
    assert _value(samples, "infervisor_audit_process_state", model="tiny", state="ready") == 1
    assert _value(samples, "infervisor_audit_process_state", model="tiny", state="off") == 0
    assert _value(samples, "infervisor_audit_process_restarts_total", model="tiny") == 3


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """A one-worker pool of `tiny` without processes (tests/test_pool_states.py)."""
    made = Rig(tmp_path)
    yield made
    made.close()


@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "10.1.2.3:9464", "[::]:9464"])
def test_a_listen_address_beyond_loopback_needs_the_explicit_opt_in(listen: str) -> None:
    """Without metrics_allow_remote a non-loopback metrics_listen is refused; with it, accepted as written."""
    model = {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}
    with pytest.raises(ConfigError) as refused:
        parse_config(json.dumps({"metrics_listen": listen, "models": model}), ROOT)
    assert any(p.startswith("metrics_listen:") and "metrics_allow_remote" in p for p in refused.value.problems)
    config = parse_config(json.dumps({"metrics_listen": listen, "metrics_allow_remote": True, "models": model}), ROOT)
    assert config.metrics_listen == listen


@pytest.mark.parametrize("listen", ["127.0.0.1", "localhost:0", "127.0.0.1:70000", "metrics.example:9464", 9464])
def test_a_malformed_listen_address_is_refused(listen: object) -> None:
    """HOST:PORT with an IP address (or localhost) and a port 1-65535, nothing else."""
    model = {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}
    with pytest.raises(ConfigError) as refused:
        parse_config(json.dumps({"metrics_listen": listen, "models": model}), ROOT)
    assert any(p.startswith("metrics_listen:") for p in refused.value.problems), refused.value.problems


def test_a_scrape_counts_every_request_by_outcome_and_code(daemon: Daemon) -> None:
    """N requests, some refused (unknown model, invalid input): the counters grow by N, the histograms by the rest."""
    url = _url(daemon)
    before = _scrape(url)
    ok, unknown, invalid = 23, 3, 4
    refused = [("nope", (1, 16), ErrorCode.UNKNOWN_MODEL)] * unknown + [
        ("tiny", (1, 15), ErrorCode.INVALID_INPUT)
    ] * invalid
    with Client(daemon.endpoint) as client:
        for _ in range(ok):
            client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, timeout=10)
        for model, shape, code in refused:
            with pytest.raises(InferenceError) as caught:
                client.infer(model, {"x": np.ones(shape, np.float32)}, timeout=10)
            assert caught.value.code == code

    def grown(samples: Samples, name: str, **labels: str) -> float:
        return (_value(samples, name, **labels) or 0) - (_value(before, name, **labels) or 0)

    def requests(samples: Samples) -> float:
        return sum(samples["infervisor_requests_total"].values()) - sum(before["infervisor_requests_total"].values())

    n = ok + unknown + invalid
    samples = _scrape_until(url, lambda s: requests(s) >= n, f"{n} more requests in a scrape")
    assert requests(samples) == n
    assert grown(samples, "infervisor_requests_total", model="tiny", outcome="success", code="ok") == ok
    assert grown(samples, "infervisor_requests_total", model="", outcome="error", code="UNKNOWN_MODEL") == unknown
    assert grown(samples, "infervisor_requests_total", model="tiny", outcome="error", code="INVALID_INPUT") == invalid
    assert _value(samples, "infervisor_requests_total", model="tiny", outcome="error", code="WORKER_LOST") == 0
    for histogram in ("duration", "queue", "service"):
        name = f"infervisor_request_{histogram}_seconds"
        assert grown(samples, f"{name}_count", model="tiny") == ok
        assert grown(samples, f"{name}_bucket", model="tiny", le="+Inf") == ok
        assert len(samples[f"{name}_bucket"]) == len(BUCKETS_S) + 1
    total_s = grown(samples, "infervisor_request_duration_seconds_sum", model="tiny")
    parts_s = sum(grown(samples, f"infervisor_request_{h}_seconds_sum", model="tiny") for h in ("queue", "service"))
    assert 0 < parts_s <= total_s
    assert _value(samples, "infervisor_requests_in_flight", model="tiny") == 0
    assert _value(samples, "infervisor_requests_queued", model="tiny") == 0
    assert _value(samples, "infervisor_queue_capacity", model="tiny") == 64

    # The same families over the control socket, from the CLI.
    shown = subprocess.run(
        [sys.executable, "-m", "infervisor", "metrics", "--runtime-dir", str(daemon.runtime_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    printed = _samples(shown.stdout)
    assert set(printed) == set(samples)
    assert grown(printed, "infervisor_requests_total", model="tiny", outcome="success", code="ok") == ok


def test_a_scrape_shows_the_serving_profile_the_build_memory_and_heat(daemon: Daemon) -> None:
    """Info metrics name the serving profile and the build; RSS and PSS per worker; the fake heat throttles."""
    status = daemon.status()
    (worker,) = status["models"]["tiny"]["workers"]
    samples = _scrape_until(
        _url(daemon), lambda s: _value(s, "infervisor_thermal_throttled") == 1, "the hot fake sysfs read"
    )
    profile = _value(samples, "infervisor_worker_profile_info", model="tiny", slot="0", profile=worker["profile"])
    assert worker["profile"] and profile == 1
    ((labels, value),) = samples["infervisor_build_info"].items()
    build = dict(labels)
    assert value == 1 and build["protocol_version"] == "1" and build["torch_version"].startswith("2.13")
    rss = _value(samples, "infervisor_worker_resident_memory_bytes", model="tiny", slot="0", pid=str(worker["pid"]))
    assert rss is not None and rss > 10 * 2**20
    pss = _value(samples, "infervisor_worker_proportional_memory_bytes", model="tiny", slot="0", pid=str(worker["pid"]))
    assert pss is not None and 10 * 2**20 < pss <= rss, "PSS sampled with RSS, never above it"
    assert worker["pss"] is not None and 10 * 2**20 < worker["pss"] <= worker["rss"] * 1.1, worker
    assert _value(samples, "infervisor_cpu_temperature_celsius") == 95.0
    assert _value(samples, "infervisor_workers", model="tiny", state="serving") == 1
    assert _value(samples, "infervisor_config_info", digest=status["config"]["digest"]) == 1
    assert samples["process_resident_memory_bytes"], "the supervisor's own process metrics"


def test_a_worker_killed_with_sigkill_shows_as_a_crash_restart(daemon: Daemon) -> None:
    """kill -9 of the worker from outside: one restart with reason crash, and a serving worker again."""
    url = _url(daemon)
    before = _value(_scrape(url), "infervisor_worker_restarts_total", model="tiny", reason="crash")
    assert before is not None
    (worker,) = daemon.status()["models"]["tiny"]["workers"]
    os.kill(worker["pid"], signal.SIGKILL)
    daemon.wait_ready(timeout=120)

    def restarted(samples: Samples) -> bool:
        crash = _value(samples, "infervisor_worker_restarts_total", model="tiny", reason="crash")
        return crash == before + 1 and _value(samples, "infervisor_workers", model="tiny", state="serving") == 1

    samples = _scrape_until(url, restarted, "the crash counted and the worker serving again", timeout=60)
    assert _value(samples, "infervisor_worker_restarts_total", model="tiny", reason="hang") == 0


def test_reloads_are_counted_by_outcome(daemon: Daemon) -> None:
    """A broken config.json counts a failure and clears last_reload_successful; the good one back, a success."""
    url = _url(daemon)
    good = daemon.config_path.read_text()
    before = _scrape(url)
    failures = _value(before, "infervisor_config_reloads_total", outcome="failure") or 0
    successes = _value(before, "infervisor_config_reloads_total", outcome="success") or 0
    daemon.config_path.write_text("{ not json")
    assert daemon.control({"cmd": "reload"})["ok"] is False
    # The file watcher may reload the same edit once more: at least one more of each.
    broken = _scrape_until(
        url,
        lambda s: (_value(s, "infervisor_config_reloads_total", outcome="failure") or 0) > failures,
        "the refused reload in a scrape",
    )
    assert _value(broken, "infervisor_config_last_reload_successful") == 0
    fixed_at = time.time()
    daemon.config_path.write_text(good)
    assert daemon.control({"cmd": "reload"})["ok"] is True
    fixed = _scrape_until(
        url, lambda s: _value(s, "infervisor_config_last_reload_successful") == 1, "the good reload in a scrape"
    )
    assert (_value(fixed, "infervisor_config_reloads_total", outcome="success") or 0) > successes
    stamp = _value(fixed, "infervisor_config_last_reload_success_timestamp_seconds")
    assert stamp is not None and stamp >= fixed_at


def _dashboard_names() -> set[str]:
    """Every metric name the dashboard's PromQL expressions and variable queries use."""
    board = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if variable.get("type") == "query":
            expressions.append(query["query"] if isinstance(query, dict) else query)
    return {name for expression in expressions for name in re.findall(r"\b(?:infervisor|process)_[a-z_]+", expression)}


def test_every_metric_the_dashboard_queries_is_in_a_live_scrape(daemon: Daemon) -> None:
    """Each name in the Grafana dashboard's queries is a sample name the daemon exposes (no suffix guessed)."""
    names = _dashboard_names()
    wanted = {
        "infervisor_requests_total",
        "infervisor_request_duration_seconds_bucket",
        "infervisor_requests_queued",
        "infervisor_worker_resident_memory_bytes",
        "infervisor_worker_restarts_total",
        "infervisor_thermal_throttled",
    }
    assert wanted <= names, f"the dashboard lacks panels for {wanted - names}"
    samples = _scrape_until(
        _url(daemon), lambda s: "infervisor_cpu_temperature_celsius" in s, "a scrape with the thermal readings"
    )
    assert sorted(names - set(samples)) == []


def test_the_dashboard_is_importable_grafana_json() -> None:
    """Unique panel ids, every query on the datasource variable, quantiles 0.5 and 0.99 from the histograms."""
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] and board["schemaVersion"] >= 36
    targets = [target for panel in board["panels"] for target in panel.get("targets", [])]
    assert all(t["datasource"]["uid"] == "${datasource}" and t["refId"] for t in targets)
    quantiles = [t["expr"] for t in targets if "histogram_quantile" in t["expr"]]
    assert any("histogram_quantile(0.5," in q for q in quantiles) and any(
        "histogram_quantile(0.99," in q for q in quantiles
    )
    assert all("_bucket" in q and "le" in q for q in quantiles)


def test_a_port_already_taken_is_reported_and_the_daemon_serves_on(start_daemon: Callable[..., Daemon]) -> None:
    """Metrics are not worth a refused start: a busy port shows in status and the log, requests are answered."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = start_daemon(
            {"metrics_listen": f"127.0.0.1:{port}", "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}
        )
        status = daemon.wait_ready(timeout=120)
        assert status["endpoints"]["metrics"] is None
        assert f"cannot listen on 127.0.0.1:{port}" in status["endpoints"]["metrics_error"]
        assert any(e.get("event") == "metrics_listen_failed" for e in daemon.log_events())
        with daemon.client() as client:
            assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, timeout=10)["y"].shape == (1, 16)
        assert "infervisor_requests_total" in _samples(daemon.control({"cmd": "metrics"})["text"])


def _idle_connections(url: str, count: int) -> list[socket.socket]:
    """`count` TCP connections to the metrics port that send nothing, as any local user can open."""
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]


@pytest.mark.parametrize("idle", [4, 64])
def test_idle_connections_do_not_blind_a_scrape(daemon: Daemon, idle: int) -> None:
    """With 4 or 64 idle connections open to the metrics port, a scrape still answers (within 3 s, not 5 s each)."""
    url = _url(daemon)
    held = _idle_connections(url, idle)
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            assert response.status == 200
            assert "infervisor_" in response.read().decode()

        # The oldest idle ones beyond the per-peer cap were closed at once, the rest when their head is late.
        def all_closed() -> bool:
            for sock in held:
                sock.settimeout(0.01)
                try:
                    if sock.recv(1) != b"":
                        return False
                except TimeoutError:
                    return False
                except OSError:
                    continue
            return True

        wait_for(all_closed, 10, "every idle connection closed by the endpoint")
    finally:
        for sock in held:
            sock.close()
