"""One self-contained HTML report a customer can sign: the verdict first, then what it rests on and what it does not.

Combines constraints.json, the doctor's checks, and the JSON that optimize, probe and harden wrote. Three
outcomes: the SLA met, not met (with the failed figures), or unproven (with what is missing). Every figure
says what it is (per worker or total, in process or through the daemon, at what rate and layout), and each
section prints the command that repeats it. The charts need matplotlib (optional extra `report`); without
it the report says so and keeps every number as a table.
"""

from __future__ import annotations

import base64
import html
import io
import shlex
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from infervisor.common.accuracy import cosine_text
from infervisor.common.profiles import PROFILES
from infervisor.supervisor.toolkit.constraints import Constraints
from infervisor.supervisor.toolkit.doctor import Check, Status
from infervisor.supervisor.toolkit.provenance import infervisor_command


class Outcome(Enum):
    """The three answers a report can give; the value is `infervisor report`'s exit code (2: unreadable inputs)."""

    MET = 0
    NOT_MET = 1
    UNPROVEN = 3


@dataclass(frozen=True)
class Evidence:
    """What the report is built from (any part may be missing; the verdict then says so)."""

    constraints: Constraints | None
    doctor: list[Check]
    optimize: dict[str, Any] | None
    probe: dict[str, Any] | None
    #: harden's document ({"results": [...], "served": ...}); a bare list of results is read as one without the rest.
    harden: dict[str, Any] | list[dict[str, Any]] | None
    #: Where the report itself was made: `provenance.measured_on()` of this box.
    here: dict[str, Any] = field(default_factory=dict)
    #: Identity of the inputs: paths and sha256 of the config and the constraints.
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """The outcome, the measured figures that fail, what is missing to prove it, and what it does not prove."""

    outcome: Outcome
    failed: list[str]
    missing: list[str]
    not_proven: list[str]


def harden_document(evidence: Evidence) -> dict[str, Any] | None:
    """harden's JSON as a document, whichever of its two shapes was given."""
    if evidence.harden is None:
        return None
    if isinstance(evidence.harden, list):
        return {"results": evidence.harden}
    return evidence.harden


def layout_text(workers: int | None, cores: int | None) -> str:
    """ "2 workers × 1 core" (the words the whole report uses for a layout)."""
    if workers is None or cores is None:
        return "an unrecorded layout"
    return f"{workers} worker{'s' if workers != 1 else ''} × {cores} core{'s' if cores != 1 else ''} each"


def _layout_of(text: str | None) -> tuple[int, int] | None:
    if not text or "x" not in text:
        return None
    workers, cores = text.split("x", 1)
    return int(workers), int(cores)


def _chosen(evidence: Evidence) -> tuple[list[str], tuple[int, int]] | None:
    """optimize's chain and layout (workers, cores per worker), when it chose one."""
    optimize = evidence.optimize
    if not optimize or not optimize.get("chain") or not optimize.get("layout"):
        return None
    layout = optimize["layout"]
    return list(optimize["chain"]), (int(layout["workers"]), int(layout["cores_per_worker"]))


def _served_text(served: dict[str, Any]) -> str:
    profiles = served.get("profiles") or []
    serving = f", workers serving {', '.join(profiles)}" if profiles else ""
    return f"{' → '.join(served['chain'])} on {layout_text(served.get('workers'), served.get('cores_per_worker'))}"\
        f"{serving}"  # fmt: skip


def _duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _measured_cpus(evidence: Evidence) -> dict[str, str]:
    """The CPU each part was measured on (the report's own box when the JSON does not record it)."""
    here = str(evidence.here.get("cpu_model", "unknown"))
    found = {"doctor": here}
    harden = harden_document(evidence)
    for name, document in (("optimize", evidence.optimize), ("probe", evidence.probe), ("harden", harden)):
        if document is not None:
            found[name] = str((document.get("measured_on") or {}).get("cpu_model", here))
    return found


