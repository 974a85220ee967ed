"""Profile benchmark, in process: every implemented profile of a built-in, NCHW and channels_last, 1 and N threads.

    python bench/profiles.py [--model resnet18] [--threads 1,2] [--seconds 3] [--json out.json]

Reports median/P95/P99 latency, speedup over eager at the same thread count, cosine against eager fp32
and the build time of each profile (what a worker adds to its cold start before warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from protocol.launch import PROFILE_NAMES  # noqa: E402
from protocol.tensors import TensorSpec  # noqa: E402
from supervisor.status import percentile  # noqa: E402
from worker.cpu_caps import read_caps  # noqa: E402
from worker.models import build_builtin  # noqa: E402
from worker.profiles.build import ProfileError, build_profile  # noqa: E402
from worker.profiles.validate import compare  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402

SPECS = {
    "resnet50": [TensorSpec("image", "float32", (None, 3, 224, 224))],
    "resnet18": [TensorSpec("image", "float32", (None, 3, 224, 224))],
    "encoder": [TensorSpec("input_ids", "int64", (None, 128)), TensorSpec("attention_mask", "int64", (None, 128))],
    "tiny": [TensorSpec("x", "float32", (None, 16))],
}


def measure(model: str, profile: str, channels_last: bool, threads: int, seconds: float) -> dict[str, Any]:
    """One row: build the profile on a fresh model, check it against eager, time it."""
    torch.set_num_threads(threads)
    runner = ModelRunner(build_builtin(model), SPECS[model], None, channels_last)
    inputs = runner.example_inputs()
    reference = [a for _, a in runner.forward(inputs)]
    example = tuple(inputs[s.name] for s in runner.specs)
    if channels_last:
        example = tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in example)
    started = time.perf_counter()
    try:
        runner.module = build_profile(profile, runner.module, example)
        runner.forward(inputs)
    except ProfileError as exc:
        return {"error": str(exc)[:80]}
    build_ms = (time.perf_counter() - started) * 1000.0
    cosine = compare(reference, [a for _, a in runner.forward(inputs)]).cosine
    latencies: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop and len(latencies) < 100_000:
        begin = time.perf_counter()
        runner.forward(inputs)
        latencies.append((time.perf_counter() - begin) * 1000.0)
    return {
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99),
        "n": len(latencies),
        "cosine": round(cosine, 6),
        "build_ms": round(build_ms, 1),
    }


def main() -> int:
    """Run every combination and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", choices=sorted(SPECS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    caps = read_caps()
    print(
        f"cpu: {caps.model_name}, tier {caps.tier}, torch {torch.__version__}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}"
    )
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        eager_p50: float | None = None
        for profile in PROFILE_NAMES:
            for channels_last in (False, True) if args.model.startswith("resnet") else (False,):
                refusal = caps.refusal(profile)
                result = (
                    {"error": refusal}
                    if refusal
                    else measure(args.model, profile, channels_last, threads, args.seconds)
                )
                if profile == "eager" and not channels_last:
                    eager_p50 = result.get("p50_ms")
                speedup = round(eager_p50 / result["p50_ms"], 2) if eager_p50 and result.get("p50_ms") else None
                rows.append({"model": args.model, "threads": threads, "profile": profile,
                             "channels_last": channels_last, "speedup": speedup, **result})  # fmt: skip
    print(f"{'thr':>3} {'profile':<11} {'layout':<6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'speedup':>7} "
          f"{'cosine':>9} {'build ms':>9}")  # fmt: skip
    for r in rows:
        layout = "NHWC" if r["channels_last"] else "NCHW"
        if "error" in r:
            print(f"{r['threads']:>3} {r['profile']:<11} {layout:<6} skipped: {r['error']}")
            continue
        print(
            f"{r['threads']:>3} {r['profile']:<11} {layout:<6} {r['p50_ms']:>8.2f} {r['p95_ms']:>8.2f} "
            f"{r['p99_ms']:>8.2f} {r['speedup'] or 0:>7.2f} {r['cosine']:>9.6f} {r['build_ms']:>9.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
