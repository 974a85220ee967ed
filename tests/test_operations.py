"""Operating the daemon live: rolling restarts under load, config reloads by diff, bad reloads, systemd notify."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infervisor.protocol import InferenceError
from infervisor.supervisor.settings.config_diff import unclassified_keys
from tests.conftest import ROOT, STATIC_TINY_INPUTS, TINY_INPUTS, Daemon, model_entry, notify_messages, wait_for
from tests.fault_models import ECHO, FAULT_INPUTS, command

FAULTY = {"python": "tests.fault_models:faulty"}


def _pool(daemon: Daemon, model: str) -> list[dict[str, Any]]:
    return [w for w in daemon.status()["models"][model]["workers"] if "role" not in w]


class Load:
    """Client threads sending requests back to back; counts successes and failures."""

    def __init__(self, daemon: Daemon, model: str, inputs: dict[str, np.ndarray], clients: int = 4) -> None:
        self.daemon, self.model, self.inputs = daemon, model, inputs
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        with self.daemon.client() as client:
            while not self.stop.is_set():
                try:
                    client.infer(self.model, self.inputs, timeout=60)
                except InferenceError as exc:
                    with self.lock:
                        self.failures.append(f"{exc.code}: {exc.message}")
                    continue
                with self.lock:
                    self.ok += 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def test_every_config_key_has_a_reload_rule() -> None:
    """Each config key is classified as live, rolling or daemon-restart, so no change is silently ignored."""
    assert unclassified_keys() == set()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cpus")
def test_rolling_restart_under_load_fails_nothing_and_keeps_n_minus_1(start_daemon: Callable[..., Daemon]) -> None:
    """`infervisor restart` replaces both workers one at a time under load: no failed request, never fewer than N-1."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=2)}})
    before = {w["pid"] for w in daemon.wait_ready()["models"]["tiny"]["workers"]}
    fewest = [2]
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            fewest[0] = min(fewest[0], sum(1 for w in _pool(daemon, "tiny") if w["state"] == "serving"))

    watcher = threading.Thread(target=watch, daemon=True)
    with Load(daemon, "tiny", {"x": np.ones((1, 16), np.float32)}) as load:
        watcher.start()
        answer = subprocess.run(
            [sys.executable, "-m", "infervisor", "restart", "--runtime-dir", str(daemon.runtime_dir), "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert json.loads(answer.stdout)["queued"] == 2
        wait_for(lambda: daemon.status()["rollout"]["completed"] == 2 and daemon.status()["rollout"]["pending"] == 0,
                 120, "rolling restart done")  # fmt: skip
        wait_for(lambda: len(daemon.status()["models"]["tiny"]["workers"]) == 2, 60, "old workers gone")
        watching.set()
        watcher.join(10)
    after = {w["pid"] for w in _pool(daemon, "tiny")}
    assert not before & after, "every worker was replaced"
    assert load.failures == [] and load.ok > 0
    assert fewest[0] >= 1, "capacity dropped below N-1"
    events = [e["event"] for e in daemon.log_events()]
    assert events.count("rollout_step_done") == 2


def test_reload_rolls_only_the_changed_model_and_applies_live_keys(start_daemon: Callable[..., Daemon]) -> None:
    """A renamed-over config.json restarts the model whose build changed and applies the other's queue size live."""
    config = {
        "oversubscribe": True,
        "models": {
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
            "faulty": model_entry(FAULTY, FAULT_INPUTS, queue_size=8),
        },
    }
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    status = daemon.wait_ready()
    tiny_pid = status["models"]["tiny"]["workers"][0]["pid"]
    faulty_pid = status["models"]["faulty"]["workers"][0]["pid"]
    config["models"]["tiny"]["warmup_iterations"] = 2
    config["models"]["faulty"]["queue_size"] = 32
    daemon.write_config(config, atomic=True)
    wait_for(lambda: daemon.status()["models"]["faulty"]["queue_size"] == 32, 30, "live key applied")

    def tiny_replaced() -> bool:
        worker = _pool(daemon, "tiny")[0]
        return worker["pid"] not in (None, tiny_pid) and worker["state"] == "serving"

    wait_for(tiny_replaced, 120, "tiny replaced")
    assert _pool(daemon, "faulty")[0]["pid"] == faulty_pid
    diff = daemon.status()["config"]["last_diff"]
    assert diff["rolling"] == {"tiny": ["warmup_iterations"]} and diff["model_live"] == {"faulty": ["queue_size"]}
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)


def test_bad_reload_changes_nothing_and_says_why(start_daemon: Callable[..., Daemon]) -> None:
    """Broken JSON and an invalid key written in place are refused; the last good config keeps serving."""
    config = {"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}
    daemon = start_daemon(config)
    status = daemon.wait_ready()
    digest, pid = status["config"]["digest"], status["models"]["tiny"]["workers"][0]["pid"]
    daemon.config_path.write_text('{"models": {"tiny": ')
    wait_for(lambda: daemon.status()["config"]["last_error"], 30, "broken JSON reported")
    assert daemon.status()["config"]["last_error"][0].startswith("(file): not valid JSON")
    broken = json.loads(json.dumps(config))
    broken["models"]["tiny"]["inputs"][0]["dtype"] = "float"
    daemon.write_config(broken, atomic=False)
    wait_for(lambda: any("models.tiny.inputs[0].dtype" in p for p in daemon.status()["config"]["last_error"] or []),
             30, "bad key reported with its path")  # fmt: skip
    status = daemon.status()
    assert status["config"]["digest"] == digest and status["models"]["tiny"]["workers"][0]["pid"] == pid
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)
    assert any(e["event"] == "config_rejected" for e in daemon.log_events())


def test_scaling_a_model_up_and_down_touches_only_the_difference(start_daemon: Callable[..., Daemon]) -> None:
    """workers 1 -> 2 adds a worker beside the running one; 2 -> 1 retires one and keeps the other."""
    config = {"oversubscribe": True, "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}
    daemon = start_daemon(config)
    first = daemon.wait_ready()["models"]["tiny"]["workers"][0]["pid"]
    config["models"]["tiny"]["workers"] = 2
    daemon.write_config(config)
    wait_for(lambda: [w["state"] for w in _pool(daemon, "tiny")] == ["serving", "serving"], 120, "scaled up")
    assert _pool(daemon, "tiny")[0]["pid"] == first
    config["models"]["tiny"]["workers"] = 1
    daemon.write_config(config)
    wait_for(lambda: len(daemon.status()["models"]["tiny"]["workers"]) == 1, 60, "scaled down")
    assert _pool(daemon, "tiny")[0]["pid"] == first


def test_failed_replacement_leaves_the_old_worker_serving(start_daemon: Callable[..., Daemon]) -> None:
    """A reload to a model that cannot load is reported; the old worker keeps answering, on its own input spec."""
    config = {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS)}}
    daemon = start_daemon(config, env={"PYTHONPATH": str(ROOT)})
    pid = daemon.wait_ready()["models"]["faulty"]["workers"][0]["pid"]
    config["models"]["faulty"]["source"] = {"python": "tests.fault_models:broken"}
    # The broker takes the new spec at once; the old worker still scans for NaN by its own.
    config["models"]["faulty"]["inputs"] = [{**FAULT_INPUTS[0], "allow_non_finite": True}]
    daemon.write_config(config)
    wait_for(lambda: daemon.status()["rollout"]["last_error"], 120, "replacement failure reported")
    assert _pool(daemon, "faulty")[0]["pid"] == pid
    long_frame = np.zeros((16384, 2), np.float32)
    long_frame[-1, 1] = np.nan
    with daemon.client() as client:
        assert client.infer("faulty", command(ECHO, 5.0), timeout=30)["output"][0, 1] == 5.0
        with pytest.raises(InferenceError, match="contains NaN or Inf"):
            client.infer("faulty", {"x": long_frame}, timeout=30)


