"""Monitors against live workers: memory limits and leaks, planned recycling, drift, heat, canaries, model files."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.supervisor.core.fallback_control import FallbackControl
from infervisor.supervisor.core.responses import Responses
from infervisor.supervisor.monitors.canary import CanaryWatch
from infervisor.supervisor.monitors.findings import Action
from infervisor.supervisor.monitors.thermal import ThermalWatch
from infervisor.supervisor.monitors.view import MonitorView
from infervisor.supervisor.settings.config import parse_config
from tests.conftest import ROOT, Daemon, model_entry, wait_for, write_thermal_sysfs
from tests.fault_models import CORRUPT, ECHO, FAULT_INPUTS, GROW, LEAK, SLOW, command
from tests.slow_model import SLOW_INPUTS, rounds, write_slow_model
from tests.test_pool_states import MODEL, Rig

FAULTY = {"python": "tests.fault_models:faulty"}
FAST = {"monitor_interval_s": 0.2}


def _pool(daemon: Daemon, model: str = "faulty") -> list[dict[str, Any]]:
    return [w for w in daemon.status()["models"][model]["workers"] if "role" not in w]


def _fired(daemon: Daemon, monitor: str) -> list[dict[str, Any]]:
    return [e for e in daemon.log_events() if e["event"] == "monitor_fired" and e["monitor"] == monitor]


def _replaced(daemon: Daemon, pid: int, model: str = "faulty") -> Callable[[], bool]:
    def check() -> bool:
        pool = _pool(daemon, model)
        return all(w["pid"] not in (None, pid) and w["state"] == "serving" for w in pool)

    return check


def _start(start_daemon: Callable[..., Daemon], workers: int = 1, **model: Any) -> tuple[Daemon, list[int]]:
    config = {
        **FAST,
        "oversubscribe": True,
        "models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, workers=workers, **model)},
    }
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    return daemon, [w["pid"] for w in daemon.wait_ready()["models"]["faulty"]["workers"]]


def test_soft_rss_limit_recycles_and_hard_limit_kills(start_daemon: Callable[..., Daemon]) -> None:
    """Past the soft limit a worker is replaced after its request; past the hard limit it is killed at once."""
    daemon, (pid,) = _start(start_daemon, rss_soft_mb=600, rss_hard_mb=1500)
    with daemon.client() as client:
        client.infer("faulty", command(LEAK, 500.0), timeout=60)
        wait_for(_replaced(daemon, pid), 120, "soft-limit recycle")
        assert _fired(daemon, "rss_soft")[0]["action"] == "recycle"
        second = _pool(daemon)[0]["pid"]
        # If the kill lands while the allocation is still running, the request itself is the poison:
        # it is retried on fresh workers and ends WORKER_LOST, which is also an answer.
        try:
            client.infer("faulty", command(LEAK, 1600.0), timeout=120)
        except InferenceError as exc:
            assert exc.code == ErrorCode.WORKER_LOST
        wait_for(_replaced(daemon, second), 120, "hard-limit kill and respawn")
    assert _fired(daemon, "rss_hard")[0]["action"] == "kill"


def test_a_draining_worker_is_still_killed_past_the_hard_limit(start_daemon: Callable[..., Daemon]) -> None:
    """A worker retired by a drain-first restart whose last request balloons is killed by rss_hard, not let finish."""
    daemon, (pid,) = _start(start_daemon, rss_hard_mb=900, rollout="drain_first", max_retries=0)
    codes: list[ErrorCode] = []

    def grow() -> None:
        with daemon.client() as client:
            try:
                client.infer("faulty", command(GROW, 2000.0), timeout=120)
            except InferenceError as exc:
                codes.append(exc.code)

    sender = threading.Thread(target=grow)
    sender.start()
    wait_for(lambda: _pool(daemon)[0]["inflight"] > 0, 30, "the growing request dispatched")
    assert daemon.control({"cmd": "restart"})["queued"] == 1
    sender.join(120)
    assert codes == [ErrorCode.WORKER_LOST]
    (fired,) = [e for e in _fired(daemon, "rss_hard") if e["pid"] == pid]
    states = [e["new"] for e in daemon.log_events() if e["event"] == "worker_state" and e.get("pid") == pid]
    assert states == ["starting", "serving", "draining", "stopped"], states
    assert fired["rss_mb"] > 900


def test_leak_slope_recycles_a_leaking_worker(start_daemon: Callable[..., Daemon]) -> None:
    """A worker whose RSS keeps climbing by 10 MB per request is recycled on its slope alone."""
    daemon, (pid,) = _start(start_daemon, leak_mb_per_min=100.0, leak_window_s=2.0)
    with daemon.client() as client:

        def leak_once() -> bool:
            client.infer("faulty", command(LEAK, 10.0), timeout=60)
            return _replaced(daemon, pid)()

        wait_for(leak_once, 120, "leak recycle", interval=0.05)
    assert _fired(daemon, "rss_leak")[0]["mb_per_min"] > 100.0


def test_max_requests_recycles_after_the_limit(start_daemon: Callable[..., Daemon]) -> None:
    """With max_requests 5 and no jitter the worker is replaced after its fifth request."""
    daemon, (pid,) = _start(start_daemon, max_requests=5, recycle_jitter=0.0)
    with daemon.client() as client:
        for value in range(5):
            client.infer("faulty", command(ECHO, float(value)), timeout=30)
    wait_for(_replaced(daemon, pid), 120, "max_requests recycle")
    assert _fired(daemon, "max_requests")[0]["requests"] == 5


def test_a_worker_slower_than_its_own_baseline_is_recycled_alone(start_daemon: Callable[..., Daemon]) -> None:
    """One of two workers slows down 50x: it alone is recycled; its sibling keeps its pid."""
    daemon, pids = _start(start_daemon, workers=2, drift_factor=3.0, drift_window=10)
    stop = threading.Event()

    def load() -> None:
        with daemon.client() as client:
            while not stop.is_set():
                client.infer("faulty", command(ECHO), timeout=60)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: all(w["requests"] >= 10 for w in _pool(daemon)), 60, "baselines")
        with daemon.client() as client:
            client.infer("faulty", command(SLOW, 0.05), timeout=30)
        wait_for(lambda: _fired(daemon, "latency_drift"), 120, "drift found")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    slow = _fired(daemon, "latency_drift")[0]["pid"]
    wait_for(lambda: slow not in [w["pid"] for w in _pool(daemon)], 120, "slow worker replaced")
    assert set(pids) - {slow} <= {w["pid"] for w in _pool(daemon)}


def test_throttling_is_an_event_and_sheds_concurrency_without_restarts(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """New throttle events (fake sysfs) raise an event and halve routing; workers are not restarted; it recovers."""
    sysfs = tmp_path / "sys"
    write_thermal_sysfs(sysfs, 60.0, 0)
    config = {
        **FAST,
        "oversubscribe": True,
        "thermal_sysfs_root": str(sysfs),
        "thermal_action": "shed",
        "thermal_max_c": 95.0,
        "models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, workers=2)},
    }
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    pids = {w["pid"] for w in daemon.wait_ready()["models"]["faulty"]["workers"]}
    wait_for(lambda: daemon.status()["thermal"].get("max_temp_c") == 60.0, 30, "thermal reading")
    write_thermal_sysfs(sysfs, 70.0, 3)
    wait_for(lambda: daemon.status()["thermal"]["shedding"], 30, "shedding on throttle")
    thermal = daemon.status()["thermal"]
    assert thermal["throttle_events"] == 3 and thermal["min_freq_ratio"] == 0.5
    with daemon.client() as client:
        for _ in range(6):
            client.infer("faulty", command(ECHO), timeout=30)
    served = sorted(w["requests"] for w in _pool(daemon))
    assert served[0] == 0, "while shedding only half of the workers take requests"
    wait_for(lambda: not daemon.status()["thermal"]["shedding"], 30, "recovered once the counter stops")
    assert {w["pid"] for w in _pool(daemon)} == pids
    assert _fired(daemon, "thermal_throttle") and _fired(daemon, "thermal_recovered")


def test_canary_mismatch_recycles_a_corrupted_worker(start_daemon: Callable[..., Daemon]) -> None:
    """A worker whose outputs on the golden inputs moved since warm-up is caught by the canary and replaced."""
    daemon, (pid,) = _start(start_daemon, canary_interval_s=0.3)
    wait_for(lambda: (_pool(daemon)[0]["last_event"] or {}).get("monitor") == "canary_ok", 30, "a passing canary")
    with daemon.client() as client:
        client.infer("faulty", command(CORRUPT, 0.5), timeout=30)
    wait_for(_replaced(daemon, pid), 120, "canary recycle")
    assert _fired(daemon, "canary_mismatch")[0]["max_abs_error"] >= 0.5


def test_changed_model_file_restarts_its_model_rolling(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """Rewriting a TorchScript file on disk replaces that model's worker; nothing is lost."""
    path = write_slow_model(tmp_path)
    daemon = start_daemon({"models": {"slow": model_entry({"torchscript": str(path)}, SLOW_INPUTS)}})
    pid = daemon.wait_ready()["models"]["slow"]["workers"][0]["pid"]
    write_slow_model(tmp_path)
    os.utime(path)
    wait_for(_replaced(daemon, pid, "slow"), 120, "model-file restart")
    with daemon.client() as client:
        assert client.infer("slow", rounds(1), timeout=30)["output"].shape == (1, 1)
    assert any(e["event"] == "restart_requested" and "model file" in e["reason"] for e in daemon.log_events())
    assert np.isfinite(daemon.status()["models"]["slow"]["workers"][0]["ready_ms"])


