"""Transport benchmark: the daemon's round trip against an in-process call, 1 sequential client and N concurrent.

    python bench/transport.py [--models tiny,resnet18] [--clients 8] [--seconds 5] [--json out.json]
                              [--workers tiny=1,resnet18=2] [--prefetch tiny=4,resnet18=2] [--bare-workers 2]
                              [--float-supervisor] [--cpu-latency-us 0]
                              [--config configs/default.json] [--kinds raw,shm,client]

All figures come from one run on one machine, so compare ratios, not absolutes across runs.

Each side runs in the layout that serves it best here. The daemon gives `tiny` one worker holding
4 requests: a 6 µs model needs no second core, and a second pinned process would only compete with
the 8 clients for this machine's two vCPUs. The bare broker has no prefetch, so it needs two
workers to keep one busy while the other answers (with one it does 5,000-6,500 req/s here).

`--cpu-latency-us N` sets the daemon's `cpu_latency_us` (idle CPUs wake within N µs), and holds the
same request while the in-process and bare-broker rows run, so every row sees the same idle CPUs.
It needs write access to /dev/cpu_dma_latency (root).

`--config FILE` serves that file's models as it configures them (profiles, pick, workers, prefetch,
cache_dir and its other keys), instead of eager built-ins in the bench's layout, and runs only the
daemon rows: the baselines run the eager model, which would not be the one served. Each model's
name must be a built-in the clients know the input of (tiny, resnet18, resnet50). Give the file a
`cache_dir` that persists, so a compiled profile is built once and never timed.

`--kinds` runs only those client kinds against the daemon (raw, shm, client; all by default): with
`raw` alone a run is a third as long, so alternating runs of two builds come closer in time. The
ratios need the raw-socket rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import structlog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import SHAPES, builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client import Client  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.sockets import send_frames  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402


def in_process(model: str, seconds: float, threads: int) -> list[float]:
    """Latencies (ms) of the eager model called directly, pinned like a worker with `threads` threads."""
    import torch

    from infervisor.worker.models import build_builtin

    torch.set_num_threads(threads)
    module = build_builtin(model)
    name, shape = SHAPES[model]
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    latencies: list[float] = []
    allowed = os.sched_getaffinity(0)
    # On `threads` cores for the run, as a worker is: an unpinned loop migrates and runs slower,
    # which would flatter every figure measured against it. Restored, or the clients would inherit it.
    os.sched_setaffinity(0, set(sorted(allowed)[:threads]))
    try:
        with torch.inference_mode():
            for _ in range(3):
                module(x)
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop and len(latencies) < 200_000:
                started = time.perf_counter()
                module(x)
                latencies.append((time.perf_counter() - started) * 1000.0)
    finally:
        os.sched_setaffinity(0, allowed)
    return latencies


#: How a client process sends: a bare DEALER with the tensor as a frame (the same client cost for
#: daemon and baseline), the same with the tensor in a shared-memory region, or protocol.Client,
#: what an application would use.
CLIENT_KINDS = {"raw": "raw socket", "shm": "raw socket, shared memory", "client": "protocol.Client"}
#: How long the clients may take to start and answer their first request before the run fails.
_WARM_TIMEOUT_S = 120.0


def client_loop(endpoint: str, model: str, seconds: float, warm: Any, kind: str, out: Any) -> None:
    """One client process: back-to-back requests for `seconds` once every client is warm; sends its latencies home.

    `warm` is a barrier of all the clients and the parent: on a loaded machine spawning eight Python
    processes can take longer than a fixed head start, and a late client would leave the others to
    run part of the window with fewer than N clients, or record nothing at all.
    """
    import zmq

    from infervisor.protocol.client_messages import InferRequest, encode_infer
    from infervisor.protocol.shared_memory import SharedRegion
    from infervisor.protocol.tensors import TensorDesc

    name, shape = SHAPES[model]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    # Only the shared-memory kind makes a region: the others must leave nothing in /dev/shm.
    region = SharedRegion(x.nbytes) if kind == "shm" else None
    if region is not None:
        shared = region.tensor(x.dtype, x.shape)
        shared.array[:] = x
        shared_desc = (shared.desc(name),)
    latencies: list[float] = []
    errors = 0
    client = Client(endpoint)
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 60_000)
    socket.connect(endpoint)
    desc = (TensorDesc(name, "float32", shape),)
    counter = iter(range(10**9))

    def call() -> float | None:
        """One request; returns the worker's own model time when the reply reports it."""
        if kind != "client":
            frames: list[Any] = (
                [b"", encode_infer(InferRequest(next(counter), model, desc)), x]
                if kind == "raw"
                else [b"", encode_infer(InferRequest(next(counter), model, shared_desc))]
            )
            send_frames(socket, frames)
            header = msgpack.unpackb(socket.recv_multipart()[1])
            if header.get("type") != "result":
                raise RuntimeError("error reply")
            timing = header.get("timing") or {}
        else:
            timing = client.infer_with_timing(model, {name: x}, timeout=60)[1]
        model_ms = timing.get("model_ms")
        return float(model_ms) if model_ms is not None else None

    warm_until = time.time() + 60
    while time.time() < warm_until:
        try:
            call()
            break
        except Exception:  # noqa: BLE001 - the baseline may not be listening yet
            time.sleep(0.1)
    warm.wait(_WARM_TIMEOUT_S)
    stop = time.time() + seconds
    overheads: list[float] = []
    while time.time() < stop and len(latencies) < 500_000:
        started = time.perf_counter()
        try:
            model_ms = call()
        except Exception:  # noqa: BLE001 - counted; the benchmark reports errors instead of dying
            errors += 1
            continue
        latencies.append((time.perf_counter() - started) * 1000.0)
        if model_ms is not None:
            overheads.append(latencies[-1] - model_ms)
    client.close()
    socket.close()
    if region is not None:
        region.close()
    out.send((latencies, overheads, errors))


