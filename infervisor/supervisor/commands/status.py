"""`infervisor status`: the running daemon's workers as a table, or its status document as JSON."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import time
from typing import Any

from infervisor.protocol.control_client import ControlError, control_request
from infervisor.supervisor.host.runtime_dir import resolve_runtime_dir


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cpus(cpus: Any) -> str:
    return "-" if not cpus else ",".join(str(c) for c in cpus)


def describe_start(starting: dict[str, Any]) -> str:
    """`building int8_static (profile 1 of 3) for 42 s, 63 s since spawn (start limit counted 12 s)`."""
    profile = starting.get("profile")
    where = f" {profile}" if profile else ""
    if starting.get("index"):
        where += f" (profile {starting['index']} of {starting['count']})"
    return (
        f"{starting['phase']}{where} for {starting['phase_s']:.0f} s, {starting['elapsed_s']:.0f} s since spawn "
        f"(start limit counted {starting['start_counted_s']:.0f} s, builds {starting['build_s']:.0f} s)"
    )


def describe_fallback(name: str, fallback: dict[str, Any]) -> str:
    """One line on a model's fallback: in force (or on its way), from what, why; or what ended the last one."""
    if fallback.get("state") is None:
        return f"model {name} fallback: {fallback.get('note')}"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(fallback["since"])))
    line = (
        f"model {name} fallback {fallback['state']} (since {since}, {fallback['origin']}): profiles "
        f"{', '.join(fallback['profiles'])} instead of {', '.join(fallback['configured'])}, left "
        f"{fallback['from']} ({fallback['reason']}); `infervisor fallback --model {name} --reset` goes back"
    )
    return line + (f"; {fallback['note']}" if fallback.get("note") else "")


def describe_audit(audit: dict[str, Any]) -> str:
    """`412 rows audited, 3 below tolerance, worst cosine 0.9987 (x[1, 8]); process ready pid 812 (budget 0.02)`."""
    process = audit.get("process") or {}
    state = process.get("state", "off")
    where = f"process {state}" + (f" pid {process['pid']}" if process.get("pid") else "")
    if process.get("restarts"):
        where += f", {process['restarts']} restarts (last: {process.get('last_exit')})"
    line = f"{audit.get('summary')}; {where} (budget {audit.get('budget')}, {audit.get('action')})"
    finding = audit.get("last_finding")
    if finding:
        line += f"; last finding: {finding.get('failure')} on row {finding.get('row')} of {finding.get('input_shape')}"
    return line


