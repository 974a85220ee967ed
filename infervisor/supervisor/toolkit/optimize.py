"""The precision-budget trade (seed 2, section 4) on measured rows: rank, choose a profile and a layout, judge
against the SLA, write the chain and the layout.

Torch-free: the rows and points come from `python -m infervisor.worker.bench` children (sweep.py) and the
final check from a real daemon (check.py); this module only decides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infervisor.common.accuracy import cosine_text
from infervisor.common.profiles import REFERENCE_PROFILE
from infervisor.supervisor.toolkit.check import DaemonCheck
from infervisor.supervisor.toolkit.constraints import Accuracy, Sla
from infervisor.supervisor.toolkit.sweep import Point


@dataclass(frozen=True)
class Verdict:
    """Whether the SLA holds on this box, with which profile and layout, and why not otherwise."""

    met: bool
    profile: str | None
    reasons: list[str]
    #: "WxC" of the layout that meets it (None when none does).
    layout: str | None = None
    #: Why nothing measured can say yes or no: the daemon check the SLA rests on could not run (None: it ran,
    #: or was not asked for).
    unproven: str | None = None
    #: Where the answer is within the noise of the figures it rests on (another run may answer otherwise), and
    #: what would decide it; empty: every figure it rests on is clear of its bound by more than its spread.
    noise: tuple[str, ...] = ()

    @property
    def outcome(self) -> str:
        """ "met", "not met" or "unproven: WHY": the one-word answer optimize prints and the JSON records."""
        if self.unproven is not None:
            return f"unproven: {self.unproven}"
        return "met" if self.met else "not met"


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


def _cold_ms(row: dict[str, Any]) -> float:
    return 1000.0 * (row.get("restart_s") or row.get("cold_start_s") or 0.0)


def misses(point: Point, row: dict[str, Any], sla: Sla) -> list[str]:
    """What of the SLA one profile at one layout misses, as measured in process (empty: it meets it)."""
    found = []
    if point.p99_ms > sla.p99_ms:
        found.append(f"P99 {point.p99_ms:.2f} ms > {sla.p99_ms:g} ms")
    if point.qps < sla.min_qps:
        found.append(f"{point.qps:.1f} QPS with {point.layout} < {sla.min_qps:g}")
    if _cold_ms(row) > sla.cold_start_ms:
        found.append(f"cold start {_cold_ms(row):.0f} ms > {sla.cold_start_ms:g} ms")
    return found


#: The least two runs of one figure are taken to differ by (a relative spread below it is not believed).
NOISE_FLOOR = 0.1


def noise(point: Point) -> float:
    """How far another run of this point's QPS may land either way, relative: half its windows' range (at least
    half of NOISE_FLOOR)."""
    return max(point.qps_spread, NOISE_FLOOR) / 2.0


def _ties(points: list[Point], best: Point) -> list[Point]:
    """The points whose QPS range overlaps `best`'s: any of them may come out on top in another run."""
    return [p for p in points if abs(p.qps - best.qps) <= p.qps * noise(p) + best.qps * noise(best)]


def _steady(points: list[Point]) -> Point:
    """Among points within each other's noise, the same one every run: the first profile measured, then the
    layout with the most cores per worker (the lowest latency a request sees), then the most workers (the most
    room under load)."""
    order = {profile: index for index, profile in enumerate(dict.fromkeys(p.profile for p in points))}
    return min(points, key=lambda p: (order[p.profile], -p.layout.cores_per_worker, -p.layout.workers))


def _best(points: list[Point], sla: Sla) -> Point:
    """The P99 bound first, then throughput: the most QPS among the points within the P99 bound, else the lowest P99;
    among points whose QPS is within the noise of the most, the steady choice (_steady)."""
    within = [p for p in points if p.p99_ms <= sla.p99_ms]
    if within:
        top = max(within, key=lambda p: (p.qps, -p.p99_ms))
        return _steady(_ties(within, top))
    return min(points, key=lambda p: (p.p99_ms, -p.qps))


def _close(value: float, bound: float, spread: float) -> bool:
    return bound not in (0.0, float("inf")) and abs(value - bound) <= bound * max(spread, NOISE_FLOOR)


#: The start of a note on an in-process figure against a bound: moot once the daemon check has judged the SLA.
IN_PROCESS = "in process: "


