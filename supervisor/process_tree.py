"""A worker's whole process tree: found while the worker lives, killed with it.

Processes a model starts may leave the worker's process group and session (setsid), so neither a
group kill nor the session catches them. The worker is a child subreaper (worker/process_tree.py),
so while it lives every such process stays below it in the tree: the supervisor walks that tree
when it kills a worker, and keeps the last walk of each worker so that what a crashed worker
left behind is killed when its exit is reaped.
"""

from __future__ import annotations

import psutil
import structlog

log = structlog.get_logger("supervisor")


def descendants_of(pid: int) -> list[psutil.Process]:
    """Every live process below `pid` (empty when it is gone)."""
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def kill_all(processes: list[psutil.Process], owner: str) -> list[int]:
    """SIGKILL each process that is still the one seen (a reused pid is left alone); returns the pids killed."""
    killed: list[int] = []
    for process in processes:
        try:
            # psutil checks the process's start time too, so a pid taken by another process since is not signalled.
            if process.is_running():
                process.kill()
                killed.append(process.pid)
        except psutil.Error:
            continue
    if killed:
        log.warning("worker_descendants_killed", slot=owner, pids=killed)
    return killed
