"""The supervisor keeps off the workers' cores when a core is spare, and follows reloads that change that."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infervisor.supervisor.host.affinity import supervisor_cpus
from infervisor.supervisor.host.topology import parse_cpu_list
from tests.conftest import TINY_INPUTS, Daemon, model_entry, wait_for

ALLOWED = frozenset(os.sched_getaffinity(0))


def _thread_cpus(pid: int) -> list[frozenset[int]]:
    """The Cpus_allowed_list of every thread of a process."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:
            continue  # a thread that ended after the listing (the daemon starts short-lived ones)
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.append(frozenset(parse_cpu_list(line.split(":", 1)[1].strip())))
    return found


def test_spare_cpus_are_the_allowed_ones_no_worker_holds() -> None:
    """Spare cpus win; with none spare, or pinning off, the supervisor keeps every allowed cpu."""
    allowed = frozenset({0, 1, 2, 3})
    assert supervisor_cpus(allowed, [(0,), (1, 2)], pin=True) == {3}
    assert supervisor_cpus(allowed, [(0, 1), (2, 3)], pin=True) == allowed
    assert supervisor_cpus(allowed, [(0,)], pin=False) == allowed
    assert supervisor_cpus(allowed, [], pin=True) == allowed
    # A worker planned outside our cpuset (it cannot be, but the answer stays inside the set).
    assert supervisor_cpus(frozenset({4, 5}), [(0,)], pin=True) == {4, 5}


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cpus")
def test_supervisor_threads_leave_the_worker_core_and_return_when_it_is_needed(
    start_daemon: Callable[..., Daemon],
) -> None:
    """One worker: every supervisor thread runs on the other cpus; pinning off, or a worker per cpu, undoes it."""
    # use_smt: on a box with SMT siblings a worker per allowed cpu must be plannable too.
    config: dict[str, Any] = {"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS, use_smt=True)}}
    daemon = start_daemon(config)
    status = daemon.wait_ready()
    worker_cores = frozenset(status["models"]["tiny"]["workers"][0]["cores"])
    spare = ALLOWED - worker_cores
    pid = daemon.process.pid

    wait_for(lambda: set(_thread_cpus(pid)) == {spare}, 30, "supervisor threads on the spare cpus")
    assert daemon.status()["cpus"] == sorted(spare)
    moves = [e for e in daemon.log_events() if e.get("event") == "supervisor_cpus"]
    assert moves and moves[-1]["cpus"] == sorted(spare) and moves[-1]["spare"] is True
    with daemon.client() as client:  # serving from the spare cpus works as before
        assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)

    config["pin_supervisor"] = False
    daemon.write_config(config)
    wait_for(lambda: set(_thread_cpus(pid)) == {ALLOWED}, 30, "pinning turned off live")
    assert daemon.status()["models"]["tiny"]["workers"][0]["pid"] == status["models"]["tiny"]["workers"][0]["pid"]

    config["pin_supervisor"] = True
    config["models"]["tiny"]["workers"] = len(ALLOWED)
    daemon.write_config(config)
    wait_for(lambda: len(daemon.status()["models"]["tiny"]["workers"]) == len(ALLOWED), 60, "scaled to every cpu")
    wait_for(lambda: set(_thread_cpus(pid)) == {ALLOWED}, 30, "no spare cpu: the supervisor floats")
    assert daemon.status()["cpus"] == sorted(ALLOWED)
