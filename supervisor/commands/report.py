"""`infervisor report`: constraints, doctor, optimize, probe and harden in one self-contained HTML file (+ PNG)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from supervisor.config import ConfigError, load_config
from supervisor.config_path import ConfigPathError, resolve_config_path
from supervisor.toolkit.constraints import ConstraintsError, load_constraints
from supervisor.toolkit.doctor import run_checks
from supervisor.toolkit.report import Evidence, charts_png, render, verdict


def _json(path: str | None) -> Any:
    return json.loads(Path(path).read_text()) if path else None


def run_report(args: argparse.Namespace) -> int:
    """Write the report; exit 0 when the verdict is "SLA met", 1 when not, 2 on unreadable inputs."""
    try:
        constraints = load_constraints(Path(args.constraints)) if args.constraints else None
        config = load_config(resolve_config_path(args.config).path)
        evidence = Evidence(
            constraints=constraints,
            doctor=run_checks(config, constraints),
            optimize=_json(args.optimize),
            probe=_json(args.probe),
            harden=_json(args.harden),
        )
    except (ConfigPathError, ConfigError, ConstraintsError, OSError, ValueError) as exc:
        print(f"infervisor report: {exc}")
        return 2
    png = charts_png(evidence)
    out = Path(args.out)
    out.write_text(render(evidence, png))
    if png is not None:
        out.with_suffix(".png").write_bytes(png)
    met, reasons = verdict(evidence)
    print(f"{out}: {'SLA met' if met else 'SLA NOT met'}" + "".join(f"\n  {r}" for r in reasons))
    return 0 if met else 1
