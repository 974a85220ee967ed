"""What a worker starts goes with it: orphans stay in its tree while it lives, and it ends them when it exits.

A model's forward may start processes of its own, in their own session (setsid) or daemonised by a
double fork, which a process group would not catch. As a child subreaper the worker adopts every
orphan of its tree instead of init, so its descendants are always its children's children; at exit
it kills them. The supervisor does the same when it kills the worker (infervisor/supervisor/workers/process_tree.py).
An adopted orphan that exits stays a zombie until the worker exits: the worker never calls wait(-1),
which would take the exit status of a child some library (inductor's compile pool) waits for.
"""

from __future__ import annotations

import ctypes
import os

import psutil
import structlog

log = structlog.get_logger("worker")

_PR_SET_CHILD_SUBREAPER = 36


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
