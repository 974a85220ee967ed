"""The live audit's process: `python -P -m infervisor.worker.audit LAUNCH_JSON`, one per audited model.

It loads the model's eager fp32 form once and, at the lowest CPU priority (SCHED_IDLE, else nice 19), re-runs
the served requests the supervisor sampled and compares the answers they got with eager's by the gate's own
measures (profiles/validate.py): per-row cosine, relative error on few-value outputs, max abs error, top-1.
It serves nobody: a crash or a hang here costs the audit (restarted with back-off), never an answer.
"""

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


def main(argv: list[str]) -> int:
    """Parse the launch spec, set up the process as the background builder's is, then import torch and audit."""
    try:
        (text,) = argv
        launch = LaunchSpec.from_json(text)
    except (ValueError, TypeError, KeyError) as exc:
        print(f"audit: bad launch spec: {exc}", file=sys.stderr)
        return WorkerExitCode.BAD_LAUNCH
    try:
        die_with_parent(launch.supervisor_pid)
    except ParentGone as exc:
        print(json.dumps({"event": "supervisor_lost", "level": "error", "reason": str(exc)}), file=sys.stderr)
        return WorkerExitCode.SUPERVISOR_LOST
    from infervisor.worker.process_tree import guard_tree

    guard_tree(launch.supervisor_pid, PARENT_DEATH_SIGNAL)
    pin_before_torch(launch.cpus)
    # Always: the audit only ever gets CPU time that serving leaves idle.
    lowest_priority()
    limit_memory(launch.max_memory_mb)
    from infervisor.common.json_logs import adopt_library_handlers
    from infervisor.worker.logs import configure_logging

    configure_logging()
    from infervisor.worker.audit_loop import run

    adopt_library_handlers()
    return run(launch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
