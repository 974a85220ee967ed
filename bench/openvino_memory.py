"""What an OpenVINO worker would save by never loading the torch module: PSS and time, step by step, two ways.

    .venv/bin/python bench/openvino_memory.py --model resnet50 --cache-dir /tmp/rt-cache

Both ways run in a fresh process pinned to one CPU at one thread, import what a worker imports
(torch, the worker's modules, openvino), and serve batch-1 requests from the model's cached
`openvino` IR (bench/runtimes.py or a worker fills --cache-dir). `with-module` does what a worker
does today (infervisor/worker/start.py): loads the torch module, hashes its weights for the cache key, runs
it once (the gate's eager reference), compiles the cached IR, then drops the module, trims the
heap (and the IR weights the plugin mapped). `ir-only` compiles the cached IR, releases the same way
and serves, the torch module never loaded. Each step's PSS is read from /proc/self/smaps_rollup.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MB = 2**20


def pss_mb() -> float:
    """This process's PSS in MB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def cached_ir(cache_dir: Path, specs: Any) -> Path:
    """The newest cached fp32 `openvino` IR whose key declares these inputs (the key's sidecar .json says so)."""
    wanted = [[s.name, s.dtype, s.config_shape()] for s in specs]
    found = [
        xml
        for xml in cache_dir.glob("openvino-*.xml")
        if json.loads(xml.with_suffix(".json").read_text()).get("inputs") == wanted
    ]
    if not found:
        raise SystemExit(f"no cached openvino IR for these inputs in {cache_dir}: run bench/runtimes.py first")
    return max(found, key=lambda xml: xml.stat().st_mtime)


def one_way(model: str, cache_dir: Path, way: str, requests: int) -> list[tuple[str, float, float]]:
    """(step, PSS MB after it, seconds it took) for one way of starting, in this process."""
    steps: list[tuple[str, float, float]] = []
    started = time.perf_counter()

    def step(name: str) -> None:
        nonlocal started
        steps.append((name, pss_mb(), time.perf_counter() - started))
        started = time.perf_counter()

    import openvino as ov
    import torch

    from infervisor.protocol.launch import ModelSource
    from infervisor.worker.bench import BUILTIN_SPECS
    from infervisor.worker.loader import load_model
    from infervisor.worker.memory import release_unused_memory
    from infervisor.worker.profiles.cache import model_digest
    from infervisor.worker.runner import ModelRunner
    from infervisor.worker.synthetic import synthetic_inputs

    torch.set_num_threads(1)
    specs = BUILTIN_SPECS[model]
    step("import torch, openvino, the worker's modules")
    source = ModelSource("builtin", model)
    module: Any = None
    if way == "with-module":
        module = load_model(source, specs)
        step("load the torch module")
        model_digest(module, source)
        step("hash its weights (the cache key)")
        with torch.inference_mode():
            module(*ModelRunner(module, specs, None).example_inputs().values())
        step("one eager forward (the gate's reference)")
    xml = cached_ir(cache_dir, specs)
    properties = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "ENABLE_CPU_PINNING": False,
                  "CACHE_DIR": str(cache_dir / "openvino")}  # fmt: skip
    compiled = ov.Core().compile_model(str(xml), "CPU", properties)
    request = compiled.create_infer_request()
    example = [t.numpy() for t in synthetic_inputs(specs, 1, 0).values()]
    request.infer(example)  # the plugin repacks the weights at the first call; a worker's gate has made it
    step(f"compile the cached IR ({xml.name}, blob cache on), one call")
    del module
    gc.collect()
    release_unused_memory()
    step("release as a worker does (the module if loaded, the heap, the mapped IR weights)")
    for _ in range(requests):
        request.infer(example)
    step(f"{requests} batch-1 requests")
    return steps


def main() -> int:
    """Run each way in its own process and print both step tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--way", choices=["with-module", "ir-only"], help="(internal) run one way in this process")
    args = parser.parse_args()
    if args.way:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
        print(json.dumps(one_way(args.model, args.cache_dir, args.way, args.requests)))
        return 0
    for way in ("with-module", "ir-only"):
        command = [sys.executable, __file__, "--model", args.model, "--cache-dir", str(args.cache_dir),
                   "--requests", str(args.requests), "--way", way]  # fmt: skip
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        steps = json.loads(output.strip().splitlines()[-1])  # the last line: libraries may print before it
        print(f"\n{way}: {args.model}, 1 thread\n\n| step | PSS MB after | s |\n|---|---|---|")
        for name, pss, seconds in steps:
            print(f"| {name} | {pss:.0f} | {seconds:.2f} |")
        print(f"| total | {steps[-1][1]:.0f} (peak {max(s[1] for s in steps):.0f}) | {sum(s[2] for s in steps):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
