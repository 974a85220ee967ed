"""`infervisor optimize`: measure every profile of one configured model, rank them within the accuracy budget,
say whether the SLA holds on this box, and write the fallback chain into config.json (or show the diff).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common.profiles import PROFILES, REFERENCE_PROFILE
from protocol.launch import LaunchSpec
from supervisor.cache_dir import resolve_cache_dir
from supervisor.config import ConfigError, ModelConfig, load_config
from supervisor.config_path import ConfigPathError, resolve_config_path
from supervisor.toolkit.constraints import Accuracy, ConstraintsError, Sla, load_constraints
from supervisor.toolkit.optimize import Verdict, chain_of, judge, rank, rewrite, within_budget


def _launch(model: ModelConfig, args: argparse.Namespace, cache_dir: Path) -> LaunchSpec:
    calibration = str(Path(args.calibration).resolve()) if args.calibration else model.calibration
    validation = str(Path(args.validation).resolve()) if args.validation else model.validation
    return LaunchSpec(
        "optimize", model.name, -1, model.source, model.inputs, model.outputs, (), args.threads,
        channels_last=model.channels_last, cache_dir=str(cache_dir), calibration=calibration, validation=validation,
    )  # fmt: skip


def _child(launch: LaunchSpec, profile: str, args: argparse.Namespace, cache_dir: Path) -> dict[str, Any]:
    """One profile in a fresh pinned process: its cold start, RSS, accuracy and latency."""
    command = [
        sys.executable, "-m", "worker.bench", "--launch", launch.to_json(), "--profiles", profile,
        "--threads", str(args.threads), "--batch", str(args.batch), "--seconds", str(args.seconds),
        "--cache-dir", str(cache_dir), "--started-at", repr(time.time()),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"profile": profile, "skipped": f"measurement took longer than --timeout {args.timeout:.0f} s"}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(rows) < 2:
        return {"profile": profile, "skipped": f"measurement failed ({done.returncode}): {done.stderr[-300:]}"}
    row: dict[str, Any] = rows[1]
    return row


def measure_all(model: ModelConfig, args: argparse.Namespace, cache_dir: Path) -> list[dict[str, Any]]:
    """Every requested profile, each in its own process (packaged ones twice: first start and restart)."""
    launch = _launch(model, args, cache_dir)
    rows = []
    for profile in args.profiles.split(","):
        declared = PROFILES.get(profile)
        row = _child(launch, profile, args, cache_dir)
        if declared is not None and declared.packaged and "p50_ms" in row:
            # The first start compiled the package; a second child measures the restart that loads it.
            again = _child(launch, profile, args, cache_dir)
            row["restart_s"] = again.get("cold_start_s")
        row["risk"] = declared.risk if declared is not None else ""
        rows.append(row)
        print(f"measured {profile}: " + (f"p50 {row['p50_ms']:.2f} ms" if "p50_ms" in row else row["skipped"][:120]),
              file=sys.stderr, flush=True)  # fmt: skip
    return rows


def format_report(rows: list[dict[str, Any]], budget: Accuracy, verdict: Verdict, workers: int) -> str:
    """The ranked table, then the verdict."""
    eager = next((r for r in rows if r["profile"] == REFERENCE_PROFILE and "p50_ms" in r), None)
    lines = [
        f"{'profile':<12} {'budget':<6} {'cosine':>8} {'max err':>8} {'p50 ms':>8} {'p99 ms':>8} {'Δp50':>7} "
        f"{'QPS':>8} {'RSS MB':>7} {'ΔRSS':>6} {'first s':>7} {'restart':>7}  risk / why not"
    ]
    for row in rows:
        outside = within_budget(row, budget)
        if "p50_ms" not in row:
            lines.append(f"{row['profile']:<12} {'-':<6} {outside}")
            continue
        d_p50 = row["p50_ms"] - eager["p50_ms"] if eager else 0.0
        d_rss = row["rss_mb"] - eager["rss_mb"] if eager else 0.0
        restart = row.get("restart_s", row.get("cold_start_s"))
        lines.append(
            f"{row['profile']:<12} {'in' if outside is None else 'OUT':<6} {row['cosine']:>8.5f} "
            f"{row['max_abs_error']:>8.2g} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {d_p50:>+7.2f} "
            f"{row['qps'] * workers:>8.1f} {row['rss_mb']:>7.0f} {d_rss:>+6.0f} {row.get('cold_start_s') or 0:>7.1f} "
            f"{restart or 0:>7.1f}  {outside or row['risk']}"
        )
    lines.append("")
    if verdict.met:
        lines.append(f"VERDICT: the SLA can be met on this box, by {verdict.profile}.")
    else:
        lines.append("VERDICT: the SLA cannot be met on this box.")
        lines.extend(f"  {reason}" for reason in verdict.reasons)
    return "\n".join(lines)


def synthetic_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """A WARNING line when a measured profile that changes numerics (int8, bf16) was judged on synthetic inputs."""
    judged = [
        row["profile"]
        for row in rows
        if "cosine" in row
        and row.get("checked_on") != "validation set"
        and (declared := PROFILES.get(row["profile"])) is not None
        and declared.changes_numerics
    ]
    if not judged:
        return []
    return [
        f"WARNING: {', '.join(judged)} change numerics and were judged on synthetic inputs only (no validation set); "
        "their cosine says little about real inputs: pass --validation FILE.npz or configure `validation`"
    ]


def run_optimize(args: argparse.Namespace) -> int:
    """Measure, rank, judge, write (or show) the chain; exit 0 when the SLA holds, 1 when it cannot, 2 on bad input."""
    try:
        choice = resolve_config_path(args.config)
        config_path = choice.path
        config = load_config(config_path)
        constraints = load_constraints(Path(args.constraints)) if args.constraints else None
    except (ConfigPathError, ConfigError, ConstraintsError) as exc:
        print(f"infervisor optimize: {exc}")
        return 2
    model = config.models.get(args.model)
    if model is None:
        print(f"infervisor optimize: no model {args.model!r} in {config_path}; it has {sorted(config.models)}")
        return 2
    args.threads = args.threads or model.threads or model.cores_per_worker
    tolerance = model.tolerance
    budget = (
        constraints.sla.accuracy
        if constraints
        else Accuracy(tolerance["min_cosine"], tolerance.get("max_abs_error"), bool(tolerance.get("top1")))
    )
    sla = constraints.sla if constraints else Sla(float("inf"), float("inf"), 0.0, 0.0, budget)
    rows = measure_all(model, args, Path(args.cache_dir) if args.cache_dir else resolve_cache_dir(config.cache_dir))
    ranked = rank(rows, budget)
    verdict = judge(ranked, sla, model.workers)
    print(format_report(rows, budget, verdict, model.workers))
    for line in synthetic_warnings(rows):
        print(line)
    chain = chain_of(ranked)
    changes: dict[str, Any] = {
        "profiles": chain,
        "pick": "first",
        "tolerance": {"min_cosine": budget.min_cosine, "max_abs_error": budget.max_abs_error, "top1": budget.top1},
    }
    if args.calibration:
        changes["calibration"] = str(Path(args.calibration).resolve())
    if args.validation:
        changes["validation"] = str(Path(args.validation).resolve())
    new_text, diff = rewrite(config_path.read_text(), args.model, changes)
    print(f"\nchain for {args.model}: {' -> '.join(chain)}")
    if args.dry_run:
        print(diff or "config.json already has this chain")
    elif diff and choice.source == "shipped default":
        # The shipped file is the package's, not this box's: name one to write instead of editing it.
        print(f"not written: {config_path} is the shipped default; pass --config (or set $INFERVISOR_CONFIG)")
        print(diff)
    elif diff:
        temporary = config_path.with_suffix(".optimize.tmp")
        temporary.write_text(new_text)
        temporary.replace(config_path)  # a running daemon sees one complete file and rolls the model
        print(f"written to {config_path}")
    if args.json:
        report = {"model": args.model, "rows": rows, "chain": chain, "verdict": vars(verdict)}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if verdict.met else 1
