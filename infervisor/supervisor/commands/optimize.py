"""`infervisor optimize`: measure every profile of one configured model at every layout the box allows, choose the
profile and layout by the constraints (the P99 bound first, then QPS), check the choice through a real daemon under
probe's own load, and write the chain and layout into config.json (or show the diff).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from infervisor.common.profiles import PROFILES, REFERENCE_PROFILE
from infervisor.supervisor.host.cache_dir import resolve_cache_dir
from infervisor.supervisor.host.planner import PlanError
from infervisor.supervisor.host.topology import TopologyError, read_topology
from infervisor.supervisor.settings.config import Config, ConfigError, load_config, parse_config
from infervisor.supervisor.settings.config_path import ConfigChoice, ConfigPathError, resolve_config_path
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.toolkit.check import CheckFailed, DaemonCheck, check
from infervisor.supervisor.toolkit.config_edit import rewrite
from infervisor.supervisor.toolkit.constraints import Accuracy, Constraints, ConstraintsError, Sla, load_constraints
from infervisor.supervisor.toolkit.layouts import Layout, layouts, placement
from infervisor.supervisor.toolkit.models import entry_of, launch_of
from infervisor.supervisor.toolkit.optimize import Verdict, chain_at, choose, judge_check, noise_notes, within_budget
from infervisor.supervisor.toolkit.provenance import command_line, measured_on
from infervisor.supervisor.toolkit.served_sizes import ServedSizes, recorded_mix, served_sizes, warning
from infervisor.supervisor.toolkit.sweep import ChildFailed, Point, SweepOptions, auto_pick, measure_cores, restart_of


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def sweep(
    config: Config, model: ModelConfig, candidates: list[Layout], args: argparse.Namespace, options: SweepOptions
) -> tuple[list[dict[str, Any]], list[Point]]:
    """Every requested profile at every candidate layout: one row per profile, one point per profile and layout."""
    topology = read_topology()
    allowed = sorted(os.sched_getaffinity(0))
    cache_dir = options.cache_dir
    by_cores: dict[int, list[Layout]] = {}
    for layout in candidates:
        by_cores.setdefault(layout.cores_per_worker, []).append(layout)
    rows: list[dict[str, Any]] = []
    points: list[Point] = []
    for profile in args.profiles.split(","):
        declared = PROFILES.get(profile)
        row: dict[str, Any] = {}
        for cores, group in sorted(by_cores.items()):
            most = max(group, key=lambda layout: layout.workers)
            cpus = placement(config, model.name, most, topology, allowed)
            launch = launch_of(model, cores, cache_dir, args.calibration, args.validation)
            _say(f"measuring {profile} at {cores} core(s) per worker: build, check against eager, then "
                 f"{args.seconds:g} s of timing per layout ({', '.join(str(g) for g in group)}) in interleaved "
                 f"windows, at {options.measured_at}")  # fmt: skip
            try:
                measured, found, siblings = measure_cores(launch, profile, group, cpus, options)
            except ChildFailed as exc:
                measured, found, siblings = {"profile": profile, "skipped": str(exc)}, [], []
            if not row:
                row = measured
            if declared is not None and declared.packaged and "p50_ms" in row and "restart_s" not in row:
                # The first process compiled (or loaded) the package; a later one's start is a restart that loads it.
                starts = [s["cold_start_s"] for s in siblings if s.get("cold_start_s") is not None]
                row["restart_s"] = min(starts) if starts else restart_of(launch, profile, cpus[0], options)
            points += found
            _say(f"measured {profile} at {cores} core(s) per worker: " + (
                ", ".join(f"{p.layout} p50 {p.p50_ms:.2f} ms, {p.qps:.1f} QPS ±{p.qps_spread / 2:.0%}" for p in found)
                or str(measured.get("skipped", "?"))[:160]
            ))  # fmt: skip
            if "p50_ms" not in measured:
                break
        row["risk"] = declared.risk if declared is not None else ""
        rows.append(row)
    return rows, points


def format_report(
    rows: list[dict[str, Any]], points: list[Point], budget: Accuracy, chosen: Point | None, verdict: Verdict
) -> str:
    """The profiles (accuracy, memory, start), the layouts (latency, throughput), then the choice and verdict."""
    eager = next((r for r in rows if r["profile"] == REFERENCE_PROFILE and "p50_ms" in r), None)
    lines = [
        f"{'profile':<12} {'budget':<6} {'cosine':>8} {'max err':>8} {'RSS MB':>7} {'ΔRSS':>6} {'first s':>7} "
        f"{'restart':>7}  risk / why not"
    ]
    for row in rows:
        outside = within_budget(row, budget)
        if "p50_ms" not in row:
            lines.append(f"{row['profile']:<12} {'-':<6} {outside}")
            continue
        d_rss = row["rss_mb"] - eager["rss_mb"] if eager else 0.0
        restart = row.get("restart_s", row.get("cold_start_s"))
        lines.append(
            f"{row['profile']:<12} {'in' if outside is None else 'OUT':<6} {row['cosine']:>8.5f} "
            f"{row['max_abs_error']:>8.2g} {row['rss_mb']:>7.0f} {d_rss:>+6.0f} {row.get('cold_start_s') or 0:>7.1f} "
            f"{restart or 0:>7.1f}  {outside or row['risk']}"
        )
    measured_at = points[0].measured_at if points else ""
    lines += ["", f"measured at {measured_at}" if measured_at else "measured at the declared example"]
    lines += [f"{'layout':<6} {'profile':<12} {'p50 ms':>8} {'p99 ms':>8} {'QPS':>8} {'±':>4} {'busy p99':>8} {'±':>4}"]
    for point in sorted(points, key=lambda p: (p.layout.cores_per_worker, p.layout.workers, p.p99_ms)):
        mark = "  <- chosen" if point == chosen else f"  SUSPECT: {point.suspect}" if point.suspect else ""
        again = f"  (re-measured: {point.remeasured})" if point.remeasured and not point.suspect else ""
        lines.append(
            f"{str(point.layout):<6} {point.profile:<12} {point.p50_ms:>8.2f} {point.p99_ms:>8.2f} {point.qps:>8.1f} "
            f"{point.qps_spread / 2:>4.0%} {point.busy_p99_ms:>8.2f} {point.p99_spread / 2:>4.0%}{mark}{again}"
        )
    lines.append(
        "layout: workers x cores per worker; p50/p99: one request at a time on one worker (in process); QPS and "
        f"busy p99: every worker of the layout running requests back to back at once; each the median of "
        f"{points[0].windows if points else 0} interleaved windows, ± half their range; SUSPECT: figures the cores "
        "cannot explain, measured twice, never chosen"
    )
    return "\n".join(lines)


#: optimize's exit codes: the SLA holds (checked as asked); a measured figure breaks it; bad input; the check the
#: verdict rests on could not run (nothing measured through a daemon, so no verdict either way).
EXIT_MET, EXIT_NOT_MET, EXIT_BAD_INPUT, EXIT_UNPROVEN = 0, 1, 2, 3


def _verdict_lines(verdict: Verdict) -> list[str]:
    if verdict.unproven is not None:
        return [f"VERDICT: unproven: {verdict.unproven}", *(f"  measured in process: {r}" for r in verdict.reasons)]
    within = [f"  within the noise: {note}" for note in verdict.noise]
    if verdict.met:
        return [
            f"VERDICT: the SLA can be met on this box, by {verdict.profile} on {verdict.layout} workers x cores.",
            *within,
        ]
    return ["VERDICT: the SLA cannot be met on this box.", *(f"  {reason}" for reason in verdict.reasons), *within]


def _check_qps(args: argparse.Namespace, sla: Sla) -> float | None:
    """The QPS the promise is made for: --check-qps, else the SLA's minimum, else None (half the daemon's best)."""
    if args.check_qps:
        return float(args.check_qps)
    return sla.min_qps if sla.min_qps > 0 else None


def _check_lines(result: DaemonCheck, chosen: Point, model: str) -> list[str]:
    gap = (result.p99_ms - chosen.p99_ms) / chosen.p99_ms if chosen.p99_ms else 0.0
    return [
        f"CHECK of the chosen {chosen.profile} on {chosen.layout} through a daemon serving this config (workers "
        f"serve {', '.join(result.profiles)}), requests at {result.measured_at}: "
        f"{result.qps:g} QPS from {result.clients} clients for {result.seconds:g} s: P50 {result.p50_ms:.2f} ms, "
        f"P99 {result.p99_ms:.2f} ms, {result.errors} errors; saturated {result.saturated_qps:.1f} QPS",
        f"  in process the same choice measured P99 {chosen.p99_ms:.2f} ms ({gap:+.0%}): the daemon adds the "
        "broker's hop, the reply path and a supervisor sharing the cores, so the promise is the daemon's P99",
        f"  the same load against the served model: infervisor probe --model {model} --qps {result.qps:g} "
        f"--clients {result.clients} --duration {result.seconds:g}",
    ]


def _auto_pick(
    config: Config,
    model: ModelConfig,
    chain: list[str],
    chosen: Point,
    budget: Accuracy,
    args: argparse.Namespace,
    cache_dir: Path,
) -> dict[str, Any]:
    """A worker's own `pick: fastest` over the chain, on the chosen layout's first worker's cores."""
    cpus = placement(config, model.name, chosen.layout, read_topology(), sorted(os.sched_getaffinity(0)))[0]
    launch = dataclasses.replace(
        launch_of(model, chosen.layout.cores_per_worker, cache_dir, args.calibration, args.validation),
        profiles=tuple(chain),
        pick="fastest",
        tolerance={"min_cosine": budget.min_cosine, "max_abs_error": budget.max_abs_error, "top1": budget.top1},
    )
    try:
        return auto_pick(launch, cpus, SweepOptions(args.seconds, args.batch, args.timeout, cache_dir))
    except ChildFailed as exc:
        return {"error": str(exc)}


