"""The daemon holds the configured CPU latency request while serving, and lets go when told, throttled or gone."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs

from infervisor.supervisor.host.cpu_latency import DEVICE, CpuLatencyHold, current_limit
from tests.conftest import TINY_INPUTS, Daemon, model_entry, wait_for, write_thermal_sysfs

WRITABLE = DEVICE.exists() and os.access(DEVICE, os.W_OK)
needs_device = pytest.mark.skipif(not WRITABLE, reason="needs write access to /dev/cpu_dma_latency (root)")


def _holds_device(pid: int) -> bool:
    """Whether the process has /dev/cpu_dma_latency open, which is what keeps its request alive."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd) == str(DEVICE) for fd in fds.iterdir() if fd.is_symlink())


def test_a_refused_request_is_reported_once_and_not_retried(tmp_path: Path) -> None:
    """No device: the error is kept and warned once per configured value, through throttling; null clears it."""
    hold = CpuLatencyHold(tmp_path / "missing")
    with capture_logs() as logs:
        for throttled in (False, False, True, False):
            hold.reconcile(0, throttled)
        hold.reconcile(5, throttled=False)
    refused = [e for e in logs if e["event"] == "cpu_latency_refused"]
    assert [e["wanted_us"] for e in refused] == [0, 5]
    assert hold.held is None and hold.error is not None and "missing" in hold.error
    hold.reconcile(None, throttled=False)
    assert hold.status(None) == {"wanted_us": None, "held_us": None, "paused": False, "error": None}


@needs_device
def test_the_kernel_enforces_the_held_value_until_release() -> None:
    """Holding 7 µs lowers the kernel's limit to at most 7; a new value updates it; release restores it."""
    before = current_limit()
    hold = CpuLatencyHold()
    try:
        hold.reconcile(7, throttled=False)
        assert hold.held == 7 and current_limit() == min(before, 7)
        hold.reconcile(3, throttled=False)
        assert current_limit() == min(before, 3)
        assert _holds_device(os.getpid())
    finally:
        hold.release("test")
    assert current_limit() == before and not _holds_device(os.getpid())


@needs_device
def test_daemon_holds_the_request_and_releases_it_when_throttled_reloaded_or_stopped(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """cpu_latency_us 0: held while serving, released while throttling and back after; reloads and exit move it."""
    sysfs = tmp_path / "sys"
    write_thermal_sysfs(sysfs, 50.0, 0)
    config: dict[str, Any] = {
        "monitor_interval_s": 0.2,
        "thermal_sysfs_root": str(sysfs),
        "cpu_latency_us": 0,
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)},
    }
    daemon = start_daemon(config)
    daemon.wait_ready()
    pid = daemon.process.pid

    def held() -> Any:
        return daemon.status()["cpu_latency"]["held_us"]

    wait_for(lambda: held() == 0, 30, "request held")
    assert _holds_device(pid) and current_limit() == 0
    with daemon.client() as client:
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)

    write_thermal_sysfs(sysfs, 50.0, 4)  # new throttle events: polling idle would only add heat
    wait_for(lambda: held() is None, 30, "released while throttling")
    assert not _holds_device(pid) and daemon.status()["cpu_latency"]["paused"] is True
    wait_for(lambda: held() == 0, 30, "held again once the counter stops")

    config["cpu_latency_us"] = None
    daemon.write_config(config)
    wait_for(lambda: held() is None and daemon.status()["cpu_latency"]["wanted_us"] is None, 30, "reload to null")
    assert not _holds_device(pid)
    config["cpu_latency_us"] = 10
    daemon.write_config(config)
    wait_for(lambda: held() == 10, 30, "reload to 10 µs")

    events = [(e["event"], e.get("reason")) for e in daemon.log_events() if e["event"].startswith("cpu_latency")]
    assert events == [
        ("cpu_latency_held", "config"),
        ("cpu_latency_released", "thermal throttling"),
        ("cpu_latency_held", "config"),
        ("cpu_latency_released", "config"),
        ("cpu_latency_held", "config"),
    ]
    assert daemon.stop() == 0
    assert any(e["event"] == "cpu_latency_released" and e["reason"] == "exit" for e in daemon.log_events())
