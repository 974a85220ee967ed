"""What a worker starts goes with it: orphans stay in its tree while it lives, and it ends them when it exits.

A model's forward may start processes of its own, in their own session (setsid) or daemonised by a
double fork, which a process group would not catch. As a child subreaper the worker adopts every
orphan of its tree instead of init, so its descendants are always its children's children; at exit
it kills them. The supervisor does the same when it kills the worker (infervisor/supervisor/workers/process_tree.py).
An adopted orphan that exits stays a zombie until the worker exits: the worker never calls wait(-1),
which would take the exit status of a child some library (inductor's compile pool) waits for.
"""

from __future__ import annotations

import collections
import ctypes
import os
import select
import signal
import threading
import time

import psutil
import structlog

log = structlog.get_logger("worker")

_PR_SET_CHILD_SUBREAPER = 36
#: Without pidfd_open (Linux < 5.3), how often the guard asks whether the supervisor is still the parent.
_PARENT_POLL_S = 0.5
#: Signals taken by the guard's handler, for the record only: the guard thread acts on the parent's death.
signals_seen: collections.deque[int] = collections.deque(maxlen=8)


def become_subreaper() -> None:
    """Orphaned descendants of this process are re-parented to it, not to init (Linux 3.4+)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("subreaper_refused", errno=ctypes.get_errno())


def _parent(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


def end_descendants() -> int:
    """SIGKILL every process below this one and reap its children; returns how many were killed."""
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for process in descendants:
        try:
            process.kill()
        except psutil.Error:
            continue
    # Only our own children are waited for (psutil polls others until they vanish, and a killed grandchild re-parented
    # to us stays a zombie until we exit, when init reaps it).
    mine = os.getpid()
    psutil.wait_procs([p for p in descendants if _parent(p) == mine], timeout=2.0)
    if descendants:
        log.info("descendants_killed", pids=[p.pid for p in descendants])
    return len(descendants)


def _queue_signal(signum: int, frame: object) -> None:
    signals_seen.append(signum)


def _wait_for_parent_death(supervisor_pid: int, pidfd: int | None) -> None:
    if pidfd is not None:
        waiter = select.poll()  # not select(): it refuses a descriptor numbered past 1023
        waiter.register(pidfd, select.POLLIN)
        while not waiter.poll():  # readable once the process has exited; the GIL is released meanwhile
            continue
        return
    while os.getppid() == supervisor_pid:
        time.sleep(_PARENT_POLL_S)


def _end_tree_when_parent_dies(supervisor_pid: int, pidfd: int | None) -> None:
    _wait_for_parent_death(supervisor_pid, pidfd)
    try:
        end_descendants()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def guard_tree(supervisor_pid: int | None, parent_death_signal: int) -> None:
    """When the supervisor dies (kill -9 included), end everything below this worker, then the worker.

    A thread waits on a pidfd of the supervisor (on Linux < 5.3, polls the parent pid). The kernel's
    parent-death signal, which would end the worker at once and leave its model's processes to init,
    is taken by a handler from now on. Call it before the model can start anything.
    """
    if supervisor_pid is None:
        return
    try:
        pidfd: int | None = os.pidfd_open(supervisor_pid)
    except (AttributeError, OSError):
        pidfd = None
    if os.getppid() != supervisor_pid:  # died before the pidfd was opened: the pid may be another process's now
        if pidfd is not None:
            os.close(pidfd)
        pidfd = None
    watcher = threading.Thread(
        target=_end_tree_when_parent_dies, args=(supervisor_pid, pidfd), name="parent-death-guard", daemon=True
    )
    watcher.start()
    signal.signal(parent_death_signal, _queue_signal)