def _auto_pick_lines(picked: dict[str, Any], points: list[Point], chosen: Point) -> list[str]:
    """The worker's pick against the best this sweep measured at the same layout (batch-1 P50)."""
    if "error" in picked:
        return [f"AUTO-PICK: a worker's pick fastest could not be run: {picked['error']}"]
    here = {p.profile: p for p in points if p.layout == chosen.layout}
    best = min(here.values(), key=lambda p: p.p50_ms)
    mine = here.get(picked["pick"])
    against = f"x{mine.p50_ms / best.p50_ms:.3f} the batch-1 P50 of" if mine is not None else "against"
    return [
        f"AUTO-PICK: a worker's `pick: fastest` over this chain at {chosen.layout.cores_per_worker} thread(s) serves "
        f"{picked['pick']}: {against} the fastest measured here, {best.profile} ({best.p50_ms:.3g} ms)",
        f"  its decision: {picked['notes'][-1] if picked['notes'] else '-'}",
    ]


def _layouts(args: argparse.Namespace, config: Config, model: ModelConfig) -> list[Layout]:
    """--layouts as given, else every layout that fits (at --threads cores per worker, when given)."""
    if args.layouts:
        return [Layout.parse(text) for text in args.layouts.split(",")]
    cores = [args.threads] if args.threads else None
    return layouts(config, model.name, read_topology(), sorted(os.sched_getaffinity(0)), cores)


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


