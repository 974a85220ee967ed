"""Containment: a bad reload, a model that cannot load or a failed rollout stays inside its own model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from protocol import ErrorCode, InferenceError
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, notify_messages, wait_for
from tests.fault_models import ECHO, FAULT_INPUTS, command

FAULTY = {"python": "tests.fault_models:faulty"}
BROKEN = {"python": "tests.fault_models:broken"}
WIDE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 3]}]
ENV = {"PYTHONPATH": str(ROOT)}


def _cli(daemon: Daemon, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args, "--runtime-dir", str(daemon.runtime_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


class Load:
    """A client thread sending requests of one shape until stopped, keeping every error it gets."""

    def __init__(self, daemon: Daemon, model: str, inputs: dict[str, np.ndarray], timeout: float = 60) -> None:
        self.daemon, self.model, self.inputs, self.timeout = daemon, model, inputs, timeout
        self.done = threading.Event()
        self.answered = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        with self.daemon.client() as client:
            while not self.done.is_set():
                try:
                    client.infer(self.model, self.inputs, timeout=self.timeout)
                    self.answered += 1
                except InferenceError as exc:
                    self.errors.append(f"{exc.code}: {exc.message}")

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(120)


def _config_state(daemon: Daemon, model: str) -> dict[str, Any]:
    state: dict[str, Any] = daemon.status()["config"]["models"][model]
    return state


def test_a_reload_naming_an_unknown_builtin_or_module_is_refused_before_any_worker_starts(
    start_daemon: Callable[..., Daemon],
) -> None:
    """Misspelt built-ins and modules are caught by validation: `reload` exits 1 naming them, serving goes on."""
    config = {"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, rollout="drain_first")}}
    daemon = start_daemon(config, env=ENV)
    pid = daemon.wait_ready()["models"]["tiny"]["workers"][0]["pid"]
    refused = (({"builtin": "nosuch"}, "no built-in model 'nosuch'"), ({"python": "nosuchmod:f"}, "no module 'nosuchmod'"))
    for source, problem in refused:
        config["models"]["tiny"]["source"] = source
        daemon.write_config(config)
        result = _cli(daemon, "reload")
        assert result.returncode == 1, result
        assert problem in result.stderr
        assert any(problem in p for p in daemon.status()["config"]["last_error"])
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)
    assert daemon.status()["models"]["tiny"]["workers"][0]["pid"] == pid


def test_a_surge_replacement_that_cannot_load_is_rolled_back_and_the_old_spec_keeps_serving(
    start_daemon: Callable[..., Daemon],
) -> None:
    """A new source and shape whose worker fails: no old-shape request fails, reload exits 1, admission stays old."""
    config = {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS)}}
    daemon = start_daemon(config, env=ENV)
    pid = daemon.wait_ready()["models"]["faulty"]["workers"][0]["pid"]
    with Load(daemon, "faulty", command(ECHO, 1.0)) as load:
        wait_for(lambda: load.answered > 5, 30, "load running")
        config["models"]["faulty"] = model_entry(BROKEN, WIDE_INPUTS)
        daemon.write_config(config)
        result = _cli(daemon, "reload")
        wait_for(lambda: load.answered > 20, 30, "load still running")
    assert result.returncode == 1, result
    assert "faulty: failed" in result.stderr
    assert load.errors == []
    assert _config_state(daemon, "faulty")["state"] == "failed"
    status = daemon.status()
    assert status["models"]["faulty"]["inputs"][0]["shape"] == [None, 2], "admission keeps the spec that serves"
    assert [w["pid"] for w in status["models"]["faulty"]["workers"] if "role" not in w] == [pid]
    with daemon.client() as client, pytest.raises(InferenceError) as caught:
        client.infer("faulty", {"x": np.zeros((1, 3), np.float32)}, timeout=30)
    assert caught.value.code == ErrorCode.INVALID_INPUT
    assert any(e["event"] == "model_config_rolled_back" for e in daemon.log_events())


def test_a_drain_first_replacement_that_cannot_load_is_rebuilt_from_the_serving_config(
    start_daemon: Callable[..., Daemon],
) -> None:
    """The only worker drains for a replacement that fails: the slot comes back on the old config and serves again."""
    config = {"models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, rollout="drain_first")}}
    daemon = start_daemon(config, env=ENV)
    daemon.wait_ready()
    config["models"]["faulty"]["source"] = BROKEN
    with Load(daemon, "faulty", command(ECHO, 2.0), timeout=120) as load:
        wait_for(lambda: load.answered > 5, 30, "load running")
        daemon.write_config(config)
        wait_for(lambda: _config_state(daemon, "faulty")["state"] == "failed", 120, "rollout rolled back")
        served = load.answered
        wait_for(lambda: load.answered > served + 5, 120, "serving again on the old config")
    assert load.errors == [], "requests wait out the gap and are served after the roll-back"
    assert daemon.process.poll() is None
    (worker,) = [w for w in daemon.status()["models"]["faulty"]["workers"] if "role" not in w]
    assert worker["state"] == "serving"


def test_a_new_input_shape_is_admitted_once_its_worker_serves_and_old_shapes_until_the_last_old_worker_goes(
    start_daemon: Callable[..., Daemon],
) -> None:
    """Two workers move from [N, 2] to [N, 3] one at a time: each shape goes to workers of its spec."""
    config = {"oversubscribe": True, "models": {"faulty": model_entry(FAULTY, FAULT_INPUTS, workers=2)}}
    daemon = start_daemon(config, env=ENV)
    daemon.wait_ready()
    config["models"]["faulty"]["inputs"] = WIDE_INPUTS
    with Load(daemon, "faulty", command(ECHO, 3.0)) as old:
        wait_for(lambda: old.answered > 5, 30, "old-shape load running")
        daemon.write_config(config)
        result = _cli(daemon, "reload")
    assert result.returncode == 0, result
    # Old-shape requests are served until the model serves the new spec only; after that they are refused.
    assert all(e.startswith("INVALID_INPUT") for e in old.errors), old.errors
    assert daemon.status()["models"]["faulty"]["inputs"][0]["shape"] == [None, 3]
    wide = np.array([[ECHO, 4.0, 0.0]], np.float32)
    with daemon.client() as client:
        assert client.infer("faulty", {"x": wide}, timeout=30)["output"][0, 1] == 4.0


def test_a_model_that_cannot_load_fails_alone_ready_is_sent_and_status_says_why(
    start_daemon: Callable[..., Daemon], notify_socket: socket.socket, tmp_path: Any
) -> None:
    """READY=1 with a STATUS= naming the failed model; the daemon stays up degraded and the other model serves."""
    config = {
        "max_restarts": 2,
        "oversubscribe": True,
        "models": {
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
            "broken": model_entry(BROKEN, FAULT_INPUTS),
        },
    }
    env = {**ENV, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    daemon = start_daemon(config, env=env)
    seen: list[str] = []
    notify_messages(notify_socket, lambda s: any("READY=1" in m for m in s), 120, seen)
    ready = next(m for m in seen if "READY=1" in m)
    assert "broken failed" in ready and "LOAD_FAILED" in ready
    status = daemon.status()
    assert status["state"] == "degraded"
    assert status["models"]["broken"]["health"] == "failed" and "LOAD_FAILED" in status["models"]["broken"]["reason"]
    assert status["models"]["tiny"]["health"] == "serving"
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)
        with pytest.raises(InferenceError) as caught:
            client.infer("broken", command(ECHO), timeout=10)
        assert caught.value.code == ErrorCode.UNAVAILABLE
    check = _cli(daemon, "status", "--check")
    assert check.returncode == 1 and "degraded" in check.stdout
    plain = _cli(daemon, "status")
    assert plain.returncode == 0 and "model broken failed" in plain.stdout
    assert daemon.process.poll() is None, "a failed model does not end the daemon while another serves"


def test_status_check_is_zero_when_every_model_serves_and_two_when_no_daemon_answers(
    start_daemon: Callable[..., Daemon],
) -> None:
    """The probe's exit codes: 0 ready, 2 once the daemon is gone."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    wait_for(lambda: _cli(daemon, "status", "--check").returncode == 0, 30, "check says ready")
    assert json.loads(_cli(daemon, "status", "--json").stdout)["state"] == "ready"
    daemon.stop()
    assert _cli(daemon, "status", "--check").returncode == 2
