"""Pinning of real workers, graceful and bounded stop, and no orphans when the supervisor is killed."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.supervisor.host.topology import parse_cpu_list
from tests.conftest import TINY_INPUTS, Daemon, model_entry, wait_for
from tests.slow_model import SLOW_INPUTS, rounds, write_slow_model


def _proc_field(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(key)


def _gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cpus")
def test_workers_are_pinned_to_disjoint_cores_with_matching_threads(start_daemon: Callable[..., Daemon]) -> None:
    """Each worker is pinned to its planned cores, the sets are disjoint, and torch uses that many threads."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, workers=2)}})
    status = daemon.wait_ready()
    seen: list[set[int]] = []
    for worker in status["models"]["tiny"]["workers"]:
        allowed = set(parse_cpu_list(_proc_field(worker["pid"], "Cpus_allowed_list")))
        assert allowed == set(worker["cores"])
        assert worker["threads"] == len(allowed)  # torch.get_num_threads() in the worker
        if status["template"]["state"] != "warm":
            # An exec'd worker's pools read its environment; a fork of the template (whose /proc environ is the
            # template's) sets them with torch.set_num_threads, which the figure above reads back.
            environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={len(allowed)}".encode() in environ
        seen.append(allowed)
    assert not seen[0] & seen[1]


def test_sigterm_finishes_in_flight_work_refuses_new_and_exits_zero(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """On SIGTERM the running request still gets its result, new ones get SHUTTING_DOWN, and no worker is left."""
    path = write_slow_model(tmp_path)
    # Grace and hang budget far above the burn's seconds, so a busy box cannot turn "finishes" into "cut off".
    config = {"shutdown_grace_s": 300, "hang_min_s": 300,
              "models": {"slow": model_entry({"torchscript": str(path)}, SLOW_INPUTS)}}  # fmt: skip
    daemon = start_daemon(config)
    daemon.wait_ready()
    pids = daemon.worker_pids()
    with ThreadPoolExecutor(1) as pool, daemon.client() as client:
        running = pool.submit(lambda: daemon.client().infer("slow", rounds(4000), timeout=60))
        wait_for(lambda: daemon.status()["models"]["slow"]["workers"][0]["busy"], 30, "worker busy")
        daemon.process.send_signal(signal.SIGTERM)
        wait_for(lambda: daemon.status()["state"] == "stopping", 30, "daemon stopping")
        with pytest.raises(InferenceError) as caught:
            client.infer("slow", rounds(1), timeout=30)
        assert caught.value.code == ErrorCode.SHUTTING_DOWN
        assert running.result()["output"].shape == (1, 1)
    assert daemon.process.wait(60) == 0
    wait_for(lambda: _gone(pids), 10, "workers gone")


def test_grace_period_bounds_the_stop(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """A request longer than the grace period is answered SHUTTING_DOWN and the daemon still exits 0 promptly."""
    path = write_slow_model(tmp_path)
    config = {"shutdown_grace_s": 0.5, "models": {"slow": model_entry({"torchscript": str(path)}, SLOW_INPUTS)}}
    daemon = start_daemon(config)
    daemon.wait_ready()
    pids = daemon.worker_pids()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: daemon.client().infer("slow", rounds(200_000), timeout=120))
        wait_for(lambda: daemon.status()["models"]["slow"]["workers"][0]["busy"], 30, "worker busy")
        daemon.process.send_signal(signal.SIGTERM)
        with pytest.raises(InferenceError) as caught:
            running.result()
        assert caught.value.code == ErrorCode.SHUTTING_DOWN
    assert daemon.process.wait(30) == 0
    wait_for(lambda: _gone(pids), 10, "workers gone")
    events = [e["event"] for e in daemon.log_events()]
    assert "grace_expired" in events and "supervisor_exit" in events


def test_workers_die_with_a_killed_supervisor(start_daemon: Callable[..., Daemon]) -> None:
    """kill -9 of the supervisor leaves no worker behind (PR_SET_PDEATHSIG)."""
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    pids = daemon.worker_pids()
    assert pids
    daemon.process.kill()
    daemon.process.wait(10)
    wait_for(lambda: _gone(pids), 10, "workers gone after kill -9 of the supervisor")
