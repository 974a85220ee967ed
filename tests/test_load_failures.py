"""Load failures explained in status and metrics, failed models waiting for a fixed config, worker trees cleaned up,
hang kills counted: all with a real daemon and real workers."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.models import build_builtin
from infervisor.worker.runner import ModelRunner
from infervisor.worker.start import attempt_log, build_context
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, notify_messages, wait_for
from tests.fault_models import FAULT_INPUTS
from tests.tree_models import ECHO, SLEEP, SPAWN, TREE_INPUTS, command

ENV = {"PYTHONPATH": str(ROOT)}
BROKEN = {"python": "tests.fault_models:broken"}
SPAWNER = {"python": "tests.tree_models:spawner"}


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infervisor", *args, "--runtime-dir", str(daemon.runtime_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _dead(pid: int) -> bool:
    """No process `pid`, or a zombie, as the kernel says now (/proc, no cached psutil state)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _serving_pid(daemon: Daemon, model: str) -> int | None:
    workers = daemon.status()["models"][model]["workers"]
    return next((w["pid"] for w in workers if w["state"] == "serving" and not w.get("role")), None)


def test_a_factory_that_raises_is_explained_in_status_and_a_fixed_config_serves_without_a_restart(
    start_daemon: Callable[..., Daemon], notify_socket: socket.socket, tmp_path: Path
) -> None:
    """The factory's own error reaches status, plain status and metrics within a minute; the same error twice is
    not retried as a crash loop; the daemon stays up `down` (--check exits 2) and a fixed config.json serves."""
    config = {"max_restarts": 5, "models": {"m": model_entry(BROKEN, FAULT_INPUTS)}}
    daemon = start_daemon(config, env={**ENV, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")})

    def failed() -> bool:
        status = daemon.try_status()
        return status is not None and status["models"]["m"]["health"] == "failed"

    wait_for(failed, 60, "the model failed")
    status = daemon.status()
    assert status["state"] == "down"
    model = status["models"]["m"]
    assert "weights.bin not found" in model["error"]
    assert "weights.bin not found" in model["reason"]
    assert "weights.bin not found" in model["workers"][0]["load_error"]
    starts = [e for e in daemon.log_events() if e["event"] == "worker_state" and e["new"] == "starting"]
    assert len(starts) == 2, "the same load error twice fails the slot: no crash loop up to max_restarts"
    plain = _cli(daemon, "status")
    assert plain.returncode == 0 and "weights.bin not found" in plain.stdout
    check = _cli(daemon, "status", "--check")
    assert check.returncode == 2 and "down" in check.stdout
    metrics = daemon.control({"cmd": "metrics"})["text"]
    assert 'infervisor_model_load_error_info{error="FileNotFoundError: weights.bin not found' in metrics or (
        "infervisor_model_load_error_info" in metrics and "weights.bin not found" in metrics
    )
    assert 'infervisor_worker_load_failures_total{model="m"} 2.0' in metrics
    assert daemon.process.poll() is None, "a daemon whose models all failed stays up for a fixed config"
    seen = notify_messages(notify_socket, lambda s: any("READY=1" in m for m in s), 30, [])
    assert "weights.bin not found" in next(m for m in seen if "READY=1" in m), "systemd's STATUS= says why"

    config["models"]["m"] = model_entry({"python": "tests.fault_models:faulty"}, FAULT_INPUTS)
    daemon.write_config(config)
    daemon.wait_ready(120)
    with daemon.client() as client:
        assert client.infer("m", {"x": np.array([[0.0, 3.0]], np.float32)}, timeout=30)["output"][0, 1] == 3.0
    status = daemon.status()
    assert status["state"] == "ready" and status["models"]["m"]["error"] is None


def test_a_reload_whose_replacement_cannot_load_shows_its_error(start_daemon: Callable[..., Daemon]) -> None:
    """The old worker keeps serving and status names the replacement's own error, not only its exit code."""
    config = {"models": {"m": model_entry({"python": "tests.fault_models:faulty"}, FAULT_INPUTS)}}
    daemon = start_daemon(config, env=ENV)
    pid = daemon.wait_ready()["models"]["m"]["workers"][0]["pid"]
    config["models"]["m"] = model_entry(BROKEN, FAULT_INPUTS)
    daemon.write_config(config)
    wait_for(lambda: daemon.status()["models"]["m"]["error"], 120, "the replacement's error in status")
    status = daemon.status()
    assert "weights.bin not found" in status["models"]["m"]["error"]
    assert status["models"]["m"]["workers"][0]["pid"] == pid and status["models"]["m"]["health"] == "serving"
    assert "weights.bin not found" in _cli(daemon, "status").stdout


def test_what_a_forward_starts_goes_with_its_worker_and_with_the_daemon(start_daemon: Callable[..., Daemon]) -> None:
    """A setsid child and a daemonised grandchild of a worker are gone after a recycle, a hang kill and a stop."""
    config = {"hang_min_s": 1.0, "models": {"m": model_entry(SPAWNER, TREE_INPUTS)}}
    daemon = start_daemon(config, env=ENV)
    first = daemon.wait_ready()["models"]["m"]["workers"][0]["pid"]

    def spawn(client_daemon: Daemon) -> list[int]:
        with client_daemon.client() as client:
            pids = [int(p) for p in client.infer("m", command(SPAWN), timeout=60)["output"][0]]
        assert all(not _gone(p) for p in pids)
        return pids

    recycled = spawn(daemon)
    assert daemon.control({"cmd": "restart", "model": "m"})["ok"]
    wait_for(lambda: _serving_pid(daemon, "m") not in (None, first), 120, "the recycled worker replaced")
    wait_for(lambda: all(_gone(p) for p in recycled), 15, f"processes {recycled} gone with the recycled worker")

    killed = spawn(daemon)
    second = _serving_pid(daemon, "m")
    with daemon.client() as client, pytest.raises(InferenceError) as caught:
        client.infer("m", command(SLEEP, 30.0), timeout=60)
    assert caught.value.code in (ErrorCode.WORKER_LOST, ErrorCode.INTERNAL)
    wait_for(lambda: _serving_pid(daemon, "m") not in (None, second), 120, "the hung worker replaced")
    wait_for(lambda: all(_gone(p) for p in killed), 15, f"processes {killed} gone with the killed worker")

    stopped = spawn(daemon)
    daemon.stop()
    wait_for(lambda: all(_gone(p) for p in stopped), 15, f"processes {stopped} gone with the daemon")


def test_two_hang_kills_within_the_window_fail_the_slot(start_daemon: Callable[..., Daemon]) -> None:
    """With max_restarts 2, a hung worker is a crash: the second hang kill in the window fails the slot."""
    config = {
        "max_restarts": 2,
        "hang_min_s": 1.0,
        "models": {"m": model_entry(SPAWNER, TREE_INPUTS, max_retries=0)},
    }
    daemon = start_daemon(config, env=ENV)
    daemon.wait_ready()
    for _ in range(2):
        wait_for(lambda: _serving_pid(daemon, "m"), 120, "a serving worker")
        with daemon.client() as client, pytest.raises(InferenceError):
            client.infer("m", command(SLEEP, 30.0), timeout=60)
        wait_for(lambda: daemon.status()["models"]["m"]["workers"][0]["state"] != "serving", 30, "the kill")
    wait_for(lambda: daemon.status()["models"]["m"]["workers"][0]["state"] == "failed", 30, "the slot failed")
    with daemon.client() as client, pytest.raises(InferenceError) as caught:
        client.infer("m", command(ECHO), timeout=30)
    assert caught.value.code == ErrorCode.UNAVAILABLE


def test_a_crash_record_is_keyed_on_what_can_crash_not_on_the_validation_set(tmp_path: Path) -> None:
    """Adding a validation set keeps a profile's crash record (same stem); another input spec does not."""
    module = build_builtin("tiny")

    def stems(
        validation: str | None, specs: tuple[TensorSpec, ...] = (TensorSpec("x", "float32", (None, 16)),)
    ) -> dict[str, str]:
        runner = ModelRunner(module, specs, ("y",))
        launch = LaunchSpec(
            "t", "tiny", -1, ModelSource("builtin", "tiny"), specs, ("y",), (0,), 1,
            profiles=("jit", "eager"), cache_dir=str(tmp_path), validation=validation,
        )  # fmt: skip
        return attempt_log(launch, build_context(launch, runner)).stems

    assert stems(None) == stems(str(tmp_path / "validation.npz"))
    assert stems(None) != stems(None, (TensorSpec("x", "float32", (1, 16)),))


def test_the_profile_command_does_not_get_its_worker_killed_as_hung(start_daemon: Callable[..., Daemon]) -> None:
    """torch.profiler takes seconds to start: under a short hang_min_s and heartbeat limit the worker profiles and
    serves on (it was killed as hung, losing the profile)."""
    config = {
        "hang_min_s": 0.5,
        "heartbeat_interval_ms": 100,
        "heartbeat_liveness": 5,
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)},
    }
    daemon = start_daemon(config)
    pid = daemon.wait_ready()["models"]["tiny"]["workers"][0]["pid"]
    assert daemon.control({"cmd": "profile", "model": "tiny", "requests": 2})["ok"]
    with daemon.client() as client:
        for _ in range(2):
            assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)}, timeout=30)["y"].shape == (1, 16)
    worker = wait_for(
        lambda: (w := daemon.status()["models"]["tiny"]["workers"][0])["last_profile"] and w, 60, "the profile report"
    )
    assert worker["pid"] == pid and worker["last_profile"]["requests"] == 2
    assert not [e for e in daemon.log_events() if e["event"] == "worker_killed"]


