"""The live audit's process: `python -P -m infervisor.worker.audit LAUNCH_JSON`, one per audited model.

It loads the model's eager fp32 form once and, at the lowest CPU priority (SCHED_IDLE, else nice 19), re-runs
the served requests the supervisor sampled and compares the answers they got with eager's by the gate's own
measures (profiles/validate.py): per-row cosine, relative error on few-value outputs, max abs error, top-1.
It serves nobody: a crash or a hang here costs the audit (restarted with back-off), never an answer.
"""

from __future__ import annotations

import sys

from infervisor.protocol.constants import WorkerExitCode
from infervisor.worker.process_entry import enter_process


def main(argv: list[str]) -> int:
    """Parse the launch spec, set up the process as the background builder's is, then import torch and audit."""
    # Always the lowest priority: the audit only ever gets CPU time that serving leaves idle.
    launch = enter_process(argv, "audit", idle=True)
    if isinstance(launch, WorkerExitCode):
        return launch
    from infervisor.common.json_logs import adopt_library_handlers
    from infervisor.worker.logs import configure_logging

    configure_logging()
    from infervisor.worker.audit_loop import run

    adopt_library_handlers()
    return run(launch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