def test_a_model_file_broken_on_disk_shows_in_the_models_error_and_health(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A TorchScript file that no longer loads: models.M.error and a degraded health while the old worker serves on."""
    path = write_slow_model(tmp_path)
    good = path.read_bytes()
    daemon = start_daemon({"models": {"slow": model_entry({"torchscript": str(path)}, SLOW_INPUTS)}})
    pid = daemon.wait_ready()["models"]["slow"]["workers"][0]["pid"]
    path.write_bytes(b"not a TorchScript archive")
    status = wait_for(lambda: (s := daemon.status())["models"]["slow"]["error"] and s, 120, "the load error shown")
    model = status["models"]["slow"]
    assert "replacement failed" in model["error"], model["error"]
    assert model["health"] == "degraded" and "cannot be replaced" in model["reason"], model
    assert status["state"] == "degraded"
    assert _pool(daemon, "slow")[0]["pid"] == pid
    with daemon.client() as client:
        assert client.infer("slow", rounds(1), timeout=30)["output"].shape == (1, 1)
    path.write_bytes(good)  # fixed on disk: the next replacement serves, and the model is whole again
    wait_for(lambda: daemon.status()["models"]["slow"]["health"] == "serving", 120, "the model whole again")
    assert daemon.status()["models"]["slow"]["error"] is None


def test_shedding_is_a_thermal_finding_answered_by_the_responses_table(tmp_path: Path) -> None:
    """A hot box makes the thermal monitor ask for shedding (a SHED finding), its response starts it; cool, ends it."""
    sysfs = tmp_path / "sysfs"
    write_thermal_sysfs(sysfs, 99.0, 0)
    settings = {"thermal_sysfs_root": str(sysfs), "thermal_action": "shed", "thermal_max_c": 95.0}
    view = MonitorView(
        parse_config(json.dumps({**settings, "models": {"tiny": MODEL}}), tmp_path), {}, [], frozenset(), {}
    )
    (tmp_path / "rig").mkdir()
    rig = Rig(tmp_path / "rig")
    responses = Responses(
        rig.serving, rig.pool, rig.broker, rig.links, FallbackControl(rig.serving, rig.pool), CanaryWatch()
    )
    watch = ThermalWatch()
    try:
        for temp_c, shed in ((99.0, True), (99.0, None), (60.0, False)):
            write_thermal_sysfs(sysfs, temp_c, 0)
            asked = [f for f in watch.check(time.monotonic(), view) if f.action is Action.SHED]
            assert [f.detail["shed"] for f in asked] == ([] if shed is None else [shed])
            for finding in asked:
                responses.act(finding)
            assert rig.broker.dispatcher.shed is (temp_c >= 95.0)
    finally:
        rig.close()
