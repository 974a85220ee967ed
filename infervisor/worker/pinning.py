"""Process set-up that must happen before torch is imported: affinity, thread env, parent-death signal."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
from collections.abc import Iterable

_PR_SET_PDEATHSIG = 1


def pin_before_torch(cpus: Iterable[int]) -> None:
    """Pin this process to `cpus` before torch starts its OpenMP pool (which inherits the mask)."""
    os.sched_setaffinity(0, set(cpus))


def limit_memory(megabytes: int | None) -> None:
    """Cap private writable memory (RLIMIT_DATA), so a runaway allocation fails inside torch with an
    error the worker answers, instead of waking the kernel's OOM killer on the whole box."""
    if megabytes is not None:
        limit = megabytes * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def lowest_priority() -> str:
    """Run at the lowest CPU priority (the background builder): SCHED_IDLE, else nice 19; says which it got.

    Every process it starts (the C++ compiler) inherits it, so a build only takes CPU time serving leaves idle.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        return "nice 19"


class ParentGone(Exception):
    """The supervisor died before the worker asked to die with it: the worker is already an orphan."""


#: Sent by the kernel to the worker when the supervisor dies (even by kill -9). Its default action ends
#: the worker while it starts; once the worker guards its process tree (worker/process_tree.py), a
#: handler takes it instead and the guard thread ends the tree first. SIGKILL would end the worker
#: before anything could end what its model started, and those would outlive the supervisor.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def die_with_parent(supervisor_pid: int | None) -> None:
    """Ask the kernel to signal us if the supervisor dies, so no worker outlives it (even kill -9).

    The request covers only a parent alive when it is made: a supervisor killed while this
    interpreter started left us re-parented (to init or a subreaper), which never dies. So the
    parent is checked after asking; ParentGone when it is no longer `supervisor_pid`.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    parent = os.getppid()
    if supervisor_pid is not None and parent != supervisor_pid:
        raise ParentGone(f"supervisor pid {supervisor_pid} is gone (parent is now pid {parent})")
