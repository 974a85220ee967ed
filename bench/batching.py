"""Dynamic batching against none: 1, 8 and 32 client processes per model, two live daemons in alternating runs.

    python bench/batching.py [--models tiny,encoder,resnet50] [--clients 1,8,32] [--seconds 5]
                             [--pairs 1] [--rounds 3] [--delay-us 0 | MODEL=D,...] [--max-batch 32] [--tokens 128]
                             [--set MODEL.KEY=JSON ...] [--set-on MODEL.KEY=JSON ...] [--control] [--json out.json]

Each pair starts two daemons of the model, one without batching and one with it, which serve it
the same way (workers, cores, profiles): only `batching` differs, and what `--set-on` sets on the
batching one (`--set` sets a key on both). Both stay up while every round measures each client
count on one and then the other, in alternating order, so each on/off ratio compares two runs
seconds apart on the same two daemons. Per row: req/s, p50, p99, the mean batch size the daemon
formed (over the measured requests), and the CPU time per request of the daemon
(supervisor and workers) and of the clients; the summary gives the median on/off ratio over the
rounds with its range. `--control` runs both daemons without batching: its ratios are the noise.
Each encoder client sends a sentence of its own length, padded to `--tokens`. `resnet50` serves
as configs/default.json configures it (its first start compiles packages into the cache
directory, which later starts load).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
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
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402

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

#: The encoder's vocabulary: token ids a real tokenizer could give (0 is its padding id).
_VOCAB = 30522


def with_tokens(model: str, tokens: int) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, Any]]:
    """The model's inputs and entry, the encoder's padded to `tokens` (its clients pad every sentence to them)."""
    shapes, entry = MODELS[model]
    if model != "encoder":
        return shapes, entry
    inputs = [{**spec, "shape": [None, tokens]} for spec in entry["inputs"]]
    return {name: (dtype, (1, tokens)) for name, (dtype, _) in shapes.items()}, {**entry, "inputs": inputs}


def request_inputs(shapes: dict[str, tuple[str, tuple[int, ...]]], seed: int) -> dict[str, np.ndarray]:
    """One request's inputs: for the encoder a sentence of its own length, then padding; else normal floats."""
    rng = np.random.default_rng(seed)
    if "input_ids" in shapes:
        tokens = shapes["input_ids"][1][1]
        mask = (np.arange(tokens) < rng.integers(max(1, tokens // 4), tokens + 1))[None, :]
        return {
            "input_ids": np.where(mask, rng.integers(1000, _VOCAB, (1, tokens)), 0).astype(np.int64),
            "attention_mask": mask.astype(np.int64),
        }
    return {name: rng.standard_normal(shape).astype(dtype) for name, (dtype, shape) in shapes.items()}


def client(endpoint: str, model: str, shapes: dict[str, tuple[str, tuple[int, ...]]], seed: int, seconds: float,
           pipe: Any) -> None:  # fmt: skip
    """One client process: warm, say so, wait for the common start, then back-to-back requests; send latencies home."""
    import zmq

    from infervisor.protocol.client_messages import InferRequest, encode_infer
    from infervisor.protocol.tensors import TensorDesc

    inputs = request_inputs(shapes, seed)
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
    cpu_started = time.process_time()
    while time.time() < start_at + seconds:
        started = time.perf_counter()
        if call():
            latencies.append((time.perf_counter() - started) * 1000.0)
        else:
            errors += 1
    cpu_used = time.process_time() - cpu_started
    socket.close()
    pipe.send((latencies, errors, cpu_used))


def _batch_sizes(runtime_dir: Path, model: str) -> dict[str, int]:
    batching = control_request(runtime_dir, {"cmd": "status"})["models"][model].get("batching") or {}
    sizes: dict[str, int] = batching.get("batch_sizes") or {}
    return sizes


def cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU time (user + system) of a process and all its threads so far, with its child processes' (the workers)."""
    total = 0.0
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
            kids += [int(c) for c in (task / "children").read_text().split()] if children else []
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # it exited between the listing and the read
    return total / os.sysconf("SC_CLK_TCK") + sum(cpu_seconds(kid) for kid in kids)


def measure(runtime_dir: Path, model: str, shapes: dict[str, tuple[str, tuple[int, ...]]], clients: int,
            seconds: float, daemon_pid: int) -> dict[str, Any]:  # fmt: skip
    """req/s, p50, p99, the mean batch size, and the daemon's CPU per request of `clients` client processes."""
    ctx = multiprocessing.get_context("spawn")
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    pipes, procs = [], []
    for seed in range(clients):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=client, args=(endpoint, model, shapes, seed, seconds, theirs))
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    for pipe in pipes:  # every client started and warm: however long spawning took, they all start together
        pipe.recv()
    before = _batch_sizes(runtime_dir, model)  # after the clients' warm-up calls, which go one at a time
    start_at = time.time() + 0.5
    cpu_before, supervisor_before = cpu_seconds(daemon_pid), cpu_seconds(daemon_pid, children=False)
    for pipe in pipes:
        pipe.send(start_at)
    latencies: list[float] = []
    errors = 0
    clients_cpu = 0.0
    for pipe in pipes:
        got, errs, cpu = pipe.recv()
        latencies.extend(got)
        errors += errs
        clients_cpu += cpu
    cpu_used = cpu_seconds(daemon_pid) - cpu_before
    supervisor_used = cpu_seconds(daemon_pid, children=False) - supervisor_before
    for proc in procs:
        proc.join(30)
    after = _batch_sizes(runtime_dir, model)
    batches = {int(k): after.get(k, 0) - before.get(k, 0) for k in after}

    def per_request(cpu: float) -> float | None:
        return round(cpu * 1e6 / len(latencies), 1) if latencies else None

    formed = sum(batches.values())
    return {
        "req_s": round(len(latencies) / seconds, 1),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "errors": errors,
        "mean_batch": round(sum(k * v for k, v in batches.items()) / formed, 2) if formed else None,
        # Supervisor and workers together: what a request costs the daemon.
        "cpu_us": per_request(cpu_used),
        "supervisor_cpu_us": per_request(supervisor_used),
        # The clients' own: with the daemon's, what bounds req/s once clients and daemon fill the box's cores.
        "client_cpu_us": per_request(clients_cpu),
        "total_cpu_us": per_request(cpu_used + clients_cpu),
    }


def start_side(model: str, entry: dict[str, Any], batching: dict[str, Any] | None, folder: Path,
               cache: Path) -> tuple[subprocess.Popen[bytes], Path]:  # fmt: skip
    """Start one daemon of `model` (with or without batching) and wait until it serves."""
    config = {"log_level": "warning", "cache_dir": str(cache), "models": {model: {**entry, "batching": batching}}}
    runtime_dir = folder / f"{model}-{'on' if batching else 'off'}-{time.monotonic_ns()}"
    return start_daemon(config, runtime_dir), runtime_dir


def ratio(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float] | None:
    """Median, lowest and highest over the rounds of `key` with batching on over off (one model and client count)."""
    offs = {(r["pair"], r["round"]): r[key] for r in rows if not r["batching"]}
    ratios = [
        r[key] / offs[(r["pair"], r["round"])]
        for r in rows
        if r["batching"] and r[key] and offs.get((r["pair"], r["round"]))
    ]
    return (round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)) if ratios else None


def per_model(text: str, models: list[str]) -> dict[str, int]:
    """`2000` (every model) or `encoder=2000,tiny=0` (the rest 0) as a value per model."""
    if "=" not in text:
        return dict.fromkeys(models, int(text))
    given = {name: int(value) for name, value in (item.split("=", 1) for item in text.split(","))}
    return {model: given.get(model, 0) for model in models}


def entry_of(model: str, sets: list[str], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model's config entry (`base`, else without batching) with the `MODEL.KEY=JSON` overrides of `sets`."""
    entry = dict(MODELS[model][1] if base is None else base)
    for item in sets:
        target, value = item.split("=", 1)
        name, key = target.split(".", 1)
        if name == model:
            entry[key] = json.loads(value)
    return entry


#: The figures whose on/off ratios the summary gives.
SUMMARY_KEYS = ("req_s", "p50_ms", "p99_ms", "cpu_us", "supervisor_cpu_us", "total_cpu_us")


def print_row(row: dict[str, Any]) -> None:
    """One measurement as a line of the table."""
    print(
        f"{row['model']:<9} {row['clients']:>7} {'on' if row['batching'] else 'off':>8} {row['req_s']:>9.1f} "
        f"{row['p50_ms'] or 0:>9.2f} {row['p99_ms'] or 0:>9.2f} {row['mean_batch'] or '-':>6} "
        f"{row['cpu_us'] or 0:>9.0f} {row['supervisor_cpu_us'] or 0:>9.0f} {row['client_cpu_us'] or 0:>9.0f}  "
        f"{row['pair']}.{row['round']}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,encoder,resnet50")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--pairs", type=int, default=1, help="off/on daemon pairs started per model")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurements per pair and client count")
    parser.add_argument("--delay-us", default="0", help="max_queue_delay_us of the batching daemon: D, or MODEL=D,...")
    parser.add_argument("--tokens", type=int, default=128, help="the encoder's sequence length (every sentence padded)")
    parser.add_argument("--max-batch", type=int, default=32, help="max_batch_size (rows) of the batching daemon")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=JSON",
                        help="override a key of a model's entry on both sides, e.g. encoder.workers=1")  # fmt: skip
    parser.add_argument("--set-on", action="append", default=[], metavar="MODEL.KEY=JSON",
                        help="as --set, for the batching daemon only, e.g. tiny.prefetch=2")  # fmt: skip
    parser.add_argument("--control", action="store_true", help="A/A: the 'on' daemon runs without batching too")
    parser.add_argument("--cache-dir", help="compiled packages (default: a folder kept under the temp dir)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    models = args.models.split(",")
    clients = [int(c) for c in args.clients.split(",")]
    delays = per_model(args.delay_us, models)
    folder = Path(tempfile.mkdtemp(prefix="infervisor-batching-"))
    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.gettempdir()) / "infervisor-bench-cache"
    rows: list[dict[str, Any]] = []
    print(f"{'model':<9} {'clients':>7} {'batching':>8} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'batch':>6}", end="")
    print(f" {'daemon us':>9} {'of it sup':>9} {'client us':>9}  round")
    for model in models:
        shapes, plain = with_tokens(model, args.tokens)
        entry = entry_of(model, args.set, plain)
        entry_on = entry_of(model, args.set_on, entry)
        batching = {"max_batch_size": args.max_batch, "max_queue_delay_us": delays[model]}
        for pair in range(args.pairs):
            # Both daemons stay up for the whole pair, and each round runs them back to back in
            # alternating order: a ratio then compares two runs seconds apart, not two daemon starts.
            sides = {False: start_side(model, entry, None, folder, cache)}
            try:
                sides[True] = start_side(model, entry_on, None if args.control else batching, folder, cache)
                for round_ in range(args.rounds):
                    for n in clients:
                        order = (False, True) if (pair + round_ + n) % 2 == 0 else (True, False)
                        for on in order:
                            figures = measure(sides[on][1], model, shapes, n, args.seconds, sides[on][0].pid)
                            row = {
                                "model": model,
                                "clients": n,
                                "batching": on,
                                "pair": pair,
                                "round": round_,
                                **figures,
                            }
                            rows.append(row)
                            print_row(row)
            finally:
                for daemon, _ in sides.values():
                    daemon.terminate()
                for daemon, _ in sides.values():
                    daemon.wait(60)
    print("\non/off over the rounds: median (lowest-highest); req/s >1 is a gain; p50, p99 and cpu <1 are")
    print("(cpu_us: the daemon's CPU per request; total_cpu_us: with the clients', which bounds req/s on a full box)")
    for model in models:
        for n in clients:
            same = [r for r in rows if r["model"] == model and r["clients"] == n]
            ratios = {key: ratio(same, key) for key in SUMMARY_KEYS}
            text = "  ".join(f"{key} x{v[0]} ({v[1]}-{v[2]})" for key, v in ratios.items() if v)
            print(f"{model:<9} {n:>3} clients: {text}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