def run_clients(
    endpoint: str, model: str, clients: int, seconds: float, kind: str
) -> tuple[list[float], list[float], int]:
    """Latencies, overheads (latency minus the worker's model time) and errors of `clients` client processes."""
    ctx = multiprocessing.get_context("spawn")
    pipes = []
    procs = []
    warm = ctx.Barrier(clients + 1)
    for _ in range(clients):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=client_loop, args=(endpoint, model, seconds, warm, kind, sender))
        proc.start()
        pipes.append(receiver)
        procs.append(proc)
    warm.wait(_WARM_TIMEOUT_S)
    latencies: list[float] = []
    overheads: list[float] = []
    errors = 0
    for receiver in pipes:
        got, over, errs = receiver.recv()
        latencies.extend(got)
        overheads.extend(over)
        errors += errs
    for proc in procs:
        proc.join(30)
    return latencies, overheads, errors


def row(
    model: str,
    label: str,
    latencies: list[float],
    seconds: float,
    errors: int = 0,
    overheads: list[float] | None = None,
) -> dict[str, Any]:
    """One table row."""
    return {
        "model": model,
        "path": label,
        "n": len(latencies),
        "errors": errors,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "req_s": round(len(latencies) / seconds, 1),
        "overhead_p50_ms": percentile(overheads, 50) if overheads else None,
    }


def per_model(text: str, models: list[str]) -> dict[str, int]:
    """`N` for every model, or `model=N,...` (each model named once)."""
    if "=" not in text:
        return dict.fromkeys(models, int(text))
    values = {name: int(value) for name, _, value in (part.partition("=") for part in text.split(","))}
    missing = [m for m in models if m not in values]
    if missing:
        raise SystemExit(f"no value for {', '.join(missing)} in {text!r}")
    return values


