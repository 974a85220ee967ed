"""In-process half of `infervisor bench`: every profile of one built-in, timed on pinned cores.

    python -m worker.bench --model resnet50 --profiles eager,jit --threads 2 --batch 8 --seconds 3 --cache-dir D

Prints one JSON object per line: first the model's input spec, then one row per profile. The process
pins itself to its first `threads` CPUs and sizes the thread pools before torch is imported, like a worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from protocol.launch import PROFILE_NAMES, LaunchSpec, ModelSource
from protocol.tensors import TensorSpec

#: Input specs of the built-ins (dynamic batch), as a config would declare them.
BUILTIN_SPECS: dict[str, tuple[TensorSpec, ...]] = {
    "resnet50": (TensorSpec("image", "float32", (None, 3, 224, 224)),),
    "resnet18": (TensorSpec("image", "float32", (None, 3, 224, 224)),),
    "encoder": (TensorSpec("input_ids", "int64", (None, 128)), TensorSpec("attention_mask", "int64", (None, 128))),
    "tiny": (TensorSpec("x", "float32", (None, 16)),),
}


def _percentiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))], 4)

    return {"p50_ms": at(50), "p95_ms": at(95), "p99_ms": at(99)}


def _timed(run: Any, seconds: float) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    while (time.perf_counter() < stop or len(latencies) < 5) and len(latencies) < 100_000:
        started = time.perf_counter()
        run()
        latencies.append((time.perf_counter() - started) * 1000.0)
    return latencies


def measure(args: argparse.Namespace, profile: str) -> dict[str, Any]:
    """Build one profile on a fresh model, check it against eager at batch 1, time it at batch 1 and --batch."""
    import torch

    from worker.cpu_caps import read_caps
    from worker.models import build_builtin
    from worker.profiles.build import ProfileError, build_profile
    from worker.profiles.validate import compare
    from worker.runner import ModelRunner
    from worker.serve import build_context

    specs = BUILTIN_SPECS[args.model]
    runner = ModelRunner(build_builtin(args.model), specs, None, args.channels_last)
    refusal = read_caps().refusal(profile)
    if refusal is not None:
        return {"profile": profile, "skipped": refusal}
    launch = LaunchSpec(
        "bench", args.model, "", ModelSource("builtin", args.model), specs, None, (), args.threads,
        profiles=(profile,), channels_last=args.channels_last, cache_dir=args.cache_dir,
    )  # fmt: skip
    one, many = runner.example_inputs(1), runner.example_inputs(args.batch)
    reference = [a for _, a in runner.forward(one)]
    started = time.perf_counter()
    try:
        built = build_profile(profile, build_context(launch, runner))
        runner.module = built.callable
        runner.forward(one)
    except ProfileError as exc:
        return {"profile": profile, "skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a crashing profile is a row of the table, not the end of the bench
        return {"profile": profile, "skipped": f"crashed: {type(exc).__name__}: {str(exc)[:200]}"}
    build_s = time.perf_counter() - started
    agreement = compare(reference, [a for _, a in runner.forward(one)])
    single = _timed(lambda: runner.forward(one), args.seconds)
    runner.forward(many)  # a dynamic-shape graph may specialise on its first batch of this size
    batched = _timed(lambda: runner.forward(many), args.seconds)
    torch.jit.enable_onednn_fusion(False)
    return {
        "profile": profile,
        "build_s": round(build_s, 2),
        "build_notes": built.notes,
        "cosine": round(agreement.cosine, 6),
        "max_abs_error": float(f"{agreement.max_abs_error:.3g}"),
        **_percentiles(single),
        "qps": round(1000.0 * len(single) / sum(single), 1),
        "batch": args.batch,
        "batch_p50_ms": _percentiles(batched)["p50_ms"],
        "batch_qps": round(1000.0 * args.batch * len(batched) / sum(batched), 1),
    }


def main() -> int:
    """Pin, size the thread pools, then measure each profile and print JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(BUILTIN_SPECS))
    parser.add_argument("--profiles", default=",".join(PROFILE_NAMES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cpus)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(len(cpus))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir) / "inductor"))
    import torch

    torch.set_num_threads(len(cpus))
    specs = BUILTIN_SPECS[args.model]
    print(json.dumps({"inputs": [[s.name, s.dtype, list(s.shape)] for s in specs], "cpus": cpus}), flush=True)
    for profile in args.profiles.split(","):
        print(json.dumps(measure(args, profile)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
