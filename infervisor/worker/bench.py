"""In-process half of `infervisor bench` and `infervisor optimize`: profiles of one model, timed on pinned cores.

    python -m infervisor.worker.bench --model resnet50 --profiles eager,jit --threads 2 --batch 8 --seconds 3 \
        --cache-dir D
    python -m infervisor.worker.bench --launch LAUNCH_JSON --profiles int8_static --started-at EPOCH ...
    python -m infervisor.worker.bench --launch LAUNCH_JSON --profiles aoti --cpus 1 --build-only --hold ...

Prints one JSON object per line: first the model's input spec, then one row per profile. The process
pins itself to its first `threads` CPUs and sizes the thread pools before torch is imported, like a worker.
With --launch (a worker's LaunchSpec) any model source works, and its calibration and validation sets
are used; --started-at (the parent's time.time() when it spawned this process) adds the cold start.
With --hold the process keeps the profile after its row and times back-to-back requests when told
to on stdin (`load SECONDS`), so `infervisor optimize` can load several pinned processes at once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infervisor.common.cpuinfo import read_caps
from infervisor.common.profiles import PROFILE_NAMES, PROFILES, cpu_refusal
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import TensorSpec

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


def _timed(run: Any, seconds: float, at_least: int = 5) -> list[float]:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    while (time.perf_counter() < stop or len(latencies) < at_least) and len(latencies) < 100_000:
        started = time.perf_counter()
        run()
        latencies.append((time.perf_counter() - started) * 1000.0)
    return latencies


#: How long each turn of the alternating timing runs one batch size before switching to the other.
_TURN_S = 0.25


def alternating(runs: dict[int, Any], seconds: float) -> list[dict[int, list[float]]]:
    """Latencies of each batch size, timed in alternating turns for about `seconds` each (at least 5 runs each).

    One map per turn. On a shared box a burst of load then hits both sizes alike, and the per-turn
    ratio of their per-sample times (the batch column) is not decided by which size ran during it.
    """
    turns: list[dict[int, list[float]]] = []
    stop = time.perf_counter() + seconds * len(runs)
    while time.perf_counter() < stop or sum(len(turn[min(runs)]) for turn in turns) < 5 or len(turns) < 3:
        turns.append({size: _timed(run, _TURN_S, at_least=1) for size, run in runs.items()})
    return turns


def batch_ratio(turns: list[dict[int, list[float]]], one: int, many: int) -> float:
    """The median over turns of (per-sample time at `many`) / (time at `one`), each turn's medians paired."""
    ratios = [statistics.median(t[many]) / many / statistics.median(t[one]) * one for t in turns]
    return statistics.median(ratios)


def sized(launch: LaunchSpec, sizes: str | None, batch: int) -> list[dict[str, Any]]:
    """Inputs at each of --sizes (JSON: a list of input name -> full shape) with `batch` rows; [] without it."""
    import torch

    from infervisor.worker.synthetic import draw

    drawn = []
    for seed, shapes in enumerate(json.loads(sizes) if sizes else []):
        generator = torch.Generator().manual_seed(seed)
        drawn.append({s.name: draw(s, [batch, *shapes[s.name][1:]], generator) for s in launch.inputs})
    return drawn


def launch_of(args: argparse.Namespace) -> LaunchSpec:
    """The worker launch spec to measure: given as JSON, or made for a built-in."""
    if args.launch:
        return LaunchSpec.from_json(args.launch)
    specs = BUILTIN_SPECS[args.model]
    return LaunchSpec(
        "bench", args.model, -1, ModelSource("builtin", args.model), specs, None, (), args.threads,
        channels_last=args.channels_last, cache_dir=args.cache_dir,
    )  # fmt: skip


