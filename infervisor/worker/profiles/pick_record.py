"""Where a fastest pick's decision is kept between restarts, keyed by all that decided it, and what it timed."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import structlog
import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.builders import BuildContext
from infervisor.worker.profiles.dispatch import batch_only, batch_range, buckets_for
from infervisor.worker.profiles.validate import Tolerance

log = structlog.get_logger("worker")

#: Bumped when what a remembered fastest-pick decision means changes: older ones are then decided again
#: (3: timed at the typical shape or the validation set's largest shape group).
_PICK_FORMAT = 3


def timed_batches(specs: Sequence[TensorSpec], configured: Sequence[int] = ()) -> tuple[int, ...]:
    """The batch sizes a fastest pick times: the smallest the model takes, the packages' buckets, and the sizes
    the broker joins requests into (`configured`), all within the batch's bounds; when the batch is not the only
    dynamic dim, the example's size alone (other dims would change with it)."""
    if not batch_only(specs):
        return (1,)
    low, high = batch_range(specs)
    inside = {size for size in configured if low <= size and (high is None or size <= high)}
    return tuple(sorted({*buckets_for(specs), *inside}))


def remembered_pick(context: BuildContext, chain: Sequence[str], tolerance: Tolerance) -> Path | None:
    """Where a fastest pick of this chain for this model, machine and thread count is remembered (None: no cache)."""
    return decision_path(context, chain, tolerance, timed_batches(context.specs, context.served_batches))


def decision_path(
    context: BuildContext, chain: Sequence[str], tolerance: Tolerance, batches: Sequence[int]
) -> Path | None:
    """Where the decision for this model, chain, tolerance, timing size, machine and thread count is kept."""
    if context.cache is None:
        return None
    key = {
        "format": _PICK_FORMAT,
        "batches": list(batches),
        "inputs": [[s.name, s.dtype, s.config_shape()] for s in context.specs],
        "model": context.digest,
        "chain": list(chain),
        "tolerance": asdict(tolerance),
        "threads": torch.get_num_threads(),
        "channels_last": context.channels_last,
        "calibration": str(context.calibration),
        "validation": str(context.validation),
        "typical_shape": context.typical_shape,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if context.served is not None and context.served.mix and not context.typical_shape:
        # Timed at the served mix (timing_size.py): its groups decide, their shares only weigh (a pick is not timed
        # again each time the shares move).
        key["served_mix"] = sorted(group for group, _ in context.served.mix)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return context.cache.root / f"pick-{name}.json"


def remember(path: Path | None, decision: dict[str, object]) -> None:
    """Store a fastest-pick decision atomically; siblings may write the same one at once, and losing it is harmless."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(decision, file)
        os.replace(temporary, path)
    except OSError as exc:  # a full or read-only cache only costs the next restart a new pick
        log.warning("pick_not_remembered", path=str(path), error=str(exc))