def measure(
    model: str,
    clients: int,
    seconds: float,
    layout: tuple[int, int, int],
    pin: bool,
    cpu_latency_us: int | None,
    tmp: Path,
    kinds: list[str],
    served: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """All rows of one model: in-process, the bare baseline and the daemon, 1 and N clients.

    `layout` is the daemon's workers and prefetch, then the bare broker's workers. With `served`
    (a config.json of this model), the daemon runs that config and the baselines do not run.
    """
    workers, prefetch, bare_workers = layout
    rows = [] if served is not None else baselines(model, clients, seconds, bare_workers, cpu_latency_us, tmp)
    daemon_dir = tmp / f"daemon-{model}"
    config = served or {
        "oversubscribe": True,
        "pin_supervisor": pin,
        "cpu_latency_us": cpu_latency_us,
        "models": {model: builtin_entry(model, workers=workers, queue_size=1024, prefetch=prefetch)},
    }
    daemon = start_daemon({**config, "log_level": "warning"}, daemon_dir)
    try:
        endpoint = f"ipc://{daemon_dir / CLIENT_SOCKET_NAME}"
        for kind in kinds:
            for n in (1, clients):
                latencies, overheads, errors = run_clients(endpoint, model, n, seconds, kind)
                rows.append(
                    row(model, f"daemon, {n} client(s), {CLIENT_KINDS[kind]}", latencies, seconds, errors, overheads)
                )
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    return rows


def baselines(
    model: str, clients: int, seconds: float, bare_workers: int, cpu_latency_us: int | None, tmp: Path
) -> list[dict[str, Any]]:
    """The eager model in-process, and behind the bare pyzmq broker with 1 and N clients."""
    from bench import bare_broker
    from infervisor.supervisor.host.cpu_latency import CpuLatencyHold

    # The baselines get the idle policy the daemon will hold for itself; the daemon's rows run on its own hold.
    hold = CpuLatencyHold()
    hold.reconcile(cpu_latency_us, throttled=False)
    if hold.error is not None:
        raise SystemExit(f"--cpu-latency-us: {hold.error}")
    try:
        rows = [row(model, "in-process, 1 thread", in_process(model, seconds, threads=1), seconds)]
        bare_dir = tmp / f"bare-{model}"
        processes = bare_broker.start(bare_dir, model, bare_workers)
        try:
            endpoint = f"ipc://{bare_dir / CLIENT_SOCKET_NAME}"
            for n in (1, clients):
                latencies, overheads, errors = run_clients(endpoint, model, n, seconds, "raw")
                rows.append(row(model, f"bare pyzmq, {n} client(s)", latencies, seconds, errors, overheads))
        finally:
            for process in processes:
                process.kill()
    finally:
        hold.release("bench baseline done")
    return rows


def main() -> int:
    """Run the benchmark and print the table."""
    # The latency hold logs its changes; the table is this script's only output.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,resnet18")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", default="tiny=1,resnet18=2", help="daemon workers (1 core each): N or model=N,...")
    parser.add_argument(
        "--prefetch", default="tiny=4,resnet18=2", help="requests in hand per daemon worker: N or model=N,..."
    )
    parser.add_argument("--bare-workers", type=int, default=2, help="workers of the bare broker")
    parser.add_argument(
        "--float-supervisor", action="store_true", help="config pin_supervisor=false: the supervisor may share a core"
    )
    parser.add_argument(
        "--cpu-latency-us", type=int, help="config cpu_latency_us for the daemon, held for the baselines too (root)"
    )
    parser.add_argument("--config", help="serve this config.json's models as configured; daemon rows only")
    parser.add_argument("--kinds", default=",".join(CLIENT_KINDS), help="client kinds against the daemon")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    served = json.loads(Path(args.config).read_text()) if args.config else None
    models = list(served["models"]) if served is not None else args.models.split(",")
    unknown = sorted(set(models) - set(SHAPES))
    if unknown:
        parser.error(f"no client input for model(s) {unknown}; the bench knows {sorted(SHAPES)}")
    kinds = args.kinds.split(",")
    if set(kinds) - set(CLIENT_KINDS) or (served is None and "raw" not in kinds):
        parser.error(f"--kinds: some of {sorted(CLIENT_KINDS)}, with raw unless --config is given (the ratios need it)")
    if served is None:
        workers, prefetch = per_model(args.workers, models), per_model(args.prefetch, models)
    else:  # the file lays out its own models; --workers and --prefetch do not apply
        workers = prefetch = dict.fromkeys(models, 0)
    tmp = Path(tempfile.mkdtemp(prefix="infervisor-bench-"))
    rows: list[dict[str, Any]] = []
    for model in models:
        pin = not args.float_supervisor
        layout = (workers[model], prefetch[model], args.bare_workers)
        one = None if served is None else {**served, "models": {model: served["models"][model]}}
        rows.extend(measure(model, args.clients, args.seconds, layout, pin, args.cpu_latency_us, tmp, kinds, one))
    for model in models:
        if served is not None:
            print(f"{model}: daemon as configured in {args.config}; {args.clients} client processes")
            continue
        print(
            f"{model}: daemon {workers[model]} worker(s) x 1 core, prefetch {prefetch[model]}; "
            f"pin_supervisor {'off' if args.float_supervisor else 'on'}; "
            f"cpu_latency_us {'none' if args.cpu_latency_us is None else args.cpu_latency_us}; "
            f"bare broker {args.bare_workers} worker(s) x 1 core; {args.clients} client processes"
        )
    print(
        f"{'model':<9} {'path':<58} {'n':>7} {'err':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>9} {'overhead p50':>13}"
    )
    for r in rows:
        # A row with no answered request (every one an error, or none in time) has no percentiles.
        p50, p99, overhead = ("" if r[k] is None else f"{r[k]:.3f}" for k in ("p50_ms", "p99_ms", "overhead_p50_ms"))
        print(
            f"{r['model']:<9} {r['path']:<58} {r['n']:>7} {r['errors']:>4} "
            f"{p50:>8} {p99:>8} {r['req_s']:>9.1f} {overhead:>13}"
        )
    print("overhead = round trip minus the model time the worker measured for that same request")
    if served is None:
        print_ratios(rows, models, args.clients)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def print_ratios(rows: list[dict[str, Any]], models: list[str], clients: int) -> None:
    """The daemon against the baselines of the same run, and shared-memory inputs against frames."""
    print("\nratios (daemon raw socket / bare pyzmq, same run):")
    for model in models:
        by = {r["path"]: r for r in rows if r["model"] == model}
        base = by["in-process, 1 thread"]
        for n in (1, clients):
            bare = by[f"bare pyzmq, {n} client(s)"]
            ours = by[f"daemon, {n} client(s), raw socket"]
            print(
                f"  {model}, {n} client(s): p50 x{ours['p50_ms'] / bare['p50_ms']:.2f}, "
                f"req/s x{ours['req_s'] / bare['req_s']:.2f}; "
                f"added over in-process p50: daemon {ours['p50_ms'] - base['p50_ms']:.3f} ms, "
                f"bare {bare['p50_ms'] - base['p50_ms']:.3f} ms"
            )
            shared = by.get(f"daemon, {n} client(s), {CLIENT_KINDS['shm']}")
            if shared is None:
                continue
            print(
                f"    input in shared memory: p50 x{shared['p50_ms'] / ours['p50_ms']:.2f}, "
                f"overhead p50 {ours['overhead_p50_ms']:.3f} -> {shared['overhead_p50_ms']:.3f} ms"
            )


if __name__ == "__main__":
    sys.exit(main())
