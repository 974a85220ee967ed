"""Dynamic batching against none: 1, 8 and 32 client processes per model, the two daemons in alternating runs.

    python bench/batching.py [--models tiny,encoder,resnet50] [--clients 1,8,32] [--seconds 8] [--pairs 2]
                             [--delay-us 0] [--max-batch 32] [--json out.json]

Each pair starts a daemon without batching, measures every client count, stops it, then does the
same with `batching` on (the next pair in the other order), so both see the same machine within
minutes. Both daemons serve the model
the same way (workers, cores, profiles); only `batching` differs. Per row: req/s, p50, p99, and
the mean batch size the daemon formed; the summary gives the median on/off ratio over the pairs.
`resnet50` serves as configs/default.json configures it (its first start compiles packages into
the cache directory, which later starts load).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import start_daemon  # noqa: E402
from protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from supervisor.control import control_request  # noqa: E402
from supervisor.status import percentile  # noqa: E402

#: Each model's inputs (one request's), and its config entry without batching.
MODELS: dict[str, tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, Any]]] = {
    "tiny": (
        {"x": ("float32", (1, 16))},
        {"source": {"builtin": "tiny"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [None, 16]}],
         "workers": 1, "prefetch": 4, "queue_size": 256},
    ),
    "encoder": (
        {"input_ids": ("int64", (1, 128)), "attention_mask": ("int64", (1, 128))},
        {"source": {"builtin": "encoder"},
         "inputs": [{"name": "input_ids", "dtype": "int64", "shape": [None, 128]},
                    {"name": "attention_mask", "dtype": "int64", "shape": [None, 128]}],
         "workers": 2, "queue_size": 256},
    ),
    "resnet50": (
        {"image": ("float32", (1, 3, 224, 224))},
        {**json.loads((ROOT / "configs" / "default.json").read_text())["models"]["resnet50"], "queue_size": 256},
    ),
}  # fmt: skip


def _inputs(model: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    made: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in MODELS[model][0].items():
        integers = dtype == "int64"  # token ids of the encoder
        made[name] = (rng.integers(0, 1000, shape) if integers else rng.standard_normal(shape)).astype(dtype)
    return made


def client(endpoint: str, model: str, seconds: float, pipe: Any) -> None:
    """One client process: warm, say so, wait for the common start, then back-to-back requests; send latencies home."""
    import zmq

    from protocol.client_messages import InferRequest, encode_infer
    from protocol.tensors import TensorDesc

    inputs = _inputs(model)
    descs = tuple(TensorDesc(name, array.dtype.name, array.shape) for name, array in inputs.items())
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 120_000)
    socket.connect(endpoint)
    latencies: list[float] = []
    errors = 0
    request_id = 0

    def call() -> bool:
        nonlocal request_id
        request_id += 1
        frames: list[Any] = [b"", encode_infer(InferRequest(request_id, model, descs)), *inputs.values()]
        socket.send_multipart(frames)
        return bool(msgpack.unpackb(socket.recv_multipart()[1]).get("type") == "result")

    call()  # connected and warm before the clock starts
    pipe.send("ready")
    start_at = pipe.recv()
    while time.time() < start_at:
        time.sleep(0.001)
    while time.time() < start_at + seconds:
        started = time.perf_counter()
        if call():
            latencies.append((time.perf_counter() - started) * 1000.0)
        else:
            errors += 1
    socket.close()
    pipe.send((latencies, errors))


def _batch_sizes(runtime_dir: Path, model: str) -> dict[str, int]:
    batching = control_request(runtime_dir, {"cmd": "status"})["models"][model].get("batching") or {}
    sizes: dict[str, int] = batching.get("batch_sizes") or {}
    return sizes


def measure(runtime_dir: Path, model: str, clients: int, seconds: float) -> dict[str, Any]:
    """req/s, p50, p99 and the mean batch size of `clients` client processes for `seconds`."""
    before = _batch_sizes(runtime_dir, model)
    ctx = multiprocessing.get_context("spawn")
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    pipes, procs = [], []
    for _ in range(clients):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=client, args=(endpoint, model, seconds, theirs))
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    for pipe in pipes:  # every client started and warm: however long spawning took, they all start together
        pipe.recv()
    start_at = time.time() + 0.5
    for pipe in pipes:
        pipe.send(start_at)
    latencies: list[float] = []
    errors = 0
    for pipe in pipes:
        got, errs = pipe.recv()
        latencies.extend(got)
        errors += errs
    for proc in procs:
        proc.join(30)
    after = _batch_sizes(runtime_dir, model)
    batches = {int(k): after.get(k, 0) - before.get(k, 0) for k in after}
    formed = sum(batches.values())
    return {
        "req_s": round(len(latencies) / seconds, 1),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "errors": errors,
        "mean_batch": round(sum(k * v for k, v in batches.items()) / formed, 2) if formed else None,
    }


def run_daemon(model: str, batching: dict[str, Any] | None, folder: Path, clients: list[int], seconds: float,
               cache: Path) -> dict[int, dict[str, Any]]:  # fmt: skip
    """Start one daemon (with or without batching), measure every client count, stop it."""
    entry = {**MODELS[model][1], "batching": batching}
    config = {"log_level": "warning", "cache_dir": str(cache), "models": {model: entry}}
    runtime_dir = folder / f"{model}-{'on' if batching else 'off'}-{time.monotonic_ns()}"
    daemon = start_daemon(config, runtime_dir)
    try:
        return {n: measure(runtime_dir, model, n, seconds) for n in clients}
    finally:
        daemon.terminate()
        daemon.wait(60)


def ratio(rows: list[dict[str, Any]], key: str) -> float | None:
    """Median over the pairs of `key` with batching on over off (rows of one model and client count)."""
    offs = [r for r in rows if not r["batching"]]
    ons = [r for r in rows if r["batching"]]
    pairs = [(on[key], off[key]) for off, on in zip(offs, ons, strict=True) if on[key] and off[key]]
    return round(statistics.median(a / b for a, b in pairs), 3) if pairs else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,encoder,resnet50")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--pairs", type=int, default=2, help="off/on runs alternated per model")
    parser.add_argument("--delay-us", type=int, default=0, help="max_queue_delay_us of the batching daemon")
    parser.add_argument("--max-batch", type=int, default=32, help="max_batch_size (rows) of the batching daemon")
    parser.add_argument("--cache-dir", help="compiled packages (default: a folder kept under the temp dir)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    batching = {"max_batch_size": args.max_batch, "max_queue_delay_us": args.delay_us}
    folder = Path(tempfile.mkdtemp(prefix="infervisor-batching-"))
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.gettempdir()) / "infervisor-bench-cache"
    rows: list[dict[str, Any]] = []
    print(f"{'model':<9} {'clients':>7} {'batching':>8} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'batch':>6}  pair")
    for model in args.models.split(","):
        for pair in range(args.pairs):
            # ABBA: whichever side runs second in a pair sees the machine a minute later; alternate it.
            for policy in (None, batching) if pair % 2 == 0 else (batching, None):
                for n, figures in run_daemon(model, policy, folder, clients, args.seconds, cache).items():
                    row = {"model": model, "clients": n, "batching": policy is not None, "pair": pair, **figures}
                    rows.append(row)
                    print(f"{model:<9} {n:>7} {'on' if policy else 'off':>8} {figures['req_s']:>9.1f} "
                          f"{figures['p50_ms'] or 0:>9.2f} {figures['p99_ms'] or 0:>9.2f} "
                          f"{figures['mean_batch'] or '-':>6}  {pair}", flush=True)  # fmt: skip
    print("\nmedian on/off over the pairs (req/s: >1 is a gain; p50: <1 is a gain)")
    for model in args.models.split(","):
        for n in clients:
            same = [r for r in rows if r["model"] == model and r["clients"] == n]
            ratios = {key: ratio(same, key) for key in ("req_s", "p50_ms", "p99_ms")}
            text = "  ".join(f"{key} x{value}" for key, value in ratios.items())
            print(f"{model:<9} {n:>3} clients: {text}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