def test_a_skip_reason_holding_a_semicolon_is_one_item_of_status(start_daemon: Callable[..., Daemon]) -> None:
    """`profile_skipped` keeps a reason whole, whatever punctuation it holds (it was split on "; ")."""
    config = {
        "models": {
            "m": model_entry({"python": "tests.tree_models:untraceable"}, TREE_INPUTS, profiles=["jit", "eager"])
        }
    }
    daemon = start_daemon(config, env=ENV)
    worker = daemon.wait_ready()["models"]["m"]["workers"][0]
    assert worker["profile"] == "eager"
    (skipped,) = worker["profile_skipped"]
    assert skipped.startswith("jit") and "cannot be traced; serve it with eager, or script it first" in skipped


def test_what_a_forward_starts_dies_within_seconds_of_a_kill_9_of_the_supervisor(
    start_daemon: Callable[..., Daemon],
) -> None:
    """kill -9 of the supervisor: the worker, its setsid child and its daemonised grandchild are all gone within 5 s."""
    daemon = start_daemon({"models": {"m": model_entry(SPAWNER, TREE_INPUTS)}}, env=ENV)
    worker = daemon.wait_ready()["models"]["m"]["workers"][0]["pid"]
    with daemon.client() as client:
        spawned = [int(p) for p in client.infer("m", command(SPAWN), timeout=60)["output"][0]]
    assert not any(_gone(p) for p in [worker, *spawned])
    daemon.process.kill()
    daemon.process.wait(10)
    tree = [worker, *spawned]
    try:
        wait_for(lambda: all(_dead(p) for p in tree), 5, f"the worker and what its model started ({tree}) gone")
    finally:
        for pid in tree:  # never leave sleepers behind a failed run
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
