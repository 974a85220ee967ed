"""The background builder and the compilers it starts run at the lowest CPU priority, for real (SCHED_IDLE)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Daemon
from tests.held_compile import end_held_compiles, start_held_compile

pytestmark = pytest.mark.daemon


def test_the_builder_and_its_compilers_are_sched_idle_while_serving_workers_are_not(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """A real background build of aoti on tiny, held while g++ compiles (its cc1plus reads a FIFO nobody writes):
    the builder and every g++ and cc1plus under it are SCHED_IDLE (inherited across fork and exec), the serving
    worker is SCHED_OTHER, so a build only takes CPU time serving leaves idle."""
    daemon, builder, compilers = start_held_compile(start_daemon, tmp_path)
    try:
        worker = daemon.status()["models"]["t"]["workers"][0]["pid"]
        assert os.sched_getscheduler(worker) == os.SCHED_OTHER
        assert os.sched_getscheduler(builder) == os.SCHED_IDLE
        assert {p.name(): os.sched_getscheduler(p.pid) for p in compilers} == dict.fromkeys(
            (p.name() for p in compilers), os.SCHED_IDLE
        )
    finally:  # the held compile ends with its builder (its process group)
        os.kill(builder, signal.SIGKILL)
        end_held_compiles(tmp_path)
