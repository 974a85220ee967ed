"""What every worker-side process does first, before torch: read its launch spec, live and die with the
supervisor, pin itself, and take its priority and memory cap (the serving worker and the audit process alike)."""

from __future__ import annotations

import json
import sys

from infervisor.protocol.constants import WorkerExitCode
from infervisor.protocol.launch import LaunchSpec
from infervisor.worker.pinning import (
    PARENT_DEATH_SIGNAL,
    ParentGone,
    die_with_parent,
    limit_memory,
    lowest_priority,
    pin_before_torch,
)
from infervisor.worker.stop_sentinel import start_stop_sentinel


def enter_process(argv: list[str], role: str, idle: bool) -> LaunchSpec | WorkerExitCode:
    """The parsed launch spec of a process set up to run it, or the exit code of one that must not start.

    `role` names the process in the one line it prints on a bad spec; `idle`: the lowest CPU priority always, as
    a background build (`launch.background`) gets it too.
    """
    try:
        (text,) = argv
        launch = LaunchSpec.from_json(text)
    except (ValueError, TypeError, KeyError) as exc:
        print(f"{role}: bad launch spec: {exc}", file=sys.stderr)
        return WorkerExitCode.BAD_LAUNCH
    try:
        die_with_parent(launch.supervisor_pid)
    except ParentGone as exc:
        # Logging is not set up yet (structlog is not imported this early): one JSON line by hand.
        line = {"event": "supervisor_lost", "level": "error", "reason": str(exc), "worker_id": launch.worker_id}
        print(json.dumps(line), file=sys.stderr)
        return WorkerExitCode.SUPERVISOR_LOST
    if launch.background and launch.supervisor_pid is not None:
        # While this process has one thread (the guard below starts one): a fork copies only the calling thread.
        start_stop_sentinel(launch.supervisor_pid, settle=lowest_priority)
    # Imported only now: structlog (through the guard) is most of this process's imports before the death request,
    # 150 ms quiet and seconds on a loaded box, a window in which a kill -9 of the supervisor left an orphan.
    from infervisor.worker.process_tree import guard_tree

    # Before torch and the model: whatever the model starts is ended if the supervisor dies.
    guard_tree(launch.supervisor_pid, PARENT_DEATH_SIGNAL)
    pin_before_torch(launch.cpus)
    if idle or launch.background:
        lowest_priority()
    limit_memory(launch.max_memory_mb)
    return launch
