"""The precision-budget trade (seed 2, section 4) on measured rows: rank, judge against the SLA, write the chain.

Torch-free: the rows come from `python -m worker.bench` children; this module only decides.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any

from common.accuracy import cosine_text
from common.profiles import REFERENCE_PROFILE
from supervisor.toolkit.constraints import Accuracy, Sla


@dataclass(frozen=True)
class Verdict:
    """Whether the SLA holds on this box, with which profile, and why not otherwise."""

    met: bool
    profile: str | None
    reasons: list[str]


def within_budget(row: dict[str, Any], budget: Accuracy) -> str | None:
    """Why a measured row is outside the accuracy budget, or None when it is inside."""
    if "p50_ms" not in row:
        return f"not available here: {row.get('skipped', 'unknown')}"
    if row["cosine"] < budget.min_cosine:
        return f"worst-row cosine {cosine_text(row['cosine'], budget.min_cosine)} < {budget.min_cosine}"
    if budget.max_abs_error is not None and row["max_abs_error"] > budget.max_abs_error:
        return f"max abs error {row['max_abs_error']:.3g} > {budget.max_abs_error}"
    if budget.top1 and not row.get("top1", True):
        return "top-1 differs from eager"
    return None


def rank(rows: list[dict[str, Any]], budget: Accuracy) -> list[dict[str, Any]]:
    """The rows inside the budget, fastest P99 first (the SLA is written in P99)."""
    return sorted((r for r in rows if within_budget(r, budget) is None), key=lambda r: (r["p99_ms"], r["p50_ms"]))


def judge(ranked: list[dict[str, Any]], sla: Sla, workers: int) -> Verdict:
    """The first ranked profile that meets P99, QPS (all workers together) and cold start; else why none does."""
    if not ranked:
        return Verdict(False, None, ["no profile stays within the accuracy budget"])
    reasons: list[str] = []
    for row in ranked:
        misses = []
        if row["p99_ms"] > sla.p99_ms:
            misses.append(f"P99 {row['p99_ms']:.2f} ms > {sla.p99_ms:g} ms")
        if row["qps"] * workers < sla.min_qps:
            misses.append(f"{row['qps'] * workers:.1f} QPS with {workers} worker(s) < {sla.min_qps:g}")
        cold_ms = 1000.0 * (row.get("restart_s") or row.get("cold_start_s") or 0.0)
        if cold_ms > sla.cold_start_ms:
            misses.append(f"cold start {cold_ms:.0f} ms > {sla.cold_start_ms:g} ms")
        if not misses:
            return Verdict(True, row["profile"], [])
        reasons.append(f"{row['profile']}: {'; '.join(misses)}")
    return Verdict(False, None, reasons)


def chain_of(ranked: list[dict[str, Any]]) -> list[str]:
    """The fallback chain to serve: every profile inside the budget, fastest first, eager last."""
    chain = [r["profile"] for r in ranked if r["profile"] != REFERENCE_PROFILE]
    return [*chain, REFERENCE_PROFILE]


def rewrite(text: str, model: str, changes: dict[str, Any]) -> tuple[str, str]:
    """config.json text with the model entry updated, and the unified diff from the old text."""
    raw = json.loads(text)
    raw["models"][model].update(changes)
    new = json.dumps(raw, indent=2) + "\n"
    diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), "config.json", "config.json"))
    return new, diff
