"""A worker's whole process tree: found while the worker lives, killed with it.

Every worker process (a serving worker, a background builder, an audit process) leads a session and a
process group of its own (the launcher's `start_new_session`). What it starts stays in that group unless it
calls setsid: a compiler (g++ and its cc1plus, started by inductor through subprocess) does not. So when the
supervisor sees a worker exit it kills the worker's group before it reaps the worker: the unreaped zombie still
holds the group's id, which no other group can then have. That catches a compiler started a moment before a
kill -9, which no earlier walk of the tree could have seen, and it needs no cooperation from the compiler
(PR_SET_PDEATHSIG would reach only the worker's direct children: g++ dying leaves cc1plus running).

Processes a model starts may leave the group (setsid): the worker is a child subreaper
(infervisor/worker/process_tree.py), so while it lives every such process stays below it in the tree: the
supervisor walks that tree when it kills a worker, and keeps the last walk of each worker so that what a
crashed worker left behind is killed when its exit is reaped.
"""

from __future__ import annotations

import os
import signal

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


def _exited(pid: int) -> bool | None:
    """Whether our child `pid` has exited (without reaping it); None when it is no unreaped child of ours."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return None


def kill_group(leader: int) -> None:
    """SIGKILL the process group our child `leader` leads. Only an unreaped child is taken at its word: its pid, and
    so its group's id, cannot be another's then (a reaped one, or a pid that is not our child, is left alone)."""
    if _exited(leader) is None:
        return
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it, or a member that changed its credentials (it is walked and killed by pid)


def end_group_if_exited(pid: int) -> bool:
    """When our child `pid` has exited and is not reaped yet, kill what is left of its process group (a compiler
    it started); True then. Reaping stays the caller's (`poll()` next)."""
    if not _exited(pid):
        return False
    kill_group(pid)
    return True


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
