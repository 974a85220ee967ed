"""The live audit's metric families (docs/operations.md lists them), from its `audit` reading (monitors/audit.py).

The reading is one nested status key; its families keep a shape the generic renderer (exposition.py) has not:
figures picked out of the nesting, and a 0/1 series per process state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from infervisor.supervisor.observe.snapshot import Snapshot

#: The audit process's states (workers/audit_process.py: AuditState), each a 0/1 series.
_PROCESS_STATES = ("off", "starting", "ready", "backoff")


def audit_families(snapshot: Snapshot) -> Iterator[Metric]:
    """Per audited model: rows audited and below tolerance, drops, the worst cosine, the process and its restarts."""
    rows = CounterMetricFamily("infervisor_audit_rows", "served rows rerun on eager fp32 by the live audit",
                               labels=["model"])  # fmt: skip
    below = CounterMetricFamily(
        "infervisor_audit_rows_below_tolerance", "audited rows that missed the model's tolerance", labels=["model"]
    )
    dropped = CounterMetricFamily(
        "infervisor_audit_dropped", "samples not audited: queue full, or held by an audit process that ended",
        labels=["model"],
    )  # fmt: skip
    worst = GaugeMetricFamily("infervisor_audit_worst_cosine", "the lowest row cosine the audit measured",
                              labels=["model"])  # fmt: skip
    state = GaugeMetricFamily("infervisor_audit_process_state", "the model's audit process: 1 for its state",
                              labels=["model", "state"])  # fmt: skip
    restarts = CounterMetricFamily(
        "infervisor_audit_process_restarts", "times the audit process ended unasked (crash, kill, hang, load failure)",
        labels=["model"],
    )  # fmt: skip
    for model in snapshot.models:
        audit = next((value for reading, value in snapshot.model_readings(model.name) if reading.key == "audit"), None)
        if not isinstance(audit, Mapping):
            continue
        name = [model.name]
        rows.add_metric(name, float(audit.get("rows_audited") or 0))  # type: ignore[arg-type]
        below.add_metric(name, float(audit.get("rows_below_tolerance") or 0))  # type: ignore[arg-type]
        dropped.add_metric(name, float(audit.get("dropped") or 0))  # type: ignore[arg-type]
        figures = audit.get("worst") or {}
        if isinstance(figures, dict) and "cosine" in figures:
            worst.add_metric(name, float(figures["cosine"]))
        process = audit.get("process") or {}
        if isinstance(process, dict):
            for value in _PROCESS_STATES:
                state.add_metric([model.name, value], 1.0 if process.get("state") == value else 0.0)
            restarts.add_metric(name, float(process.get("restarts") or 0))
    yield from (rows, below, dropped, worst, state, restarts)