def test_systemd_notify_sequence(
    start_daemon: Callable[..., Daemon], notify_socket: socket.socket, tmp_path: Path
) -> None:
    """READY=1 once warm, WATCHDOG=1 from the loop, RELOADING=1 + MONOTONIC_USEC then READY=1 on SIGHUP, STOPPING=1."""
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"}
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}, env=env)
    seen: list[str] = []
    notify_messages(notify_socket, lambda s: any("READY=1" in m for m in s), 120, seen)
    assert daemon.status()["models"]["tiny"]["workers"][0]["state"] == "serving"
    notify_messages(notify_socket, lambda s: sum("WATCHDOG=1" in m for m in s) >= 3, 30, seen)
    daemon.process.send_signal(signal.SIGHUP)
    notify_messages(notify_socket, lambda s: any("RELOADING=1" in m for m in s), 30, seen)
    reloading = next(m for m in seen if "RELOADING=1" in m)
    usec = int(reloading.split("MONOTONIC_USEC=")[1].split()[0])
    assert abs(usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 30
    after = seen.index(reloading)
    notify_messages(notify_socket, lambda s: any("READY=1" in m for m in s[after:]), 30, seen)
    daemon.process.send_signal(signal.SIGTERM)
    notify_messages(notify_socket, lambda s: any("STOPPING=1" in m for m in s), 30, seen)
    assert daemon.process.wait(60) == 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("drop_in", [None, "cpu-latency.conf"])
def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path, drop_in: str | None) -> None:
    """systemd-analyze verify accepts the shipped unit, alone and with the shipped drop-in."""
    unit = (ROOT / "systemd" / "infervisor.service").read_text()
    unit = unit.replace("/opt/infervisor/.venv/bin/infervisor", shutil.which("true") or "/bin/true")
    path = tmp_path / "infervisor.service"
    path.write_text(unit)
    if drop_in is not None:
        (tmp_path / "infervisor.service.d").mkdir()
        shutil.copy(ROOT / "systemd" / drop_in, tmp_path / "infervisor.service.d" / drop_in)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in result.stderr.splitlines() if "infervisor.service" in line]
    assert result.returncode == 0 and not problems, result.stderr