def _failed(evidence: Evidence) -> list[str]:
    """Measured figures that break the SLA, each with its numbers."""
    failed = [f"doctor: {c.name} failed: {c.detail}" for c in evidence.doctor if c.status is Status.FAIL]
    # An unproven optimize (its daemon check could not run) measured nothing that breaks the SLA: it is missing.
    optimize_verdict = (evidence.optimize or {}).get("verdict") or {}
    if evidence.optimize is not None and not optimize_verdict["met"] and not optimize_verdict.get("unproven"):
        reasons = optimize_verdict["reasons"] or ["the SLA cannot be met"]
        failed += [f"optimize: {r}" for r in reasons]
    harden = harden_document(evidence)
    for result in (harden or {}).get("results", []):
        if result.get("measured", True) and not result["passed"]:
            failed.append(f"harden: {result['name']} failed: {result['detail']}")
    if evidence.probe is not None and evidence.constraints is not None:
        p99 = evidence.probe["stages"]["round_trip"]["p99_ms"]
        limit = evidence.constraints.sla.p99_ms
        if p99 > limit:
            failed.append(f"probe: round-trip P99 {p99:.2f} ms > {limit:g} ms, through the daemon at "
                          f"{evidence.probe.get('qps', 0):g} QPS offered")  # fmt: skip
    return failed


def _missing(evidence: Evidence) -> list[str]:
    """What the SLA needs proven that these inputs do not prove."""
    missing = []
    if evidence.constraints is None:
        missing.append("no constraints.json: there is no SLA to judge against")
    if evidence.optimize is None:
        missing.append("optimize was not run: no profile was measured against the SLA")
    elif evidence.optimize.get("check") is None:
        missing.append(_unchecked(evidence.optimize))
    harden = harden_document(evidence)
    if harden is None:
        missing.append("harden was not run: stability (polluted input, memory pressure, chaos, soak) is unproven")
    chosen = _chosen(evidence)
    for name, document in (("probe", evidence.probe), ("harden", harden)):
        if document is None or chosen is None:
            continue
        served = document.get("served")
        if served is None:
            missing.append(f"{name} did not record which chain and layout it measured (an older infervisor)")
        elif (served["chain"], (served["workers"], served["cores_per_worker"])) != (chosen[0], chosen[1]):
            missing.append(f"{name} measured a daemon serving {_served_text(served)}, not optimize's choice "
                           f"{' → '.join(chosen[0])} on {layout_text(*chosen[1])}")  # fmt: skip
    target = evidence.constraints.hardware.cpu_model if evidence.constraints else None
    if target:
        others = sorted({cpu for cpu in _measured_cpus(evidence).values() if cpu != target})
        if others:
            missing.append(f"the figures come from {', '.join(others)}; the constraints name {target}: "
                           "figures from another CPU model do not carry over, measure on the target box")  # fmt: skip
    return missing


def _unchecked(optimize: dict[str, Any]) -> str:
    """Why optimize's choice was never measured through a daemon, as its JSON records it."""
    if optimize.get("check_error"):
        kept = f" (its log: {optimize['check_log']})" if optimize.get("check_log") else ""
        return (f"optimize's daemon check could not run: {optimize['check_error']}{kept}; the chosen chain's P99 was "
                "measured in process only")  # fmt: skip
    if optimize.get("checked") is False:
        return "optimize ran with --no-check: the chosen chain's P99 was measured in process only, never through " \
            "the daemon"  # fmt: skip
    if optimize.get("chain") is None:
        return "optimize chose no chain, so nothing was checked through a daemon"
    return "optimize's JSON records no daemon check (an older optimize): the chosen chain's P99 is in-process only"


