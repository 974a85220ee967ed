"""One self-contained HTML report a customer can sign: verdict first, then the evidence.

Combines constraints.json, the doctor's checks, and the JSON that optimize, probe and harden wrote.
The charts (latency distribution, P99 and RSS over the soak) need matplotlib (optional extra
`report`); without it the report says so and keeps every number as a table.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from typing import Any

from supervisor.toolkit.constraints import Constraints
from supervisor.toolkit.doctor import Check, Status


@dataclass(frozen=True)
class Evidence:
    """What the report is built from (any part may be missing; the verdict then says so)."""

    constraints: Constraints | None
    doctor: list[Check]
    optimize: dict[str, Any] | None
    probe: dict[str, Any] | None
    harden: list[dict[str, Any]] | None


def verdict(evidence: Evidence) -> tuple[bool, list[str]]:
    """Whether the SLA is met on this box, and every reason it is not (or that something was not measured)."""
    reasons: list[str] = []
    if evidence.constraints is None:
        reasons.append("no constraints.json: there is no SLA to judge against")
    failed = [c.name for c in evidence.doctor if c.status is Status.FAIL]
    if failed:
        reasons.append(f"doctor failed: {', '.join(failed)}")
    if evidence.optimize is None:
        reasons.append("optimize was not run: no profile was measured against the SLA")
    elif not evidence.optimize["verdict"]["met"]:
        reasons.extend(f"optimize: {r}" for r in evidence.optimize["verdict"]["reasons"] or ["the SLA cannot be met"])
    if evidence.harden is None:
        reasons.append("harden was not run: stability is unproven")
    else:
        reasons.extend(f"harden: {r['name']} failed: {r['detail']}" for r in evidence.harden if not r["passed"])
    if evidence.probe is not None and evidence.constraints is not None:
        p99 = evidence.probe["stages"]["round_trip"]["p99_ms"]
        if p99 > evidence.constraints.sla.p99_ms:
            reasons.append(f"probe: round-trip P99 {p99:.2f} ms > {evidence.constraints.sla.p99_ms:g} ms under load")
    return not reasons, reasons


def charts_png(evidence: Evidence) -> bytes | None:
    """Latency distribution, P99 and RSS over the soak as one PNG; None without matplotlib or data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    latencies = (evidence.probe or {}).get("round_trip_ms") or []
    soak = next((r for r in evidence.harden or [] if r["name"] == "soak"), None)
    series = soak["numbers"].get("series", []) if soak else []
    if not latencies and not series:
        return None
    figure, (dist, p99, rss) = plt.subplots(1, 3, figsize=(15, 4))
    if latencies:
        dist.hist(latencies, bins=50)
        dist.set(title="round-trip latency (probe)", xlabel="ms", ylabel="requests")
    times = [s["t_s"] for s in series]
    p99.plot(times, [s["p99_ms"] for s in series], marker="o")
    p99.set(title="P99 per interval (soak)", xlabel="s", ylabel="ms")
    for pid in sorted({pid for s in series for pid in s["rss_mb"]}):
        rss.plot(times, [s["rss_mb"].get(pid) for s in series], marker="o", label=f"pid {pid}")
    rss.set(title="worker RSS (soak)", xlabel="s", ylabel="MB")
    if series:
        rss.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    plt.close(figure)
    return buffer.getvalue()


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render(evidence: Evidence, png: bytes | None) -> str:
    """The HTML document."""
    met, reasons = verdict(evidence)
    chosen = (evidence.optimize or {}).get("verdict", {}).get("profile")
    chain = (evidence.optimize or {}).get("chain")
    parts = ["<!doctype html><meta charset=utf-8><title>infervisor delivery report</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #999;padding:3px 8px}"
             ".met{color:#060}.not{color:#a00}</style>"]  # fmt: skip
    if met:
        parts.append(f"<h1 class=met>VERDICT: SLA met, by profile {html.escape(str(chosen))}</h1>")
    else:
        parts.append("<h1 class=not>VERDICT: SLA not met</h1><ul>")
        parts += [f"<li>{html.escape(r)}</li>" for r in reasons]
        parts.append("</ul>")
    if chain:
        parts.append(f"<p>Fallback chain written to config.json: {html.escape(' → '.join(chain))}</p>")
    if evidence.constraints is not None:
        sla = evidence.constraints.sla
        hw = evidence.constraints.hardware
        parts.append("<h2>Constraints</h2>" + _table(
            ["cpu", "memory MB", "cold start ms", "P99 ms", "min QPS", "uptime h", "accuracy"],
            [[hw.cpu_model, hw.memory_mb, sla.cold_start_ms, sla.p99_ms, sla.min_qps, sla.uptime_hours,
              f"cosine ≥ {sla.accuracy.min_cosine}" + (", top-1" if sla.accuracy.top1 else "")]],
        ))  # fmt: skip
    parts.append("<h2>Doctor</h2>" + _table(
        ["check", "result", "detail", "fix"], [[c.name, c.status.value, c.detail, c.fix] for c in evidence.doctor]
    ))  # fmt: skip
    if evidence.optimize is not None:
        rows = [[r["profile"], r.get("cosine", "-"), r.get("p50_ms", "-"), r.get("p99_ms", "-"), r.get("qps", "-"),
                 r.get("rss_mb", "-"), r.get("cold_start_s", "-"), r.get("restart_s", "-"),
                 r.get("skipped") or r.get("risk", "")] for r in evidence.optimize["rows"]]  # fmt: skip
        headers = ["profile", "cosine", "P50 ms", "P99 ms", "QPS", "RSS MB", "first start s", "restart s", "risk"]
        parts.append("<h2>Optimize</h2>" + _table(headers, rows))
    if evidence.probe is not None:
        stages = evidence.probe["stages"]
        parts.append("<h2>Probe</h2><p>" + html.escape(evidence.probe["verdict"]) + "</p>" + _table(
            ["stage", "P50 ms", "P99 ms", "P99.9 ms"],
            [[s, v["p50_ms"], v["p99_ms"], v["p99.9_ms"]] for s, v in stages.items()],
        ))  # fmt: skip
        counters = evidence.probe["counters"]
        parts.append("<p>Hardware counters: " + html.escape(
            str({k: counters.get(k) for k in ("ipc", "cache_miss_rate", "branch_miss_rate")})
            if counters.get("available") else f"not available: {counters.get('why')}"
        ) + "</p>")  # fmt: skip
        if evidence.probe.get("operators"):
            parts.append(_table(["operator", "calls", "self ms", "total ms"],
                                [[o["name"], o["calls"], o["self_ms"], o["total_ms"]]
                                 for o in evidence.probe["operators"][:10]]))  # fmt: skip
    if evidence.harden is not None:
        parts.append("<h2>Harden</h2>" + _table(
            ["check", "result", "detail"], [[r["name"], "pass" if r["passed"] else "FAIL", r["detail"]]
                                            for r in evidence.harden]
        ))  # fmt: skip
    if png is not None:
        encoded = base64.b64encode(png).decode()
        parts.append(f"<h2>Charts</h2><img alt='latency, P99 and RSS' src='data:image/png;base64,{encoded}'>")
    else:
        parts.append("<p>Charts: not drawn (install the optional extra <code>report</code> for matplotlib, "
                     "and give probe and harden results).</p>")  # fmt: skip
    return "\n".join(parts)
