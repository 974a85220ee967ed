"""A worker's whole process tree: found while the worker lives, killed with it.

Processes a model starts may leave the worker's process group and session (setsid), so neither a
group kill nor the session catches them. The worker is a child subreaper (infervisor/worker/process_tree.py),
so while it lives every such process stays below it in the tree: the supervisor walks that tree
when it kills a worker, and keeps the last walk of each worker so that what a crashed worker
left behind is killed when its exit is reaped.
"""

from __future__ import annotations

import os

import psutil
import structlog

log = structlog.get_logger("supervisor")


def own_child(pid: int) -> psutil.Process | None:
    """The process `pid` if it is a child of this one (a worker just started), else None: never walk another tree."""
    try:
        process = psutil.Process(pid)
        return process if process.ppid() == os.getpid() else None
    except psutil.Error:
        return None


def descendants_of(process: psutil.Process | None) -> list[psutil.Process]:
    """Every live process below `process` (empty when it is gone, or was never ours)."""
    if process is None:
        return []
    try:
        # psutil checks the start time as well as the pid: a pid reused since is not walked.
        return list(process.children(recursive=True))
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
