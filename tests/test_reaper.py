"""The one reaper: every child's end noticed in one step, handed to its owner once, its process group gone first."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from infervisor.supervisor.workers.child_record import ChildRecord
from infervisor.supervisor.workers.reaper import Reaper
from infervisor.supervisor.workers.retry_policy import ChildKind
from tests.conftest import wait_for


def _sleeper(seconds: float = 60.0) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)


def _reap_until(reaper: Reaper, count: int, ends: list[object]) -> None:
    wait_for(lambda: reaper.reap(time.monotonic()) >= 0 and len(ends) >= count, 20, f"{count} ends reaped")


def test_each_end_reaches_its_owner_once_and_a_live_child_is_left_alone() -> None:
    """Two of three children killed: each owner hears its own end once, with the signal; the third stays watched."""
    reaper = Reaper()
    children = [_sleeper() for _ in range(3)]
    ends: list[tuple[int, int]] = []
    try:
        for child in children:
            reaper.watch(child, lambda code, now, pid=child.pid: ends.append((pid, code)))
        for child in children[:2]:
            child.kill()
        _reap_until(reaper, 2, ends)
        for _ in range(3):
            reaper.reap(time.monotonic())
        assert sorted(ends) == sorted((c.pid, -signal.SIGKILL) for c in children[:2])
        assert reaper.watches(children[2]) and not reaper.watches(children[0]) and children[2].poll() is None
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_what_an_ended_child_left_in_its_process_group_is_killed_before_its_end_is_handed_on() -> None:
    """A child that exits leaving a process in its group (a compiler it started): that process is killed at the reap."""
    script = "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); sys.exit(3)"
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)
    assert child.stdout is not None
    left = psutil.Process(int(child.stdout.readline()))
    reaper = Reaper()
    ends: list[int] = []
    reaper.watch(child, lambda code, now: ends.append(code))
    try:
        _reap_until(reaper, 1, ends)
        assert ends == [3]
        left.wait(10)  # killed by the reap; a still-running sleep would time out here
    finally:
        if left.is_running():
            left.kill()
        child.stdout.close()


def test_a_child_record_keeps_the_end_of_the_process_it_holds_only() -> None:
    """A record that moved to a new process ignores the old one's end, and takes the new one's."""
    reaper = Reaper()
    record = ChildRecord(ChildKind.AUDIT, "m")
    old, new = _sleeper(), _sleeper()
    try:
        record.adopt(old, None, "m.audit.1", (0,), time.monotonic())
        reaper.watch(old, lambda code, now: record.reaped(old, code))
        record.adopt(new, None, "m.audit.2", (0,), time.monotonic())
        reaper.watch(new, lambda code, now: record.reaped(new, code))
        old.kill()
        wait_for(lambda: reaper.reap(time.monotonic()) == 1 or not reaper.watches(old), 20, "the old process reaped")
        assert record.exit_code is None and record.running and record.starts == 2
        new.kill()
        wait_for(lambda: reaper.reap(time.monotonic()) >= 0 and record.exit_code is not None, 20, "the new one reaped")
        assert record.exit_code == -signal.SIGKILL and record.pid == new.pid
        record.ended("killed by SIGKILL", 2.0, 1, 100.0)
        assert record.process is None and record.ends == 1 and record.next_start == 102.0
        assert record.report(101.0) == {"pid": None, "restarts": 1, "last_exit": "killed by SIGKILL",
                                        "next_start_in_s": 1.0}  # fmt: skip
    finally:
        for child in (old, new):
            child.kill()
            child.wait()
