"""`infervisor report`: constraints, doctor, optimize, probe and harden in one self-contained HTML file (+ PNGs)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from infervisor.supervisor.settings.config import ConfigError, load_config
from infervisor.supervisor.settings.config_path import ConfigPathError
from infervisor.supervisor.toolkit.constraints import ConstraintsError, load_constraints
from infervisor.supervisor.toolkit.doctor import run_checks
from infervisor.supervisor.toolkit.provenance import delivery_config, measured_on, sha256_of
from infervisor.supervisor.toolkit.report import Evidence, Outcome, charts, render, verdict

_OUTCOME_LINE = {Outcome.MET: "SLA met", Outcome.NOT_MET: "SLA NOT met", Outcome.UNPROVEN: "SLA unproven"}


def _json(path: str | None) -> Any:
    return json.loads(Path(path).read_text()) if path else None


def run_report(args: argparse.Namespace) -> int:
    """Write the report; exit 0 when the SLA is met, 1 when a measured figure breaks it, 3 when it is unproven
    (evidence missing), 2 on unreadable inputs."""
    try:
        constraints = load_constraints(Path(args.constraints)) if args.constraints else None
        optimize = _json(args.optimize)
        choice = delivery_config(args.config, optimize)
        config_path = choice.path
        config = load_config(config_path)
        evidence = Evidence(
            constraints=constraints,
            doctor=run_checks(config, constraints),
            optimize=optimize,
            probe=_json(args.probe),
            harden=_json(args.harden),
            here=measured_on(),
            inputs={
                "config": str(config_path),
                "config_from": choice.source,
                "config_sha256": sha256_of(config_path),
                # Absolute, so the doctor's Repeat line runs from any folder.
                "constraints": str(Path(args.constraints).resolve()) if args.constraints else None,
                "constraints_sha256": sha256_of(Path(args.constraints)) if args.constraints else None,
            },
        )
    except (ConfigPathError, ConfigError, ConstraintsError, OSError, ValueError) as exc:
        print(f"infervisor report: {exc}")
        return 2
    drawn = charts(evidence)
    out = Path(args.out)
    out.write_text(render(evidence, drawn))
    for chart in drawn or []:
        out.with_name(f"{out.stem}-{chart.name}.png").write_bytes(chart.png)
    found = verdict(evidence)
    lines = [f"config: {choice.describe()}", f"{out}: {_OUTCOME_LINE[found.outcome]}"]
    lines += [f"  failed: {r}" for r in found.failed] + [f"  missing: {r}" for r in found.missing]
    lines += [f"  not proven: {r}" for r in found.not_proven]
    print("\n".join(lines))
    return found.outcome.value
