"""Where a sequential client's round trip goes, leg by leg, for the daemon with and without one config change.

    python bench/legs.py [--model resnet18] [--pairs 4] [--requests 130] [--cpu-latency-us 0]
                         [--set pin_supervisor=false] [--shm] [--both pin_supervisor=false]

Runs the daemon (one worker of the model) alternately without and with `--set KEY=JSON` (top-level
config keys; `--both` sets one on both sides), `--pairs` times each, so both sides see the same
phases of a noisy machine. With `--shm` the B side's client puts the input in a shared-memory
region instead of a frame. Each run
sends `--requests` sequential requests from a raw DEALER socket, drops the first 20, and splits
every round trip by the reply's own timing, as `infervisor probe` does: client to broker, broker to
worker, the worker's checks, model, encode, and worker back to the client. Prints the medians of
each run and, per leg, the two sides' ranges.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon import SHAPES, builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client_messages import InferRequest, encode_infer  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.shared_memory import SharedRegion  # noqa: E402
from infervisor.protocol.tensors import TensorDesc  # noqa: E402

LEGS = ("send", "dispatch", "decode", "model", "encode", "reply", "overhead")
_SKIP = 20


def run(model: str, requests: int, config: dict[str, Any], runtime_dir: Path, shm: bool) -> dict[str, float]:
    """One daemon, `requests` sequential requests (input in shared memory if `shm`); the median of each leg in ms."""
    daemon = start_daemon(config, runtime_dir)
    context: zmq.Context[Any] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    name, shape = SHAPES[model]
    tensor = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    region = SharedRegion(tensor.nbytes) if shm else None
    try:
        socket.connect(f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}")
        desc, tensors = TensorDesc(name, "float32", shape), [tensor]
        if region is not None:
            shared = region.tensor(tensor.dtype, shape)
            shared.array[:] = tensor
            desc, tensors = shared.desc(name), []
        legs: dict[str, list[float]] = {leg: [] for leg in LEGS}
        for index in range(requests):
            header = encode_infer(InferRequest(index, model, (desc,)))
            sent = time.monotonic() * 1000.0
            socket.send_multipart([b"", header, *tensors], copy=False)
            frames = socket.recv_multipart()
            received = time.monotonic() * 1000.0
            timing = msgpack.unpackb(frames[1])["timing"]
            if index < _SKIP:
                continue
            legs["send"].append(timing["accepted_clock_ms"] - sent)
            legs["dispatch"].append(timing["queue_ms"] + timing["dispatch_ms"])
            for leg in ("decode", "model", "encode"):
                legs[leg].append(timing[f"{leg}_ms"])
            legs["reply"].append(received - timing["accepted_clock_ms"] - timing["total_ms"])
            legs["overhead"].append(received - sent - timing["model_ms"])
        return {leg: statistics.median(values) for leg, values in legs.items()}
    finally:
        if region is not None:
            region.close()
        socket.close(linger=0)
        context.term()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)


def main() -> int:
    """Alternate the two configs and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", choices=sorted(SHAPES))
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--requests", type=int, default=130)
    parser.add_argument("--cpu-latency-us", type=int, help="config cpu_latency_us on both sides (root)")
    parser.add_argument("--set", action="append", default=[], help="KEY=JSON, top-level config of the B side")
    parser.add_argument("--both", action="append", default=[], help="KEY=JSON, top-level config of both sides")
    parser.add_argument("--shm", action="store_true", help="the B side's input in shared memory, not a frame")
    args = parser.parse_args()
    if args.requests <= _SKIP:
        parser.error(f"--requests must be more than {_SKIP}")
    change, common = (
        {key: json.loads(value) for key, value in (item.split("=", 1) for item in items)}
        for items in (args.set, args.both)
    )
    base = {
        "log_level": "warning",
        "cpu_latency_us": args.cpu_latency_us,
        "models": {args.model: builtin_entry(args.model, workers=1, warmup_iterations=3)},
        **common,
    }
    sides = {"A": base, "B": {**base, **change}}
    label = {"A": "as is", "B": " ".join([*args.set, *(["shm"] if args.shm else [])]) or "as is"}
    tmp = Path(tempfile.mkdtemp(prefix="infervisor-legs-"))
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    both = "".join(f"; {item}" for item in args.both)
    count = args.requests - _SKIP
    print(f"{args.model}, one worker, cpu_latency_us {args.cpu_latency_us}{both}; medians in ms of {count}")
    print(f"{'run':<6} {'side':<24}" + "".join(f"{leg:>10}" for leg in LEGS))
    for pair in range(args.pairs):
        for side in ("A", "B"):
            medians = run(args.model, args.requests, sides[side], tmp / f"{side}{pair}", args.shm and side == "B")
            results[side].append(medians)
            print(f"{pair + 1:<6} {label[side]:<24}" + "".join(f"{medians[leg]:>10.3f}" for leg in LEGS))
    print("\nper leg, ranges over the runs (A -> B):")
    for leg in LEGS:
        a = [r[leg] for r in results["A"]]
        b = [r[leg] for r in results["B"]]
        lower = sum(y < x for x, y in zip(a, b, strict=True))
        ranges = f"{min(a):.3f}-{max(a):.3f} -> {min(b):.3f}-{max(b):.3f}"
        print(f"  {leg:<9} {ranges}  (B lower in {lower} of {args.pairs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