def noise_notes(points: list[Point], chosen: Point, sla: Sla, seconds: float) -> tuple[str, ...]:
    """What of the choice and the verdict another run could answer otherwise, and what would decide it."""
    notes = []
    if _close(chosen.p99_ms, sla.p99_ms, chosen.p99_spread):
        notes.append(f"{IN_PROCESS}P99 {chosen.p99_ms:.2f} ms (spread {chosen.p99_spread:.0%}) is within the noise "
                     f"of the {sla.p99_ms:g} ms bound")  # fmt: skip
    if _close(chosen.qps, sla.min_qps, chosen.qps_spread):
        notes.append(f"{IN_PROCESS}{chosen.qps:.1f} QPS (spread {chosen.qps_spread:.0%}) is within the noise of the "
                     f"{sla.min_qps:g} QPS minimum")  # fmt: skip
    rivals = [p for p in _ties([p for p in points if p.p99_ms <= sla.p99_ms], chosen) if p != chosen]
    if rivals:
        named = ", ".join(f"{p.profile} {p.layout} ({p.qps:.1f} QPS)" for p in rivals)
        notes.append(f"{named} within the noise of the chosen {chosen.qps:.1f} QPS: the steady choice among them is "
                     "the first profile measured, then the most cores per worker, then the most workers")  # fmt: skip
    if any(n.startswith(IN_PROCESS) for n in notes):
        notes.append(f"{IN_PROCESS}to decide: measure longer (--seconds {2 * seconds:g} --check-seconds 20: more "
                     "windows narrow the spread) on a quiet box, or agree the bound with this margin")  # fmt: skip
    return tuple(notes)


def choose(
    points: list[Point], rows: dict[str, dict[str, Any]], sla: Sla, budget: Accuracy
) -> tuple[Point | None, Verdict]:
    """The profile and layout to serve, and whether they meet the SLA (in process); None when no profile is in budget.

    Among the points that meet everything, the most QPS; when none does, the best effort by the
    same order (the P99 bound first, then QPS), with each profile's reasons. A suspect point (its figures
    contradict the idle worker's) is never chosen.
    """
    inside = [p for p in points if within_budget(rows[p.profile], budget) is None and p.suspect is None]
    if not inside:
        suspect = [f"{p.profile} {p.layout}: {p.suspect}" for p in points if p.suspect is not None]
        why = "no profile stays within the accuracy budget"
        return None, Verdict(False, None, [f"{why} with figures that hold", *suspect] if suspect else [why])
    meeting = [p for p in inside if not misses(p, rows[p.profile], sla)]
    if meeting:
        best = _best(meeting, sla)
        return best, Verdict(True, best.profile, [], str(best.layout))
    reasons = []
    for profile in dict.fromkeys(p.profile for p in inside):
        own = _best([p for p in inside if p.profile == profile], sla)
        reasons.append(f"{profile} (best at {own.layout}): {'; '.join(misses(own, rows[profile], sla))}")
    return _best(inside, sla), Verdict(False, None, reasons)


def judge_check(verdict: Verdict, result: DaemonCheck, sla: Sla, chosen: str) -> Verdict:
    """The verdict once the daemon has served the choice: its P99 under the paced load and its saturated QPS count,
    provided its workers served the chosen profile (else the check measured something else)."""
    reasons = []
    served = sorted(set(result.profiles))
    if served != [chosen]:
        reasons.append(f"through the daemon: workers served {', '.join(served)}, not the chosen {chosen}")
    noise = [note for note in verdict.noise if not note.startswith(IN_PROCESS)]
    if _close(result.p99_ms, sla.p99_ms, 0.0):
        noise.append(f"through the daemon: P99 {result.p99_ms:.2f} ms is within {NOISE_FLOOR:.0%} of the "
                     f"{sla.p99_ms:g} ms bound; to decide: --check-seconds 30 on a quiet box")  # fmt: skip
    verdict = dataclasses.replace(verdict, noise=tuple(noise))
    if result.p99_ms > sla.p99_ms:
        reasons.append(f"through the daemon at {result.qps:g} QPS: P99 {result.p99_ms:.2f} ms > {sla.p99_ms:g} ms")
    if result.saturated_qps < sla.min_qps:
        reasons.append(f"through the daemon: {result.saturated_qps:.1f} QPS at saturation < {sla.min_qps:g}")
    if result.errors:
        reasons.append(f"through the daemon: {result.errors} failed requests under {result.qps:g} QPS")
    if not reasons:
        return verdict
    return Verdict(False, None, [*verdict.reasons, *reasons], noise=verdict.noise)


def chain_at(points: list[Point], rows: dict[str, dict[str, Any]], budget: Accuracy, chosen: Point) -> list[str]:
    """The fallback chain: the chosen profile, then every other in budget by P99 at the chosen layout, eager last.

    The chosen profile always leads (a chain the check serves and optimize writes is the one the table marks):
    eager chosen is eager alone.
    """
    if chosen.profile == REFERENCE_PROFILE:
        return [REFERENCE_PROFILE]
    here = sorted(
        (p for p in points if p.layout == chosen.layout and within_budget(rows[p.profile], budget) is None),
        key=lambda p: (p.p99_ms, p.p50_ms),
    )
    chain = dict.fromkeys([chosen.profile, *(p.profile for p in here)])
    return [*(name for name in chain if name != REFERENCE_PROFILE), REFERENCE_PROFILE]