class _Refused(Exception):
    """Bad input (config, constraints, model, layouts): the command says why and exits 2."""


def _load(args: argparse.Namespace) -> tuple[ConfigChoice, Config, ModelConfig, Constraints | None, list[Layout]]:
    """The config (and where it came from), the model, the constraints and the layouts to measure."""
    try:
        choice = resolve_config_path(args.config)
        config = load_config(choice.path)
        constraints = load_constraints(Path(args.constraints)) if args.constraints else None
    except (ConfigPathError, ConfigError, ConstraintsError) as exc:
        raise _Refused(str(exc)) from exc
    model = config.models.get(args.model)
    if model is None:
        raise _Refused(f"no model {args.model!r} in {choice.path}; it has {sorted(config.models)}")
    try:
        candidates = _layouts(args, config, model)
    except (ValueError, TopologyError, PlanError) as exc:
        raise _Refused(str(exc)) from exc
    if not candidates:
        raise _Refused(f"no layout of {args.model} fits beside the other models on these cpus")
    return choice, config, model, constraints, candidates


def _budget_and_sla(model: ModelConfig, constraints: Constraints | None) -> tuple[Accuracy, Sla]:
    """The accuracy budget and SLA of the constraints, else the model's tolerance and no latency promise."""
    if constraints:
        return constraints.sla.accuracy, constraints.sla
    tolerance = model.tolerance
    budget = Accuracy(tolerance["min_cosine"], tolerance.get("max_abs_error"), bool(tolerance.get("top1")))
    return budget, Sla(float("inf"), float("inf"), 0.0, 0.0, budget)


