"""The three probes of seed 2, section 3, as data: per-stage timings, hardware counters, framework operators.

Torch-free: stage timings come from the reply's `timing` (worker and broker clocks are the host's
CLOCK_MONOTONIC, so a same-host client splits its own round trip), counters from `perf stat`, and
operators from a serving worker's torch.profiler report (the control command `profile`).
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Stages in the order a request goes through them.
STAGES = ("send", "queue", "dispatch", "decode", "model", "encode", "reply")
STAGE_MEANING = {
    "send": "client send -> broker accept",
    "queue": "waiting in the broker's queue",
    "dispatch": "broker -> worker receive (and its pipeline)",
    "decode": "worker: checks and tensor views",
    "model": "worker: forward pass",
    "encode": "worker: output descriptors",
    "reply": "worker -> broker -> client receive",
}
_EVENTS = ("cycles", "instructions", "cache-references", "cache-misses", "branches", "branch-misses")


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it, with the server's timing."""

    sent_clock_ms: float
    received_clock_ms: float
    timing: dict[str, float]

    def stages(self) -> dict[str, float]:
        """Milliseconds per stage, summing to the round trip."""
        t = self.timing
        accepted = t["accepted_clock_ms"]
        return {
            "send": accepted - self.sent_clock_ms,
            "queue": t["queue_ms"],
            "dispatch": t["dispatch_ms"],
            "decode": t["decode_ms"],
            "model": t["model_ms"],
            "encode": t["encode_ms"],
            "reply": self.received_clock_ms - accepted - t["total_ms"],
            "round_trip": self.received_clock_ms - self.sent_clock_ms,
        }


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))]


def stage_table(samples: Sequence[Sample]) -> dict[str, dict[str, float]]:
    """P50/P99/P99.9 per stage and of the round trip."""
    per_stage: dict[str, list[float]] = {}
    for sample in samples:
        for stage, ms in sample.stages().items():
            per_stage.setdefault(stage, []).append(ms)
    return {
        stage: {f"p{q:g}_ms": round(quantile(values, q), 4) for q in (50, 99, 99.9)}
        for stage, values in per_stage.items()
    }


def where_time_goes(table: dict[str, dict[str, float]]) -> str:
    """One sentence: the stage with the largest median, and its share of the median round trip."""
    stage = max(STAGES, key=lambda s: table[s]["p50_ms"])
    share = table[stage]["p50_ms"] / max(table["round_trip"]["p50_ms"], 1e-9)
    tail = max(STAGES, key=lambda s: table[s]["p99_ms"] - table[s]["p50_ms"])
    return (
        f"{stage} ({STAGE_MEANING[stage]}) takes {share:.0%} of the median round trip; "
        f"the widest tail is {tail} (P99 - P50 = {table[tail]['p99_ms'] - table[tail]['p50_ms']:.3f} ms)"
    )


def perf_stat_command(pids: Sequence[int], seconds: float) -> list[str] | None:
    """The perf stat command counting the workers for `seconds`, or None when perf is not installed."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    return [perf, "stat", "-x,", "-e", ",".join(_EVENTS), "-p", ",".join(map(str, pids)), "--", "sleep", f"{seconds:g}"]


def parse_perf_stat(output: str) -> dict[str, Any]:
    """IPC, cache-miss and branch-miss rates from `perf stat -x,` output, or why they are not available."""
    counts: dict[str, float] = {}
    unsupported: list[str] = []
    for line in output.splitlines():
        fields = line.split(",")
        if len(fields) < 3 or fields[2] not in _EVENTS:
            continue
        if fields[0].startswith("<"):
            unsupported.append(f"{fields[2]} {fields[0]}")
            continue
        try:
            counts[fields[2]] = float(fields[0])
        except ValueError:
            unsupported.append(f"{fields[2]} unreadable")
    if unsupported or not counts:
        return {
            "available": False,
            "why": "hardware counters are not exposed here (" + (", ".join(unsupported) or "no output") + ")"
            "; a VM without a virtual PMU, or perf_event_paranoid, hides them",
        }

    def ratio(a: str, b: str) -> float | None:
        return round(counts[a] / counts[b], 4) if counts.get(b) else None

    return {
        "available": True,
        "ipc": ratio("instructions", "cycles"),
        "cache_miss_rate": ratio("cache-misses", "cache-references"),
        "branch_miss_rate": ratio("branch-misses", "branches"),
        "counts": counts,
    }


def run_perf(command: list[str] | None) -> subprocess.Popen[str] | None:
    """Start perf stat in the background (None when perf is missing)."""
    if command is None:
        return None
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
