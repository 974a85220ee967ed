"""A background builder's stop sentinel: continues the builder's process group when the supervisor dies.

The supervisor stops the builder's group (SIGSTOP) while requests are in flight (supervisor/lifecycle/build_gate.py).
A stopped process acts on no signal but SIGKILL: if the supervisor died then, the builder's parent-death signal would
stay pending and the builder and its compilers would stay stopped, orphans, for ever. The sentinel is a child of the
builder in a process group of its own (so the gate never stops it) that waits for the supervisor's death and then
continues the builder's group, which ends its tree as any worker does (worker/process_tree.py). It dies with the
builder (its own parent-death signal is SIGKILL) and does nothing else.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
#: Without pidfd_open (Linux < 5.3), how often the sentinel asks whether the supervisor is still the builder's parent.
_PARENT_POLL_S = 0.5


def start_stop_sentinel(supervisor_pid: int, settle: Callable[[], object]) -> int:
    """Fork the sentinel of this builder; its pid. Call it while this process has one thread (a fork copies one).

    `settle` runs first in the sentinel (the builder's idle priority, so the sentinel is no less idle than it).
    """
    builder = os.getpid()
    group = os.getpgrp()
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child calls into it, it loads nothing
    try:
        pidfd: int | None = os.pidfd_open(supervisor_pid)
    except (AttributeError, OSError):
        pidfd = None
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child != 0:
        if pidfd is not None:
            os.close(pidfd)
        return child
    code = 0
    try:
        os.setpgid(0, 0)
        settle()
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != builder:
            os._exit(0)  # the builder is gone already: nothing to continue
        keep = pidfd if pidfd is not None else -1
        os.closerange(3, keep if keep >= 0 else os.sysconf("SC_OPEN_MAX"))
        if keep >= 0:
            os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        _await_death(supervisor_pid, builder, pidfd)
        os.killpg(group, signal.SIGCONT)
    except OSError:
        code = 1
    finally:
        os._exit(code)


def _await_death(supervisor_pid: int, builder: int, pidfd: int | None) -> None:
    """Return once the supervisor has exited (or the builder is no longer its child)."""
    if pidfd is not None:
        waiter = select.poll()
        waiter.register(pidfd, select.POLLIN)
        while not waiter.poll():
            continue
        return
    while _parent_of(builder) == supervisor_pid:
        time.sleep(_PARENT_POLL_S)


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` from /proc (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
    return int(text[text.rindex(b")") + 2 :].split()[1])