def measure(args: argparse.Namespace, launch: LaunchSpec, profile: str) -> tuple[dict[str, Any], Callable[[], object]]:
    """Build one profile on a fresh model, check it against eager, time it at batch 1 and --batch (not --build-only).

    Returns the row and one batch-1 call of what was built (for --hold); a skipped profile's call does nothing.
    """
    import psutil

    from infervisor.worker.loader import load_model
    from infervisor.worker.profiles.build import build_profile
    from infervisor.worker.profiles.builders import ProfileError
    from infervisor.worker.profiles.golden import golden_cases
    from infervisor.worker.profiles.sequence_gate import validation_samples
    from infervisor.worker.profiles.validate import compare
    from infervisor.worker.runner import ModelRunner
    from infervisor.worker.start import build_context

    launch = LaunchSpec.from_json(json.dumps({**json.loads(launch.to_json()), "profiles": [profile]}))
    runner = ModelRunner(load_model(launch.source), launch.inputs, launch.output_names, launch.channels_last)
    refusal = cpu_refusal(profile, read_caps())
    if refusal is not None:
        return {"profile": profile, "skipped": refusal}, _nothing
    context = build_context(launch, runner)
    # As a worker reads it: a stateful model's file may hold only sequences, whose steps are then its samples.
    validation = validation_samples(launch, runner, context.sequences)
    cases = golden_cases(runner, validation)
    references = [[a for _, a in runner.forward(case)] for case in cases]
    ones = sized(launch, args.sizes, 1) or [runner.example_inputs(1)]
    many = (sized(launch, args.sizes, args.batch) or [runner.example_inputs(args.batch)])[len(ones) // 2]
    turn = itertools.count()
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    try:
        built = build_profile(profile, context)
        runner.module = built.callable
        for one in ones:  # every size once: a compiled program may specialise on its first call of each
            runner.forward(one)
    except ProfileError as exc:
        return {"profile": profile, "skipped": str(exc)}, _nothing
    except Exception as exc:  # noqa: BLE001 - a crashing profile is a row of the table, not the end of the bench
        return {"profile": profile, "skipped": f"crashed: {type(exc).__name__}: {str(exc)[:200]}"}, _nothing
    build_s = time.perf_counter() - started
    cold_start_s = time.time() - args.started_at if args.started_at else None

    def serve_one() -> object:  # one batch-1 call, at the next of the sizes measured at
        return runner.forward(ones[next(turn) % len(ones)])

    if args.build_only:
        built_row = {"profile": profile, "build_s": round(build_s, 2), "build_notes": built.notes}
        return {**built_row, "cold_start_s": round(cold_start_s, 2) if cold_start_s is not None else None}, serve_one
    agreements = [
        compare(ref, [a for _, a in runner.forward(case)]) for case, ref in zip(cases, references, strict=True)
    ]
    runner.forward(many)  # a dynamic-shape graph may specialise on its first batch of this size
    turns = alternating({1: serve_one, args.batch: lambda: runner.forward(many)}, args.seconds)
    single = [ms for turn in turns for ms in turn[1]]
    batched = [ms for turn in turns for ms in turn[args.batch]]
    per_sample = {"1": _percentiles(single)["p50_ms"], str(args.batch): _percentiles(batched)["p50_ms"] / args.batch}
    return {
        "profile": profile,
        "build_s": round(build_s, 2),
        "cold_start_s": round(cold_start_s, 2) if cold_start_s is not None else None,
        "build_notes": built.notes,
        "cosine": min(a.cosine for a in agreements),  # unrounded: 0.99989996 must stay below a 0.9999 budget
        "max_abs_error": float(f"{max(a.max_abs_error for a in agreements):.3g}"),
        "top1": all(a.top1_agree for a in agreements),
        "checked_on": "validation set" if validation else "seeded random inputs",
        **_percentiles(single),
        "qps": round(1000.0 * len(single) / sum(single), 1),
        "batch": args.batch,
        "batch_p50_ms": _percentiles(batched)["p50_ms"],
        "batch_qps": round(1000.0 * args.batch * len(batched) / sum(batched), 1),
        #: Median milliseconds per sample at batch 1 and at --batch (the bench's batch column).
        "per_sample_ms": {size: round(ms, 4) for size, ms in per_sample.items()},
        #: The median over alternating turns of per-sample time at --batch over batch 1's (below 1: batching pays).
        "batch_ratio": round(batch_ratio(turns, 1, args.batch), 3),
        "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "rss_added_mb": round((psutil.Process().memory_info().rss - rss_before) / 2**20, 1),
        # This bench process after this profile (and the ones measured before it in the same process).
        "process_pss_mb": round(psutil.Process().memory_full_info().pss / 2**20, 1),
    }, serve_one


def auto_pick(launch: LaunchSpec) -> dict[str, Any]:
    """What a worker's `pick: fastest` over the launch's chain serves here, decided afresh (not remembered)."""
    from infervisor.worker.loader import load_model
    from infervisor.worker.profiles.select import remembered_pick, select_profile
    from infervisor.worker.profiles.sequence_gate import validation_samples
    from infervisor.worker.profiles.validate import Tolerance
    from infervisor.worker.runner import ModelRunner
    from infervisor.worker.start import build_context

    runner = ModelRunner(load_model(launch.source), launch.inputs, launch.output_names, launch.channels_last)
    context = build_context(launch, runner)
    tolerance = Tolerance.from_dict(launch.tolerance)
    remembered = remembered_pick(context, launch.profiles, tolerance)
    if remembered is not None:
        # Decided again, and remembered again: a worker of this config would have made the same decision here.
        remembered.unlink(missing_ok=True)
    validation = validation_samples(launch, runner, context.sequences)
    selection = select_profile(
        runner, launch.profiles, tolerance, read_caps(), context, "fastest", validation
    )  # fmt: skip
    return {"pick": selection.profile, "notes": selection.notes, "skipped": selection.skipped}


def _nothing() -> object:
    return None


def hold(serve_one: Callable[[], object]) -> None:
    """Keep the built profile and answer the parent's lines on stdin until `quit` or EOF.

    `load SECONDS`: batch-1 calls back to back for that long, answered with their count and
    percentiles. The parent sends it to several such processes at once (infervisor optimize's
    layouts): their counts add up to the layout's throughput with every worker busy.
    """
    for line in sys.stdin:
        command, _, value = line.strip().partition(" ")
        if command != "load":
            return
        latencies = _timed(serve_one, float(value))
        summary = {"count": len(latencies), "seconds": round(sum(latencies) / 1000.0, 4), **_percentiles(latencies)}
        print(json.dumps({"load": summary}), flush=True)


def main() -> int:
    """Pin, size the thread pools, then measure each profile and print JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(BUILTIN_SPECS))
    source.add_argument("--launch", help="a worker LaunchSpec as JSON (any model source)")
    parser.add_argument(
        "--profiles",
        default=",".join(PROFILE_NAMES),
        help="comma-separated, measured in this order: "
        + "; ".join(f"{p.name}: {p.summary}" for p in PROFILES.values()),
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpus", help="pin to exactly these CPUs (comma-separated; default: the first --threads)")
    parser.add_argument("--build-only", action="store_true", help="build and check, do not time (a --hold sibling)")
    parser.add_argument("--hold", action="store_true", help="then keep the (one) profile and answer `load S` on stdin")
    parser.add_argument(
        "--pick", action="store_true", help="only print what pick fastest over the launch's chain serves"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sizes", help="JSON list of {input: full shape}: batch-1 calls take them in turn")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--started-at", type=float, help="the parent's time.time() at spawn, for the cold start")
    args = parser.parse_args()
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cpus)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(len(cpus))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir) / "inductor"))
    launch = launch_of(args)
    import torch

    torch.set_num_threads(len(cpus))
    print(json.dumps({"inputs": [[s.name, s.dtype, list(s.shape)] for s in launch.inputs], "cpus": cpus}), flush=True)
    if args.pick:
        print(json.dumps(auto_pick(launch)), flush=True)
        return 0
    serve_one = _nothing
    for profile in args.profiles.split(","):
        row, serve_one = measure(args, launch, profile)
        print(json.dumps(row), flush=True)
    if args.hold:
        hold(serve_one)
    return 0


if __name__ == "__main__":
    sys.exit(main())