def _changes(
    args: argparse.Namespace, model: ModelConfig, chain: list[str], chosen: Point, budget: Accuracy
) -> dict[str, Any]:
    """What the model's config entry gets: the chain, the layout, the budget and the data files measured with."""
    changes: dict[str, Any] = {
        "profiles": chain,
        "pick": "first",
        "workers": chosen.layout.workers,
        "cores_per_worker": chosen.layout.cores_per_worker,
        "tolerance": {"min_cosine": budget.min_cosine, "max_abs_error": budget.max_abs_error, "top1": budget.top1},
    }
    if model.threads is not None:
        changes["threads"] = None  # one thread per pinned core, as measured
    if args.calibration:
        changes["calibration"] = str(Path(args.calibration).resolve())
    if args.validation:
        changes["validation"] = str(Path(args.validation).resolve())
    return changes


def _check_choice(
    args: argparse.Namespace,
    new_text: str,
    config_path: Path,
    cache_dir: Path,
    chosen: Point,
    sla: Sla,
    verdict: Verdict,
    sizes: ServedSizes,
) -> tuple[DaemonCheck | None, Verdict, CheckFailed | None]:
    """The rewritten config served by a scratch daemon under load (unless --no-check), the verdict after it, and
    why the check could not run (None when it ran or was not asked for)."""
    if not args.check:
        print(f"not checked through a daemon (--no-check): the P99 above is in process, {chosen.p99_ms:.2f} ms")
        return None, verdict, None
    raw = json.loads(new_text)
    source_dir = config_path.parent.resolve()
    # The scratch daemon's config lives elsewhere: model files and data sets by absolute path, python modules
    # from the user's config folder (serve --source-dir), exactly as `serve` finds them.
    written = parse_config(new_text, source_dir)
    raw["models"] = {name: entry_of(m, raw["models"][name]) for name, m in written.models.items()}
    qps = _check_qps(args, sla)
    _say(f"checking {chosen.profile} on {chosen.layout} through a daemon at {qps or 'half its saturated'} QPS "
         f"for {args.check_seconds:g} s")  # fmt: skip
    try:
        result = check(raw, args.model, source_dir, cache_dir, (qps, args.check_clients, args.check_seconds),
                       args.timeout, sizes)  # fmt: skip
    except CheckFailed as exc:
        print(f"the daemon check could not run: {exc}")
        if not verdict.met:  # the in-process figures already break the SLA: that much was measured
            return None, verdict, exc
        return None, dataclasses.replace(verdict, met=False, unproven=f"the daemon check could not run: {exc}"), exc
    print("\n".join(_check_lines(result, chosen, args.model)))
    return result, judge_check(verdict, result, sla, chosen.profile), None


def _write_config(
    args: argparse.Namespace, choice: ConfigChoice, new_text: str, diff: str, verdict: Verdict
) -> tuple[str | None, str]:
    """Write the new chain and layout into config.json unless it holds them, it is a dry run, the shipped file, or
    the daemon check asked for did not pass (a choice nothing served is not put in front of clients).

    Returns where it was written (None: nowhere) and, when not, why.
    """
    config_path = choice.path
    if args.check and not verdict.met:
        why = verdict.unproven or "the SLA was not met through the daemon check"
        not_written = f"{config_path} was left unchanged: {why}"
        print(f"not written: {not_written}; the change it would have made:")
        print(diff or "(none: it already holds this chain and layout)")
        return None, not_written
    if not diff:
        not_written = f"{config_path} already holds this chain and layout"
        print(not_written)
        return None, not_written
    if args.dry_run:
        print(diff)
        return None, f"--dry-run: the diff was shown, {config_path} was left unchanged"
    if choice.source == "shipped default":
        # The shipped file is the package's, not this box's: name one to write instead of editing it.
        not_written = f"{config_path} is the shipped default; pass --config (or set $INFERVISOR_CONFIG)"
        print(f"not written: {not_written}")
        print(diff)
        return None, not_written
    temporary = config_path.with_suffix(".optimize.tmp")
    temporary.write_text(new_text)
    temporary.replace(config_path)  # a running daemon sees one complete file and rolls the model
    print(f"written to {config_path}")
    return str(config_path), ""