def test_drain_first_rollout_replaces_the_only_worker_without_failing_requests(
    start_daemon: Callable[..., Daemon],
) -> None:
    """With rollout "drain_first" the old worker exits before its replacement starts; requests wait, none fail."""
    config = {"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, rollout="drain_first")}}
    daemon = start_daemon(config)
    pid = daemon.wait_ready()["models"]["tiny"]["workers"][0]["pid"]
    with Load(daemon, "tiny", {"x": np.ones((1, 16), np.float32)}, clients=2) as load:
        wait_for(lambda: load.ok > 20, 30, "load running")
        assert daemon.control({"cmd": "restart"})["queued"] == 1
        wait_for(lambda: daemon.status()["rollout"]["completed"] == 1, 60, "drain-first step done")
        wait_for(lambda: _pool(daemon, "tiny")[0]["state"] == "serving", 120, "replacement serving")
        served = load.ok
        wait_for(lambda: load.ok > served + 20, 30, "serving again")
    assert _pool(daemon, "tiny")[0]["pid"] != pid
    assert load.failures == []
    starts = [e for e in daemon.log_events() if e["event"] == "rollout_step_started"]
    assert starts and starts[0]["strategy"] == "drain_first"


def test_switching_the_profile_chain_rolls_the_model_with_no_failed_request(
    start_daemon: Callable[..., Daemon], built_tiny_aoti: Path, tmp_path: Path
) -> None:
    """Editing profiles from eager to [aoti, eager] under load replaces the worker; it serves aoti; nothing fails."""
    # The package is in the cache already: the subject is the switch (a build under load is test_serve_first's).
    cache = shutil.copytree(built_tiny_aoti, tmp_path / "cache", symlinks=True)
    config = {"cache_dir": str(cache), "models": {"tiny": model_entry({"builtin": "tiny"}, STATIC_TINY_INPUTS)}}
    daemon = start_daemon(config)
    (old,) = daemon.wait_ready()["models"]["tiny"]["workers"]
    assert old["profile"] == "eager"
    x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
    with Load(daemon, "tiny", {"x": x}, clients=2) as load:
        config["models"]["tiny"]["profiles"] = ["aoti", "eager"]
        daemon.write_config(config)

        def serving_aoti() -> bool:
            pool = [w for w in _pool(daemon, "tiny") if w["state"] == "serving"]
            return bool(pool) and all(w["profile"] == "aoti" and w["pid"] != old["pid"] for w in pool)

        wait_for(serving_aoti, 180, "the aoti worker serving")
        served_before_end = load.ok
        wait_for(lambda: load.ok > served_before_end + 20, 60, "requests served by the aoti worker")
    assert load.failures == [] and load.ok > 0
    (new,) = _pool(daemon, "tiny")
    assert any(n.startswith("loaded cached package aoti-") for n in new["profile_build"]), new
