"""The status document served on the control socket (and printed by `infervisor status`), rendered from the
loop's snapshot (infervisor/supervisor/observe/snapshot.py). The monitors' readings (monitors/readings.py) are
shown under their keys, the values the metrics render from the same snapshot; a per-worker reading the monitor
has not sampled yet (a starting worker's memory) is read now where the reading says how."""

from __future__ import annotations

from typing import Any

from infervisor.common.accuracy import ACCURACY_WARNING_NOTE, SEQUENCE_NOTE
from infervisor.common.profiles import PROFILES, TIMED_AT_NOTE
from infervisor.protocol.constants import MAX_HEADER_BYTES, MAX_NAME_LEN, MAX_RANK, MAX_TENSORS
from infervisor.supervisor.monitors.readings import Scope, Value
from infervisor.supervisor.observe.snapshot import ModelSample, Role, SlotSample, Snapshot
from infervisor.supervisor.observe.stats import percentile
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import BatchingConfig


def worker_readings(snapshot: Snapshot, pid: int | None) -> dict[str, Value]:
    """Every per-worker reading of the worker `pid`: the monitor's value, else read now when the reading can be."""
    shown: dict[str, Value] = {}
    for reading, value in snapshot.worker_readings(pid):
        if value is None and pid is not None and reading.read_now is not None:
            value = reading.read_now(pid)
        shown[reading.key] = value
    return shown


def box_readings(snapshot: Snapshot, taken: set[str]) -> dict[str, dict[str, Value]]:
    """Per monitor with readings about the box, its section: the keys it reported (a name in `taken` is an error)."""
    sections: dict[str, dict[str, Value]] = {}
    for sample in snapshot.monitors:
        declared = {reading.key for reading in sample.of(Scope.BOX)}
        if not declared:
            continue
        if sample.name in taken:
            raise ValueError(f"monitor {sample.name!r} names a status key the daemon already has")
        sections[sample.name] = {key: value for key, value in sample.values.box.items() if key in declared}
    return sections


def with_readings(row: dict[str, Any], readings: dict[str, Value], after: str) -> dict[str, Any]:
    """`row` with the readings' keys placed after its key `after`; a reading named like a key of the row (or
    `role`, added to a worker outside the pool) is a ValueError: it would hide a figure the daemon shows."""
    if clash := sorted(readings.keys() & {*row, "role"}):
        raise ValueError(f"monitor readings {clash} name status keys the daemon already has")
    keys = list(row)
    cut = keys.index(after) + 1
    return {**{k: row[k] for k in keys[:cut]}, **readings, **{k: row[k] for k in keys[cut:]}}


def slot_status(slot: SlotSample, snapshot: Snapshot) -> dict[str, Any]:
    """One worker's row; its readings (memory, ...) as the snapshot holds them, the figures /metrics shows."""
    pid = slot.pid
    row = {
        "slot": slot.slot,
        "pid": pid,
        "state": slot.state.value,
        "reason": slot.reason,
        "busy": bool(slot.inflight),
        "inflight": slot.inflight,
        "cores": list(slot.cores),
        "node": slot.node,
        "shared_cores": slot.shared_cores,
        "threads": slot.threads,
        "requests": slot.requests,
        "p50_ms": percentile(slot.latencies_ms, 50),
        "p99_ms": percentile(slot.latencies_ms, 99),
        "ready_ms": round(slot.ready_ms, 1),
        "profile": slot.profile,
        "profile_skipped": list(slot.profile_skipped),
        "profile_build": list(slot.profile_build),
        # At which input size a fastest pick timed the serving profile against the others (None: not timed).
        "timed_at": next(
            (n.removeprefix(TIMED_AT_NOTE) for n in slot.profile_build if n.startswith(TIMED_AT_NOTE)), None
        ),  # fmt: skip
        **accuracy_data(slot),
        "last_profile": slot.last_profile,
        "restarts": slot.restarts,
        "last_exit": slot.last_exit,
        # Why its last worker could not load the model, in the worker's words (until a worker of the slot serves).
        "load_error": slot.load_error or None,
        "last_event": slot.last_event,
        # Before READY: the phase (loading, building profile i of n, ...) and how long each limit has counted.
        "starting": slot.starting,
    }
    return with_readings(row, worker_readings(snapshot, pid), after="threads")


def accuracy_data(slot: SlotSample) -> dict[str, str | None]:
    """What the serving profile was judged on, the sequence gate's verdict on a stateful model, and a warning when
    that was synthetic data for one that changes numerics (int8, bf16): agreement with eager on drawn inputs says
    little about real ones."""
    sequence = next((n.removeprefix(SEQUENCE_NOTE) for n in slot.profile_build if n.startswith(SEQUENCE_NOTE)), None)
    return {**_judged_on(slot), "sequence_check": sequence}