def _not_proven(evidence: Evidence) -> list[str]:
    """What the collected evidence does not show, even where it passed."""
    notes = []
    sla = evidence.constraints.sla if evidence.constraints else None
    harden = harden_document(evidence)
    soak = next((r for r in (harden or {}).get("results", []) if r["name"] == "soak"), None)
    if soak is not None and sla is not None and sla.uptime_hours > 0:
        seconds = soak["numbers"].get("seconds")
        ran = _duration_text(float(seconds)) if seconds is not None else "an unrecorded time"
        notes.append(f"uptime: the soak ran {ran} against an uptime target of {sla.uptime_hours:g} h; it shows no "
                     "leak or drift "
                     "over that time only (the method's soak is 72 h: harden --duration 259200)")  # fmt: skip
    for result in (harden or {}).get("results", []):
        if not result.get("measured", True):
            notes.append(f"{result['name']}: {result['detail']}")
    if evidence.probe is None:
        notes.append("probe was not run: no per-stage timing of the served model")
    else:
        if not evidence.probe.get("operators"):
            notes.append("operators: probe's torch.profiler returned no report, so where the model's time goes by "
                         "operator is not shown")  # fmt: skip
        counters = evidence.probe.get("counters") or {}
        if not counters.get("available"):
            notes.append(f"hardware counters (IPC, cache and branch misses) not measured: {counters.get('why')}")
    synthetic = [
        r["profile"]
        for r in (evidence.optimize or {}).get("rows", [])
        if "cosine" in r and r.get("checked_on") != "validation set"
        and (declared := PROFILES.get(r["profile"])) is not None and declared.changes_numerics
    ]  # fmt: skip
    if synthetic:
        notes.append(f"accuracy: {', '.join(synthetic)} change numerics and were judged on seeded random inputs, "
                     "without a validation set; agreement with eager on real inputs is not measured "
                     "(optimize --validation FILE.npz)")  # fmt: skip
    if sla is not None and evidence.optimize is not None:
        chain = set(evidence.optimize.get("chain") or [])
        slow = [r for r in evidence.optimize["rows"] if r["profile"] in chain
                and 1000.0 * (r.get("cold_start_s") or 0.0) > sla.cold_start_ms]  # fmt: skip
        if slow:
            starts = ", ".join(f"{r['profile']} {r['cold_start_s']:.1f} s" for r in slow)
            cached = [r["profile"] for r in slow if (_restart_s(r) or 0.0) * 1000.0 <= sla.cold_start_ms]
            note = f"cold start: a first start (nothing compiled or cached yet) takes {starts}, over the " \
                f"{sla.cold_start_ms:g} ms constraint"  # fmt: skip
            if cached:
                note += f"; {', '.join(cached)} meet it only on a restart that loads the cached compiled package"
            notes.append(note)
    cpus = _measured_cpus(evidence)
    if len(set(cpus.values())) > 1:
        notes.append("the parts were measured on different CPUs: " + ", ".join(f"{k} on {v}" for k, v in cpus.items()))
    return notes


def verdict(evidence: Evidence) -> Verdict:
    """Not met when a measured figure fails; else unproven when evidence is missing; else met."""
    failed, missing = _failed(evidence), _missing(evidence)
    outcome = Outcome.NOT_MET if failed else Outcome.UNPROVEN if missing else Outcome.MET
    return Verdict(outcome, failed, missing, _not_proven(evidence))


@dataclass(frozen=True)
class Chart:
    """One PNG of the report."""

    name: str
    caption: str
    png: bytes


