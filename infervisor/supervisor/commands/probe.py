"""`infervisor probe`: the three probes of seed 2 under one bounded load against a running daemon."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from infervisor.protocol.client import Client
from infervisor.protocol.constants import CLIENT_SOCKET_NAME
from infervisor.protocol.control_client import ControlError, control_request, model_status
from infervisor.protocol.errors import InferenceError
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir
from infervisor.supervisor.toolkit.inputs import random_inputs
from infervisor.supervisor.toolkit.load import paced_load
from infervisor.supervisor.toolkit.probe import (
    STAGE_MEANING,
    STAGES,
    parse_perf_stat,
    perf_stat_command,
    run_perf,
    stage_table,
    where_time_goes,
)
from infervisor.supervisor.toolkit.provenance import command_line, measured_on, served


def _wait_profile(runtime_dir: Path, model: str, seq: int, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = control_request(runtime_dir, {"cmd": "status"})
        for worker in status["models"][model]["workers"]:
            report = worker.get("last_profile")
            if report and report.get("seq") == seq:
                return dict(report)
        time.sleep(0.2)
    return None


def _profile(
    runtime_dir: Path, endpoint: str, model: str, inputs: dict[str, Any], requests: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Ask one worker to profile, feed it that many requests (every worker gets some), collect its report."""
    started = control_request(runtime_dir, {"cmd": "profile", "model": model, "requests": requests})
    if not started.get("ok"):
        return started, None
    status = control_request(runtime_dir, {"cmd": "status"})
    workers = max(1, sum(1 for w in status["models"][model]["workers"] if w["state"] == "serving"))
    with Client(endpoint) as client:
        for _ in range(requests * workers):
            try:
                client.infer(model, inputs, timeout=30)
            except InferenceError:
                continue
    return started, _wait_profile(runtime_dir, model, int(started["seq"]), 30.0)


def format_report(report: dict[str, Any]) -> str:
    """Stages, counters, operators, and the one-line answer."""
    table = report["stages"]
    lines = [f"{report['samples']} requests at {report['qps']:g} QPS for {report['duration_s']:g} s, "
             f"{report['errors']} errors", "",
             f"{'stage':<11} {'P50 ms':>9} {'P99 ms':>9} {'P99.9 ms':>9}  what"]  # fmt: skip
    for stage in (*STAGES, "round_trip"):
        row = table[stage]
        lines.append(
            f"{stage:<11} {row['p50_ms']:>9.3f} {row['p99_ms']:>9.3f} {row['p99.9_ms']:>9.3f}  "
            f"{STAGE_MEANING.get(stage, 'client send -> client receive')}"
        )
    lines += ["", f"where the time goes: {report['verdict']}", ""]
    counters = report["counters"]
    if counters.get("available"):
        lines.append(
            f"hardware counters (workers): IPC {counters['ipc']}, cache-miss rate {counters['cache_miss_rate']}, "
            f"branch-miss rate {counters['branch_miss_rate']}"
        )
    else:
        lines.append(f"hardware counters: not available: {counters['why']}")
    profile = report.get("operators")
    if profile:
        where = f"worker pid {report['profiled_pid']} over {report['profiled_requests']} requests"
        lines += ["", f"torch.profiler in {where}:", f"  {'self ms':>9} {'total ms':>9} {'calls':>6}  operator"]
        lines += [
            f"  {op['self_ms']:>9.3f} {op['total_ms']:>9.3f} {op['calls']:>6}  {op['name']}" for op in profile[:10]
        ]
    else:
        lines.append("torch.profiler: no report from the worker (it served fewer requests than asked?)")
    return "\n".join(lines)


def run_probe(args: argparse.Namespace) -> int:
    """Probe, print, write JSON; exit 2 when the daemon or the model is not there."""
    runtime_dir = resolve_runtime_dir(args.runtime_dir, None)
    try:
        model = model_status(runtime_dir, args.model)
    except ControlError as exc:
        print(f"infervisor probe: {exc}")
        return 2
    pids = [w["pid"] for w in model["workers"] if w["state"] == "serving"]
    if not pids:
        print(f"infervisor probe: {args.model} has no serving worker")
        return 2
    perf = run_perf(perf_stat_command(pids, args.duration))
    inputs = random_inputs(model["inputs"], args.batch)
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    samples, errors = paced_load(endpoint, args.model, inputs, args.qps, args.duration, args.clients)
    counters: dict[str, Any] = {"available": False, "why": "perf is not installed"}
    if perf is not None:
        _, stderr = perf.communicate(timeout=args.duration + 30)
        counters = parse_perf_stat(stderr)
    # The profiler runs after the timed load: starting it stalls the worker, and its overhead would be timed.
    started, operators = _profile(runtime_dir, endpoint, args.model, inputs, args.profile_requests)
    if not samples:
        print(f"infervisor probe: no request succeeded ({errors} errors)")
        return 1
    table = stage_table(samples)
    report = {
        "model": args.model, "qps": args.qps, "clients": args.clients, "batch": args.batch,
        "duration_s": args.duration, "samples": len(samples), "errors": errors,
        "command": command_line({"--runtime-dir": str(runtime_dir.resolve())}),
        "measured_on": measured_on(), "served": served(model),
        "stages": table, "verdict": where_time_goes(table), "counters": counters,
        "operators": operators["operators"] if operators else None,
        "profiled_pid": started.get("pid"), "profiled_requests": operators["requests"] if operators else 0,
        "round_trip_ms": [round(s.stages()["round_trip"], 4) for s in samples],
    }  # fmt: skip
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