def _judged_on(slot: SlotSample) -> dict[str, str | None]:
    if slot.profile is None:
        return {"checked_on": None, "accuracy_warning": None}
    # The worker's own warnings on its evidence: a pass thinner than the samples' spread, scales fitted on the
    # samples that judged them (ACCURACY_WARNING_NOTE notes of the serving profile's build).
    prefix = ACCURACY_WARNING_NOTE
    warnings = [note.removeprefix(prefix) for note in slot.profile_build if note.startswith(prefix)]
    if slot.validated:
        return {"checked_on": "validation set", "accuracy_warning": "; ".join(warnings) or None}
    declared = PROFILES.get(slot.profile)
    if declared is not None and declared.changes_numerics:
        warnings.insert(0,
            f"{slot.profile} changes numerics and was judged on synthetic inputs only (no validation set): configure "
            "`validation`, an .npz of real inputs"
        )  # fmt: skip
    return {"checked_on": "synthetic inputs", "accuracy_warning": "; ".join(warnings) or None}


def models_status(snapshot: Snapshot) -> dict[str, Any]:
    """Per model: its health, spec, queue, counters and workers (members first, then successors and retiring ones)."""
    models: dict[str, Any] = {}
    for sample in snapshot.models:
        model = sample.config
        row = {
            "health": sample.report.health.value,
            "reason": sample.report.reason,
            # Why it cannot serve or did not take a change (roster.model_errors; docs/protocol.md, Error fields).
            "error": sample.load_error,
            "source": {k: v for k, v in vars(model.source).items() if v is not None},
            "inputs": [
                {
                    "name": s.name,
                    "dtype": s.dtype,
                    "shape": s.config_shape(),
                    "synthetic": s.synthetic.to_config() if s.synthetic is not None else None,
                }
                for s in model.inputs
            ],
            "queued": sample.queued,
            "queue_size": sample.capacity,
            "completed": sample.completed,
            "errors": dict(sample.errors),
            "p50_ms": percentile(sample.latencies_ms, 50),
            "p99_ms": percentile(sample.latencies_ms, 99),
            "profiles": list(model.profiles),
            # What serves now (the profile of each serving member), and the background build behind it.
            "serving": sorted(
                {s.profile for s in snapshot.slots_of(sample.name) if s.state.value == "serving" and s.profile}
            ),
            "build": sample.build,
            "refusals": dict(sample.refusals) if sample.refusals else None,
            "recorded_inputs": None if sample.recorded_inputs is None else dict(sample.recorded_inputs),
            "fallback": sample.fallback,
            "batching": batching_status(model.batching, sample),
            "streams": None if sample.streams is None else dict(sample.streams),
            "workers": [
                slot_status(s, snapshot) | ({} if s.role is Role.MEMBER else {"role": s.role.value})
                for s in snapshot.slots_of(sample.name)
            ],
        }
        readings = {reading.key: value for reading, value in snapshot.model_readings(sample.name)}
        models[sample.name] = with_readings(row, readings, after="build")
    return models


def batching_status(policy: BatchingConfig | None, sample: ModelSample) -> dict[str, Any] | None:
    """How a batching model's requests were joined: batches per size (rows), mean size, the wait to be batched."""
    if policy is None:
        return None
    batches = sum(count for _, count in sample.batch_sizes)
    rows = sum(size * count for size, count in sample.batch_sizes)
    return {
        "max_batch_size": policy.max_batch_size,
        "max_queue_delay_us": policy.max_queue_delay_us,
        "preferred_batch_sizes": list(policy.preferred_batch_sizes),
        "batches": batches,
        "mean_size": round(rows / batches, 3) if batches else None,
        "batch_sizes": {str(size): count for size, count in sample.batch_sizes},
        "wait_p50_ms": percentile(sample.batch_wait_ms, 50),
        "wait_p99_ms": percentile(sample.batch_wait_ms, 99),
    }


def config_states(snapshot: Snapshot) -> dict[str, Any]:
    """Per model, where the last applied config stands: applied, still rolling out, or rolled back and why."""
    return {
        m.name: {"state": m.config_state} | ({} if m.config_error is None else {"error": m.config_error})
        for m in snapshot.models
    }


def limits(config: Config) -> dict[str, int]:
    """What a client must stay within (docs/protocol.md): frames, header, tensors per message, rank, names."""
    return {
        "max_frame_bytes": config.max_frame_bytes,
        "max_header_bytes": MAX_HEADER_BYTES,
        "max_tensors": MAX_TENSORS,
        "max_rank": MAX_RANK,
        "max_name_len": MAX_NAME_LEN,
    }


def rollout_status(snapshot: Snapshot) -> dict[str, Any]:
    """The rolling-restart queue."""
    rollout = snapshot.rollout
    return {
        "pending": rollout.pending,
        "current": rollout.current,
        "completed": rollout.completed,
        "last_error": rollout.last_error,
    }