def run_optimize(args: argparse.Namespace) -> int:
    """Measure, choose, check, write (or show); exit 0 when the SLA holds, 1 when a measured figure breaks it, 2 on
    bad input, 3 when the daemon check could not run (unproven)."""
    try:
        choice, config, model, constraints, candidates = _load(args)
    except _Refused as exc:
        print(f"infervisor optimize: {exc}")
        return EXIT_BAD_INPUT
    budget, sla = _budget_and_sla(model, constraints)
    cache_dir = Path(args.cache_dir) if args.cache_dir else resolve_cache_dir(config.cache_dir)
    recording = None
    if model.record_inputs:
        recording, why_not = recorded_mix(resolve_cache_dir(config.cache_dir), model.name, model.record_inputs_mb)
        if why_not:
            _say(why_not)
    sizes = served_sizes(model.inputs, constraints.data if constraints else None, model.typical_shape, recording)
    options = SweepOptions(args.seconds, args.batch, args.timeout, cache_dir, sizes.as_json(), sizes.text)
    _say(f"layouts: {', '.join(map(str, candidates))} (workers x cores per worker); sizes: {sizes.text}")
    try:
        rows, points = sweep(config, model, candidates, args, options)
    except (TopologyError, PlanError) as exc:
        print(f"infervisor optimize: {exc}")
        return 2
    chosen, verdict = choose(points, {r["profile"]: r for r in rows}, sla, budget)
    print(format_report(rows, points, budget, chosen, verdict))
    for line in [*warning(sizes), *synthetic_warnings(rows)]:
        print(line)
    print("")
    if chosen is None:
        print("\n".join(_verdict_lines(verdict)))
        return 1
    verdict = dataclasses.replace(verdict, noise=noise_notes(points, chosen, sla, args.seconds))
    chain = chain_at(points, {r["profile"]: r for r in rows}, budget, chosen)
    new_text, diff = rewrite(choice.path.read_text(), args.model, _changes(args, model, chain, chosen, budget))
    picked = _auto_pick(config, model, chain, chosen, budget, args, cache_dir)
    print("\n".join(_auto_pick_lines(picked, points, chosen)))
    result, verdict, failed = _check_choice(args, new_text, choice.path, cache_dir, chosen, sla, verdict, sizes)
    print("\n".join(_verdict_lines(verdict)))
    print(f"\nchosen: {chosen.profile} on {chosen.layout} (workers x cores per worker); chain for {args.model}: "
          f"{' -> '.join(chain)}")  # fmt: skip
    written_to, not_written = _write_config(args, choice, new_text, diff, verdict)
    if args.json:
        report = {
            "model": args.model,
            # The one answer to "what was chosen": the table's mark, the check's subject and the chain's head.
            "chosen": {"profile": chosen.profile, "layout": str(chosen.layout)},
            "measured_at": sizes.text,
            "sizes": sizes.as_json(),
            "rows": [_at_choice(row, points, chosen) for row in rows],
            "layouts": [p.as_json() for p in points],
            "chain": chain,
            "layout": {"workers": chosen.layout.workers, "cores_per_worker": chosen.layout.cores_per_worker},
            "check": vars(result) if result is not None else None,
            # Whether a check was asked for, and why it could not run: the report must not say --no-check otherwise.
            "checked": bool(args.check),
            "check_error": failed.reason if failed is not None else None,
            "check_log": str(failed.log_path) if failed is not None and failed.log_path else None,
            "auto_pick": picked,
            "verdict": {**vars(verdict), "outcome": verdict.outcome},
            # The config optimize read: report and doctor sign it when nothing was written.
            "config": str(choice.path.resolve()),
            # Whether config.json now holds the chain: the report must not claim a dry run wrote it.
            "written_to": written_to,
            "not_written": not_written or None,
            "command": command_line({"--config": str(choice.path.resolve())}),
            "measured_on": measured_on(),
            "seconds": args.seconds,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    if verdict.unproven is not None:
        return EXIT_UNPROVEN
    return EXIT_MET if verdict.met else EXIT_NOT_MET


def _at_choice(row: dict[str, Any], points: list[Point], chosen: Point) -> dict[str, Any]:
    """A profile's row with its latency and QPS at the chosen layout (what the report's table shows)."""
    here = next((p for p in points if p.profile == row["profile"] and p.layout == chosen.layout), None)
    if here is None:
        return row
    return {
        **row, "p50_ms": here.p50_ms, "p99_ms": here.p99_ms, "qps": here.qps, "layout": str(here.layout),
        "measured_at": here.measured_at,
    }  # fmt: skip
