"""Start-up safety: one daemon per runtime dir, no orphan worker when the supervisor dies starting, clear refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from infervisor.protocol.constants import CLIENT_SOCKET_NAME, CONTROL_SOCKET_NAME
from infervisor.protocol.control_client import ControlError, control_request
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for

#: Exit status of a refused start (infervisor/supervisor/commands/serve.py: EXIT_CONFIG).
EXIT_CONFIG = 78

TINY = {"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}

#: An environment variable every worker of a trial inherits, so its orphans can be found after the supervisor is gone.
TRIAL_MARK = "INFERVISOR_TEST_STARTUP_TRIAL"


def _serve(config_path: Path, runtime_dir: Path, timeout: float = 60.0) -> tuple[int, str]:
    """Run `infervisor serve` expecting it to exit by itself; its exit code and output."""
    process = subprocess.Popen(
        [sys.executable, "-m", "infervisor", "serve", "--config", str(config_path), "--runtime-dir", str(runtime_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"`serve` was still running after {timeout:.0f} s:\n{output[-3000:]}") from None
    return process.returncode, output


def _events(output: str, name: str) -> list[dict[str, Any]]:
    """The JSON log lines of `output` whose event is `name`."""
    found = []
    for line in output.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            found.append(event)
    return found


def _cli(*args: str) -> tuple[int, str]:
    """Run an `infervisor` command; its exit code and output."""
    done = subprocess.run(
        [sys.executable, "-m", "infervisor", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    return done.returncode, done.stdout + done.stderr


# ---- one daemon per runtime dir ----------------------------------------------------------------


def _who(status: dict[str, Any]) -> list[tuple[object, ...]]:
    """Which workers serve the tiny model: slot, pid, state and restarts."""
    return [(w["slot"], w["pid"], w["state"], w["restarts"]) for w in status["models"]["tiny"]["workers"]]


def test_a_second_daemon_on_the_same_runtime_dir_is_refused_and_the_first_serves_on(
    start_daemon: Callable[..., Daemon],
) -> None:
    """The second `serve` exits 78 naming the first one's pid, spawns nothing, and leaves the first reachable."""
    first = start_daemon(TINY)
    before = first.wait_ready()
    code, output = _serve(first.config_path, first.runtime_dir)
    assert code == EXIT_CONFIG, output[-3000:]
    (refusal,) = _events(output, "cannot_start")
    assert refusal["holder_pid"] == first.process.pid
    assert f"another infervisor (pid {first.process.pid}) is serving {first.runtime_dir}" in refusal["error"]
    assert not _events(output, "worker_state"), "the refused daemon started workers"
    # The first still owns both sockets: the same daemon answers status and serves a request.
    # The same workers (memory is read live, and moves as other processes map shared libraries).
    assert _who(first.status()) == _who(before)
    code, text = _cli("infer", "--runtime-dir", str(first.runtime_dir), "--model", "tiny", "--random")
    assert code == 0, text


def test_a_clean_stop_removes_the_socket_files(start_daemon: Callable[..., Daemon]) -> None:
    """After SIGTERM no infer.sock or control.sock is left, and status says at once that nothing runs."""
    daemon = start_daemon(TINY)
    daemon.wait_ready()
    assert (daemon.runtime_dir / CLIENT_SOCKET_NAME).exists()
    assert daemon.stop() == 0, daemon.log_text()[-3000:]
    assert not (daemon.runtime_dir / CLIENT_SOCKET_NAME).exists()
    assert not (daemon.runtime_dir / CONTROL_SOCKET_NAME).exists()
    code, text = _cli("status", "--runtime-dir", str(daemon.runtime_dir))
    assert code == 2 and "not running" in text, text


def test_status_and_infer_say_not_running_at_once_after_a_kill9_and_a_new_daemon_starts(
    start_daemon: Callable[..., Daemon],
) -> None:
    """Stale sockets of a killed daemon are refused connections: "not running" at once, not a 5 s timeout."""
    daemon = start_daemon(TINY)
    daemon.wait_ready()
    workers = daemon.worker_pids()
    daemon.process.kill()
    daemon.process.wait()
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in workers), 10, "workers gone with their supervisor")
    assert (daemon.runtime_dir / CONTROL_SOCKET_NAME).exists(), "kill -9 should have left the socket behind"
    started = time.monotonic()
    with pytest.raises(ControlError, match="not running"):
        control_request(daemon.runtime_dir, {"cmd": "status"})
    assert time.monotonic() - started < 1.0
    for command in (["status"], ["infer", "--model", "tiny", "--random"]):
        code, text = _cli(command[0], "--runtime-dir", str(daemon.runtime_dir), *command[1:])
        assert code == 2 and "not running" in text and "no answer" not in text, (command, text)
    # The kernel let go of the dead daemon's lock: a new one on the same runtime dir is not refused.
    again = Daemon(daemon.tmp, TINY)
    try:
        again.wait_ready()
    finally:
        assert again.stop() == 0, again.log_text()[-3000:]


# ---- the supervisor killed during start-up -----------------------------------------------------


def _marked(value: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose environment carries the trial's mark."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TRIAL_MARK) == value and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _a_worker_spawned(daemon: Daemon) -> bool:
    """A worker among the daemon's children (the warm template, started before any worker, is not one)."""
    for pid in daemon.worker_pids():
        try:
            if "infervisor.worker.template" not in " ".join(psutil.Process(pid).cmdline()):
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def test_kill9_of_the_supervisor_during_start_up_leaves_no_orphan_worker(
    start_daemon: Callable[..., Daemon],
) -> None:
    """20 kills at 0-100 ms after the first spawn: 2 s later no worker of any of them is alive."""
    config = {
        "oversubscribe": True,
        "models": {"slow": model_entry({"python": "tests.startup_models:slow_to_load"}, TINY_INPUTS, workers=2)},
    }
    trials = 20
    orphaned: list[tuple[float, int]] = []
    for trial in range(trials):
        delay = 0.1 * trial / (trials - 1)
        tag = f"{os.getpid()}-{trial}"
        daemon = start_daemon(config, env={TRIAL_MARK: tag})
        wait_for(
            lambda daemon=daemon: _a_worker_spawned(daemon) or daemon.process.poll() is not None,
            60,
            "the first worker spawned",
            interval=0.001,
        )
        assert daemon.process.poll() is None, daemon.log_text()[-3000:]
        time.sleep(delay)  # the experiment's variable: how far into the worker's start-up the kill lands
        daemon.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        daemon.process.wait()
        candidates = _marked(tag)
        alive = candidates
        while alive and time.monotonic() - killed_at < 2.0:
            time.sleep(0.02)
            alive = [p for p in candidates if _alive(p)]
        if alive:
            orphaned.append((round(delay * 1000), len(alive)))
            for process in alive:
                process.kill()
    assert not orphaned, f"{len(orphaned)} of {trials} kills left orphans 2 s later (delay ms, count): {orphaned}"


# ---- a runtime dir that cannot be one ----------------------------------------------------------


def test_a_runtime_dir_that_is_a_regular_file_is_a_refusal_not_a_traceback(tmp_path: Path) -> None:
    """`--runtime-dir` naming a file exits 78 with a cannot_start event that says so."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"cache_dir": str(tmp_path / "cache"), **TINY}))
    not_a_dir = tmp_path / "run"
    not_a_dir.write_text("")
    code, output = _serve(config, not_a_dir)
    assert code == EXIT_CONFIG, output[-3000:]
    assert "Traceback" not in output
    (refusal,) = _events(output, "cannot_start")
    assert refusal["error"] == f"runtime dir {not_a_dir} is a regular file, not a directory"
