"""Walks a model's profile chain: the first profile that builds, runs and matches eager on golden inputs serves."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
import torch

from worker.cpu_caps import CpuCaps
from worker.profiles.build import ProfileError, build_profile
from worker.profiles.validate import Tolerance, compare
from worker.runner import ModelRunner

log = structlog.get_logger("worker")


@dataclass
class Selection:
    """The profile that serves, and why each earlier one in the chain did not."""

    profile: str
    skipped: list[str] = field(default_factory=list)
    build_ms: float = 0.0
    cosine: float = 1.0


def _golden_batches(runner: ModelRunner) -> list[int]:
    # A dynamic batch dimension is checked at 2 as well: tracing can bake batch 1 into a graph.
    return [1, 2] if any(d is None for spec in runner.specs for d in spec.shape) else [1]


def select_profile(runner: ModelRunner, chain: Sequence[str], tolerance: Tolerance, caps: CpuCaps) -> Selection:
    """Install the first passing profile of `chain` on the runner; eager is the last resort."""
    eager = runner.module
    batches = _golden_batches(runner)
    golden = {b: runner.example_inputs(batch=b) for b in batches}
    reference = {b: [a for _, a in runner.forward(golden[b])] for b in batches}
    skipped: list[str] = []
    for name in chain:
        refusal = caps.refusal(name)
        if refusal is not None:
            skipped.append(f"{name}: {refusal}")
            continue
        started = time.perf_counter()
        try:
            example = tuple(golden[1][s.name] for s in runner.specs)
            if runner.channels_last:
                example = tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in example)
            runner.module = build_profile(name, eager, example)
            runner.forward(golden[1])  # the first runs of a scripted graph profile and specialise it
            failure = None
            cosine = 1.0
            for batch in batches:
                agreement = compare(reference[batch], [a for _, a in runner.forward(golden[batch])])
                cosine = min(cosine, agreement.cosine)
                failure = failure or agreement.failure(tolerance)
        except ProfileError as exc:
            failure = str(exc)
        except Exception as exc:  # noqa: BLE001 - a profile that crashes on golden inputs is skipped, not fatal
            failure = f"{name} crashed on golden inputs: {type(exc).__name__}: {str(exc)[:300]}"
        if failure is None:
            build_ms = (time.perf_counter() - started) * 1000.0
            log.info("profile_selected", profile=name, build_ms=round(build_ms, 1), cosine=cosine, skipped=skipped)
            return Selection(name, skipped, build_ms, cosine)
        skipped.append(f"{name}: {failure}")
        runner.module = eager
        torch.jit.enable_onednn_fusion(False)  # a process-wide flag: it must not outlive its profile
    runner.module = eager
    if "eager" not in chain:
        skipped.append("eager: last resort, no profile in the chain passed")
    log.warning("profile_fallback_to_eager", skipped=skipped)
    return Selection("eager", skipped)
