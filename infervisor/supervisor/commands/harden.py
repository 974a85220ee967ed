"""`infervisor harden`: the Stability Hardening Protocol against a running daemon, pass/fail per check."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.protocol.control_client import ControlError, model_status
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir
from infervisor.supervisor.toolkit.constraints import ConstraintsError, load_constraints
from infervisor.supervisor.toolkit.harden import Target, run_protocol
from infervisor.supervisor.toolkit.inputs import random_inputs
from infervisor.supervisor.toolkit.provenance import command_line, measured_on, served


def run_harden(args: argparse.Namespace) -> int:
    """Run the checks, print one line each, exit 1 when any measured check failed (2 when the daemon or inputs are
    wrong); a check this box cannot make (thermal on a VM) is printed as not measured and fails nothing."""
    runtime_dir = resolve_runtime_dir(args.runtime_dir, None)
    try:
        constraints = load_constraints(Path(args.constraints)) if args.constraints else None
        model = model_status(runtime_dir, args.model)
    except (ConstraintsError, ControlError) as exc:
        print(f"infervisor harden: {exc}")
        return 2
    target = Target(
        runtime_dir, f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}", args.model, random_inputs(model["inputs"], 1)
    )
    p99_limit = constraints.sla.p99_ms if constraints else None
    results = run_protocol(
        target, args.duration, args.hog_mb, p99_limit, args.chaos,
        progress=lambda line: print(f"  ... {line}", file=sys.stderr, flush=True),
    )  # fmt: skip
    for result in results:
        mark = "pass" if result.passed else "FAIL" if result.measured else "n/a "
        print(f"[{mark}] {result.name:<18} {result.detail}")
    measured = [r for r in results if r.measured]
    passed = all(r.passed for r in measured)
    unmeasured = [r.name for r in results if not r.measured]
    print(
        f"{'PASSED' if passed else 'FAILED'}: {sum(r.passed for r in measured)}/{len(measured)} checks"
        + (f"; not measured here: {', '.join(unmeasured)}" if unmeasured else "")
    )
    if args.json:
        document = {
            "model": args.model,
            "duration_s": args.duration,
            "command": command_line({"--runtime-dir": str(runtime_dir.resolve())}),
            "measured_on": measured_on(),
            # What the checks ran against, from the daemon's own status: the report compares it with optimize's choice.
            "served": served(model),
            "results": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(document, indent=2, default=str))
    return 0 if passed else 1