def charts(evidence: Evidence) -> list[Chart] | None:
    """The charts that have data (latency distribution; P99 and RSS over the soak); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None

    def png(figure: Any) -> bytes:
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        plt.close(figure)
        return buffer.getvalue()

    drawn = []
    probe = evidence.probe or {}
    latencies = probe.get("round_trip_ms") or []
    sla_p99 = evidence.constraints.sla.p99_ms if evidence.constraints else None
    if latencies:
        figure, axes = plt.subplots(figsize=(7, 3))
        axes.hist(latencies, bins=50)
        axes.set(xlabel="round-trip ms", ylabel="requests")
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        caption = (f"Round-trip latency of {len(latencies)} requests through the daemon at {probe.get('qps', 0):g} "
                   "QPS offered (probe)")  # fmt: skip
        drawn.append(Chart("latency", caption, png(figure)))
    soak = next((r for r in (harden_document(evidence) or {}).get("results", []) if r["name"] == "soak"), None)
    series = soak["numbers"].get("series", []) if soak else []
    times = [s["t_s"] for s in series]
    p99s = [s["p99_ms"] for s in series]
    if any(p is not None for p in p99s):
        figure, axes = plt.subplots(figsize=(7, 3))
        axes.plot(times, p99s, marker="o", label="P99 per interval")
        if sla_p99 is not None:
            axes.axhline(sla_p99, color="#a00", linestyle="--", label=f"SLA P99 {sla_p99:g} ms")
        top = max([p for p in p99s if p is not None] + ([sla_p99] if sla_p99 is not None else []))
        axes.set(xlabel="seconds into the soak", ylabel="ms", ylim=(0, top * 1.2))
        axes.legend(loc="best")
        drawn.append(Chart("soak-p99", "P99 per interval over the soak, through the daemon (harden)", png(figure)))
    pids = sorted({pid for s in series for pid in s["rss_mb"]})
    if pids:
        figure, axes = plt.subplots(figsize=(7, 3))
        for pid in pids:
            axes.plot(times, [s["rss_mb"].get(pid) for s in series], marker="o", label=f"worker pid {pid}")
        axes.set(xlabel="seconds into the soak", ylabel="RSS MB")
        axes.legend(loc="best")
        drawn.append(Chart("soak-rss", "Resident memory of each worker over the soak (harden)", png(figure)))
    return drawn


def _table(headers: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f"<tr{f' class={classes[i]}' if classes and classes[i] else ''}>"
        + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )  # fmt: skip
    return f"<table><tr>{head}</tr>{body}</table>"


def _program() -> str:
    """The infervisor that makes this report, as a shell word that runs it again (not a bare name off PATH)."""
    return shlex.join(infervisor_command())


def _command(text: str) -> str:
    return f"<p class=repeat>Repeat: <code>{html.escape(text)}</code></p>"


_STYLE = """
body{font-family:sans-serif;max-width:1100px;margin:1.5em auto;padding:0 1em;line-height:1.35}
table{border-collapse:collapse;margin:.6em 0;max-width:100%}td,th{border:1px solid #999;padding:3px 7px;
vertical-align:top;text-align:left}th{background:#eee}
.met{color:#060}.not{color:#a00}.unproven{color:#a60}tr.miss td{color:#a00}
img{max-width:100%;height:auto;display:block}figure{margin:1em 0}figcaption{font-size:90%;color:#444}
code{overflow-wrap:anywhere}.repeat{font-size:90%;color:#333}
@media print{body{max-width:none;margin:0;padding:0;font-size:10pt}figure,table{break-inside:avoid}
h2{break-after:avoid}}
"""


def _verdict_html(evidence: Evidence, found: Verdict) -> list[str]:
    chosen = _chosen(evidence)
    optimize = evidence.optimize or {}
    picked = (optimize.get("chosen") or {}).get("profile") or optimize["verdict"].get("profile") if chosen else None
    choice = (f"profile {picked or chosen[0][0]} (chain {' → '.join(chosen[0])}) on "
              f"{layout_text(*chosen[1])}") if chosen else "no chosen profile"  # fmt: skip
    target = evidence.constraints.hardware.cpu_model if evidence.constraints else None
    measured = sorted(set(_measured_cpus(evidence).values()))
    parts = []
    if found.outcome is Outcome.MET:
        parts.append(f"<h1 class=met>VERDICT: SLA met, by {html.escape(choice)}</h1>")
    elif found.outcome is Outcome.NOT_MET:
        parts.append("<h1 class=not>VERDICT: SLA not met</h1><p>These measured figures break it:</p><ul>")
        parts += [f"<li>{html.escape(r)}</li>" for r in found.failed]
        parts.append("</ul>")
    else:
        parts.append("<h1 class=unproven>VERDICT: SLA unproven</h1>"
                     "<p>No measured figure breaks it, but this is missing to prove it:</p><ul>")  # fmt: skip
        parts += [f"<li>{html.escape(r)}</li>" for r in found.missing]
        parts.append("</ul>")
    if found.outcome is Outcome.NOT_MET and found.missing:
        parts.append("<p>Also missing to prove it:</p><ul>" + "".join(
            f"<li>{html.escape(r)}</li>" for r in found.missing) + "</ul>")  # fmt: skip
    facts = [f"Measured on {', '.join(measured)}" + (f"; the constraints name {target}." if target else ".")]
    if chosen:
        facts.append(f"optimize chose {choice}.")
        if optimize.get("measured_at"):
            facts.append(f"Its figures were measured at {optimize['measured_at']}.")
        facts += [f"Within the noise: {note}." for note in optimize["verdict"].get("noise") or []]
        if optimize.get("written_to"):
            facts.append(f"That chain and layout were written to {optimize['written_to']}.")
        elif optimize.get("not_written"):
            facts.append(f"Nothing was written: {optimize['not_written']}.")
        else:
            facts.append("Whether config.json was written is not recorded (an older optimize).")
    harden = harden_document(evidence)
    for name, document in (("probe", evidence.probe), ("harden", harden)):
        if document is not None and document.get("served"):
            facts.append(f"{name} measured the daemon serving {_served_text(document['served'])}.")
    parts.append("<p>What was measured, and what was written:</p><ul class=facts>"
                 + "".join(f"<li>{html.escape(f)}</li>" for f in facts) + "</ul>")  # fmt: skip
    return parts


def _identity_html(evidence: Evidence) -> str:
    here = evidence.here
    inputs = evidence.inputs
    rows = [
        ["report made", f"{here.get('at', '-')} on host {here.get('host', '-')}"],
        ["CPU model (this box)", here.get("cpu_model", "-")],
        ["infervisor", f"{here.get('infervisor') or '-'}, commit {here.get('commit') or 'not available'}"],
        ["torch", here.get("torch") or "not installed"],
        [
            "config",
            f"{inputs.get('config', '-')} sha256 {inputs.get('config_sha256', '-')}"
            + (f" (from {inputs['config_from']})" if inputs.get("config_from") else ""),
        ],
        ["constraints", f"{inputs.get('constraints') or 'none'} sha256 {inputs.get('constraints_sha256') or '-'}"],
    ]
    harden = harden_document(evidence)
    for name, document in (("optimize", evidence.optimize), ("probe", evidence.probe), ("harden", harden)):
        on = (document or {}).get("measured_on")
        if on:
            rows.append([f"{name} measured", f"{on.get('at')} on host {on.get('host')}, {on.get('cpu_model')}, "
                         f"infervisor {on.get('infervisor')} commit {on.get('commit') or '-'}, "
                         f"torch {on.get('torch')}"])  # fmt: skip
    return "<h2>Identity</h2>" + _table(["what", "value"], rows)


def _mark(ok: bool, text: str) -> str:
    return f"{'✓' if ok else '✗'} {text}"


def _restart_s(row: dict[str, Any]) -> float | None:
    """A restart's start: the packaged profile's measured one; else the first start (nothing is cached to reuse)."""
    value = row.get("restart_s", row.get("cold_start_s"))
    return float(value) if value is not None else None


def _optimize_html(evidence: Evidence) -> list[str]:
    optimize = evidence.optimize
    if optimize is None:
        return []
    sla = evidence.constraints.sla if evidence.constraints else None
    chosen = _chosen(evidence)
    layout = layout_text(*chosen[1]) if chosen else "the chosen layout"
    chain = set(optimize.get("chain") or [])
    parts = [f"<h2>Optimize: which profile meets which constraint</h2><p>Measured in process "
             f"(python -m infervisor.worker.bench, no daemon), {optimize.get('seconds', '?')} s per profile and "
             f"layout, at {html.escape(layout)}. "
             "P50/P99: one worker alone, one batch-1 request at a time. QPS: the total of all the layout's workers "
             "busy at once. Cold start: from process start to serving; a restart reuses a compiled "
             "package.</p>"]  # fmt: skip
    headers = ["profile", "in chain", "accuracy (cosine vs eager)", "P99 ms, 1 worker, in process",
               f"QPS, total of {layout}", "RSS MB per worker", "first start s", "restart s",
               "risk / why not"]  # fmt: skip
    if sla is not None:
        headers[2] += f" ≥ {sla.accuracy.min_cosine:g}"
        headers[3] += f" ≤ {sla.p99_ms:g}"
        headers[4] += f" ≥ {sla.min_qps:g}"
        headers[6] += f" ≤ {sla.cold_start_ms / 1000:g}"
        headers[7] += f" ≤ {sla.cold_start_ms / 1000:g}"
    rows, classes = [], []
    for row in optimize["rows"]:
        if "p50_ms" not in row:
            rows.append([row["profile"], "no", "-", "-", "-", "-", "-", "-", f"not available: {row.get('skipped')}"])
            classes.append("")
            continue
        cells = [
            cosine_text(row["cosine"], sla.accuracy.min_cosine if sla else None) + f" ({row.get('checked_on', '?')})",
            f"{row['p99_ms']:.2f}", f"{row['qps']:.1f}", f"{row['rss_mb']:.0f}", f"{row.get('cold_start_s') or 0:.1f}",
        ]  # fmt: skip
        restart = _restart_s(row)
        cells.append(f"{restart:.1f}" if restart is not None else "-")
        if sla is not None:
            oks = [row["cosine"] >= sla.accuracy.min_cosine, row["p99_ms"] <= sla.p99_ms, row["qps"] >= sla.min_qps,
                   True, 1000 * (row.get("cold_start_s") or 0) <= sla.cold_start_ms,
                   restart is None or 1000 * restart <= sla.cold_start_ms]  # fmt: skip
            cells = [c if i == 3 else _mark(ok, c) for i, (ok, c) in enumerate(zip(oks, cells, strict=True))]
        rows.append([row["profile"], "yes" if row["profile"] in chain else "no", *cells, row.get("risk", "")])
        classes.append("")
    parts.append(_table(headers, rows, classes))
    check = optimize.get("check")
    if check is not None:
        saturated = f"; saturated {check['saturated_qps']:.1f} QPS total"
        parts.append(f"<p>Checked through a daemon serving the chain on {html.escape(layout)} (workers serving "
                     f"{html.escape(', '.join(check['profiles']))}): {check['qps']:g} QPS offered by "
                     f"{check['clients']} "
                     f"clients for {check['seconds']:g} s, {check['samples']} requests: P50 {check['p50_ms']:.2f} ms, "
                     f"P99 {check['p99_ms']:.2f} ms, {check['errors']} errors{saturated}. This P99 is the one the "
                     "promise rests on.</p>")  # fmt: skip
        # Not a Repeat: the check's daemon is gone; this is its load, for the daemon that serves the written config.
        same = (f"{_program()} probe --model {optimize['model']} --qps {check['qps']:g} --clients {check['clients']} "
                f"--duration {check['seconds']:g} --runtime-dir YOUR_DAEMONS_RUNTIME_DIR")  # fmt: skip
        parts.append(f"<p class=repeat>The check's load against the daemon serving the written config: "
                     f"<code>{html.escape(same)}</code></p>")  # fmt: skip
    else:
        parts.append(f"<p>Not checked through a daemon: {html.escape(_unchecked(optimize))}.</p>")
    parts.append(_command(optimize.get("command") or f"{_program()} optimize --model {optimize['model']}"))
    return parts


def _probe_html(probe: dict[str, Any] | None) -> list[str]:
    if probe is None:
        return []
    clients = f" by {probe['clients']} clients" if "clients" in probe else ""
    batch = f", batch {probe['batch']}" if "batch" in probe else ""
    parts = [f"<h2>Probe: where the time goes</h2><p>Through the daemon: {probe.get('qps', 0):g} QPS offered{clients} "
             f"for {probe.get('duration_s', 0):g} s{batch}, {probe.get('samples', '?')} requests, "
             f"{probe.get('errors', 0)} errors. {html.escape(probe['verdict'])}.</p>"]  # fmt: skip
    parts.append(_table(["stage", "P50 ms", "P99 ms", "P99.9 ms"], [
        [s, f"{v['p50_ms']:.3f}", f"{v['p99_ms']:.3f}", f"{v['p99.9_ms']:.3f}"] for s, v in probe["stages"].items()
    ]))  # fmt: skip
    counters = probe["counters"]
    if counters.get("available"):
        text = (f"Hardware counters (workers): IPC {counters.get('ipc')}, cache-miss rate "
                f"{counters.get('cache_miss_rate')}, branch-miss rate {counters.get('branch_miss_rate')}")  # fmt: skip
    else:
        text = f"Hardware counters: not measured: {counters.get('why')}"
    parts.append(f"<p>{html.escape(text)}</p>")
    if probe.get("operators"):
        where = f"worker pid {probe.get('profiled_pid')} over {probe.get('profiled_requests')} requests"
        parts.append(f"<p>torch.profiler in {html.escape(where)}, top operators by self time:</p>" + _table(
            ["operator", "calls", "self ms", "total ms"],
            [[o["name"], o["calls"], f"{o['self_ms']:.3f}", f"{o['total_ms']:.3f}"] for o in probe["operators"][:10]],
        ))  # fmt: skip
    else:
        parts.append("<p>torch.profiler: the worker returned no report; no operator table.</p>")
    if probe.get("command"):
        parts.append(_command(probe["command"]))
    return parts


def _harden_html(harden: dict[str, Any] | None) -> list[str]:
    if harden is None:
        return []
    parts = ["<h2>Harden: stability through the daemon</h2>"]
    if "duration_s" in harden:
        parts.append(f"<p>{harden['duration_s']:g} s in all, split between the timed checks.</p>")
    rows = [[r["name"], "pass" if r["passed"] else "FAIL" if r.get("measured", True) else "not measured", r["detail"]]
            for r in harden["results"]]  # fmt: skip
    classes = ["miss" if r.get("measured", True) and not r["passed"] else "" for r in harden["results"]]
    parts.append(_table(["check", "result", "detail"], rows, classes))
    if harden.get("command"):
        parts.append(_command(harden["command"]))
    return parts


def render(evidence: Evidence, drawn: list[Chart] | None) -> str:
    """The HTML document."""
    found = verdict(evidence)
    parts = ["<!doctype html><meta charset=utf-8><meta name=viewport content='width=device-width'>"
             f"<title>infervisor delivery report</title><style>{_STYLE}</style>"]  # fmt: skip
    parts += _verdict_html(evidence, found)
    parts.append("<h2>What this report does not prove</h2>")
    if found.not_proven:
        parts.append("<ul class=not-proven>" + "".join(f"<li>{html.escape(n)}</li>" for n in found.not_proven)
                     + "</ul>")  # fmt: skip
    else:
        parts.append("<p>Nothing beyond the scope of the checks below.</p>")
    parts.append(_identity_html(evidence))
    if evidence.constraints is not None:
        sla = evidence.constraints.sla
        hw = evidence.constraints.hardware
        parts.append("<h2>Constraints</h2>" + _table(
            ["CPU", "memory MB", "cold start ms", "P99 ms", "min QPS", "uptime h", "accuracy"],
            [[hw.cpu_model or "-", hw.memory_mb, f"{sla.cold_start_ms:g}", f"{sla.p99_ms:g}", f"{sla.min_qps:g}",
              f"{sla.uptime_hours:g}",
              f"cosine ≥ {sla.accuracy.min_cosine:g}" + (", top-1" if sla.accuracy.top1 else "")]],
        ))  # fmt: skip
    parts += _optimize_html(evidence)
    parts += _probe_html(evidence.probe)
    parts += _harden_html(harden_document(evidence))
    parts.append("<h2>Doctor: this box</h2>" + _table(
        ["check", "result", "detail", "fix"], [[c.name, c.status.value, c.detail, c.fix] for c in evidence.doctor]
    ))  # fmt: skip
    config = evidence.inputs.get("config")
    constraints = evidence.inputs.get("constraints")
    parts.append(_command(f"{_program()} doctor" + (f" --config {config}" if config else "")
                          + (f" --constraints {constraints}" if constraints else "")))  # fmt: skip
    if drawn is None:
        parts.append("<p>Charts: not drawn (install the optional extra <code>report</code> for matplotlib).</p>")
    elif drawn:
        parts.append("<h2>Charts</h2>")
        for chart in drawn:
            encoded = base64.b64encode(chart.png).decode()
            parts.append(f"<figure><img alt='{html.escape(chart.caption)}' src='data:image/png;base64,{encoded}'>"
                         f"<figcaption>{html.escape(chart.caption)}</figcaption></figure>")  # fmt: skip
    return "\n".join(parts)
