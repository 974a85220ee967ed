"""`infervisor doctor`: the 14-point checklist on this box, pass / warn / fail with a one-line fix each."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infervisor.supervisor.settings.config import ConfigError, load_config
from infervisor.supervisor.settings.config_path import ConfigPathError
from infervisor.supervisor.toolkit.constraints import ConstraintsError, load_constraints
from infervisor.supervisor.toolkit.doctor import Check, Machine, Status, run_checks
from infervisor.supervisor.toolkit.provenance import delivery_config

_MARK = {Status.PASS: "pass", Status.WARN: "WARN", Status.FAIL: "FAIL"}


def format_checks(checks: list[Check]) -> str:
    """One line per check, the fix indented under anything that is not a pass."""
    lines = []
    for check in checks:
        lines.append(f"[{_MARK[check.status]}] {check.name:<22} {check.detail}")
        if check.fix and check.status is not Status.PASS:
            lines.append(f"       {'':<22} fix: {check.fix}")
    counts = {s: sum(1 for c in checks if c.status is s) for s in Status}
    lines.append(f"{counts[Status.PASS]} pass, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail")
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> int:
    """Check, print, exit 1 when anything failed (2 when the inputs themselves are wrong)."""
    try:
        optimize = json.loads(Path(args.optimize).read_text()) if args.optimize else None
        choice = delivery_config(args.config, optimize)
        config = load_config(choice.path)
        constraints = load_constraints(Path(args.constraints)) if args.constraints else None
    except (ConfigPathError, ConfigError, ConstraintsError, OSError, ValueError) as exc:
        print(f"infervisor doctor: {exc}")
        return 2
    checks = run_checks(config, constraints, Machine(sysfs=Path(args.sysfs_root), proc=Path(args.proc_root)))
    if args.json:
        print(json.dumps([{**vars(c), "status": c.status.value} for c in checks], indent=2))
    else:
        print(f"config: {choice.describe()}")
        print(format_checks(checks))
    return 1 if any(c.status is Status.FAIL for c in checks) else 0