def format_status(status: dict[str, Any], notes: bool = True) -> str:
    """Human table of a status document (`notes`: with why each worker serves its profile, under the table)."""
    config = status["config"]
    lines = [
        f"infervisor pid {status['pid']}  state {status['state']}  up {status['uptime_s']:.0f} s  "
        f"rss {_mb(status['rss'])} MB  cpus {_cpus(status.get('cpus'))}  config {config['digest']}",
        f"endpoint {status['endpoints']['client']}",
    ]
    # What is wrong comes first: models that do not serve fully, a refused config, a failed rollout.
    for name, model in status["models"].items():
        if model.get("health", "serving") != "serving":
            lines.append(f"model {name} {model['health']}: {model.get('reason') or 'no reason given'}")
        rolled_back = (config.get("models") or {}).get(name, {}).get("error")
        if model.get("error") and model["error"] not in (model.get("reason") or "") and model["error"] != rolled_back:
            lines.append(f"model {name} error: {model['error']}")
        if model.get("fallback"):
            lines.append(describe_fallback(name, model["fallback"]))
    if config.get("last_error"):
        lines.append("config rejected (still serving the last good one): " + "; ".join(config["last_error"]))
    for name, state in (config.get("models") or {}).items():
        if state.get("state") == "failed":
            lines.append(f"config for {name} rolled back: {state.get('error')}")
        elif state.get("state") == "rolling":
            lines.append(f"config for {name} rolling out")
    if status.get("rollout", {}).get("last_error"):
        lines.append(f"last rollout error: {status['rollout']['last_error']}")
    latency = status.get("cpu_latency") or {}
    if latency.get("wanted_us") is not None:
        held = latency.get("held_us")
        why = latency.get("error") or (
            "held" if held is not None else "released while throttling" if latency.get("paused") else "not yet held"
        )
        lines.append(f"cpu latency {latency['wanted_us']} us: {why}")
    header = (
        f"  {'slot':>4} {'pid':>7} {'state':<9} {'cores':<10} {'thr':>3} {'profile':<12} {'rss MB':>7} {'pss MB':>7} "
        f"{'reqs':>7} {'p50 ms':>8} {'p99 ms':>8}  last exit"
    )
    for name, model in status["models"].items():
        errors = ", ".join(f"{k} {v}" for k, v in sorted(model["errors"].items())) or "none"
        lines.append("")
        lines.append(
            f"model {name}: queued {model['queued']}/{model['queue_size']}  completed {model['completed']}  "
            f"p50 {_ms(model['p50_ms'])} ms  p99 {_ms(model['p99_ms'])} ms  errors: {errors}"
        )
        build = model.get("build") or {}
        serving = ", ".join(model.get("serving") or []) or "nothing yet"
        lines.append(f"  serves {serving}" + (f"; {build['summary']}" if build.get("summary") else ""))
        if model.get("audit"):
            lines.append(f"  audit: {describe_audit(model['audit'])}")
        for profile, refusal in (model.get("refusals") or {}).items():
            lines.append(f"  refused on live traffic: {profile} ({refusal.get('why', '')}); `fallback --reset` clears")
        lines.append(header)
        for w in model["workers"]:
            cores = ",".join(str(c) for c in w["cores"])
            lines.append(
                f"  {w['slot']:>4} {w['pid'] or '-':>7} {w['state']:<9} {cores:<10} {w['threads']:>3} "
                f"{w.get('profile') or '-':<12} {_mb(w['rss']):>7} {_mb(w.get('pss')):>7} "
                f"{w['requests']:>7} {_ms(w['p50_ms']):>8} {_ms(w['p99_ms']):>8}  "
                f"{w['last_exit'] or ''}"
            )
            if w.get("starting"):
                lines.append(f"  {'':>4} starting: {describe_start(w['starting'])}")
        if notes:
            lines += _notes_lines(model["workers"])
    return "\n".join(lines)


def _worker_notes(worker: dict[str, Any]) -> list[str]:
    """Why this worker's profile serves: what building it did, why the others of the chain do not, a warning."""
    found = [f"{label}: {note}" for label, key in (("built", "profile_build"), ("skipped", "profile_skipped"))
             for note in worker.get(key) or []]  # fmt: skip
    if worker.get("accuracy_warning"):
        found.append(f"WARNING: {worker['accuracy_warning']}")
    return found


#: A duration inside a note ("built ... in 695 ms"): workers whose notes differ only by these say the same thing.
_DURATION = re.compile(r"\b\d+(?:\.\d+)? (?:ms|s)\b")


def _wrapped(note: str) -> list[str]:
    return textwrap.wrap(note, 116, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False)


def _notes_lines(workers: list[dict[str, Any]]) -> list[str]:
    """The workers' notes under the table, wrapped: once for all when they agree but for durations (the usual case:
    every worker built the same chain), else under each slot."""
    each = [(w["slot"], notes) for w in workers if (notes := _worker_notes(w))]
    if not each:
        return []
    if len({tuple(_DURATION.sub("#", n) for n in notes) for _, notes in each}) == 1:
        first_slot, shared = each[0]
        if len(workers) > 1 and len(each) == len(workers):
            who = "every worker"
        else:
            who = ("slot " if len(each) == 1 else "slots ") + ", ".join(str(s) for s, _ in each)
        times = f" (times of slot {first_slot})" if len(each) > 1 else ""
        return [f"  {who}{times}:", *(line for note in shared for line in _wrapped(note))]
    lines = []
    for slot, notes in each:
        lines += [f"  slot {slot}:", *(line for note in notes for line in _wrapped(note))]
    return lines


#: `status --check` exit statuses, for readiness and liveness probes.
CHECK_EXIT = {"ready": 0, "degraded": 1}
CHECK_NOT_SERVING = 2


def run_status(args: argparse.Namespace) -> int:
    """Print the status of the daemon behind --runtime-dir (with --check: its state line and a probe's exit code)."""
    try:
        status = control_request(resolve_runtime_dir(args.runtime_dir, None), {"cmd": "status"})
    except ControlError as exc:
        print(f"infervisor status: {exc}", file=sys.stderr)
        return CHECK_NOT_SERVING if args.check else 2
    if args.check:
        print(status.get("status") or status["state"])
        return CHECK_EXIT.get(status["state"], CHECK_NOT_SERVING)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
