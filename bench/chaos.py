"""Chaos benchmark: clients send numbered requests while workers are killed (-9) and frozen (SIGSTOP).

    python bench/chaos.py [--clients 8] [--seconds 60] [--kill-every 3] [--workers 3] [--model resnet18]

Prints sent, ok, errors by code, duplicates and lost, and p50/p99. The promise: 0 lost, 0 duplicates,
and no failures other than WORKER_LOST for requests that outlived max_retries workers.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.daemon import SHAPES, builtin_entry, start_daemon  # noqa: E402
from infervisor.protocol.client_messages import InferRequest, encode_infer  # noqa: E402
from infervisor.protocol.constants import CLIENT_SOCKET_NAME  # noqa: E402
from infervisor.protocol.control_client import control_request  # noqa: E402
from infervisor.protocol.sockets import send_frames  # noqa: E402
from infervisor.protocol.tensors import TensorDesc  # noqa: E402
from infervisor.supervisor.observe.stats import percentile  # noqa: E402


def client(endpoint: str, model: str, seconds: float, out: Any) -> None:
    """Send numbered requests back to back on one DEALER; report every reply seen, including any extra."""
    import zmq

    name, shape = SHAPES[model]
    x = np.random.default_rng(os.getpid()).standard_normal(shape).astype(np.float32)
    desc = (TensorDesc(name, "float32", shape),)
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    sent = 0
    replies: Counter[int] = Counter()
    codes: Counter[str] = Counter()
    latencies: list[float] = []
    stop = time.time() + seconds
    while time.time() < stop:
        request_id = sent
        started = time.perf_counter()
        send_frames(socket, [b"", encode_infer(InferRequest(request_id, model, desc, 120_000)), x])
        sent += 1
        while socket.poll(130_000):
            header = msgpack.unpackb(socket.recv_multipart()[1])
            replies[header["id"]] += 1
            codes[header.get("code", "OK")] += 1
            if header["id"] == request_id:
                latencies.append((time.perf_counter() - started) * 1000.0)
                break
    while socket.poll(1000):  # a second reply to anything would show up here
        header = msgpack.unpackb(socket.recv_multipart()[1])
        replies[header["id"]] += 1
        codes[header.get("code", "OK")] += 1
    socket.close()
    out.send((sent, dict(replies), dict(codes), latencies))


def chaos(runtime_dir: Path, model: str, seconds: float, every: float, seed: int) -> Counter[str]:
    """Every `every` seconds: SIGKILL one random serving worker and SIGSTOP another."""
    rng = random.Random(seed)
    done: Counter[str] = Counter()
    stop = time.time() + seconds
    while time.time() < stop:
        time.sleep(every)
        workers = control_request(runtime_dir, {"cmd": "status"})["models"][model]["workers"]
        serving = [w["pid"] for w in workers if w["state"] == "serving"]
        rng.shuffle(serving)
        faults = [("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)]
        for pid, (what, sig) in zip(serving, faults, strict=False):
            try:
                os.kill(pid, sig)
                done[what] += 1
            except ProcessLookupError:
                pass
    return done


def main() -> int:
    """Run the clients and the chaos loop against one daemon and print the tally."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", choices=sorted(SHAPES))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    config = {
        "log_level": "warning",
        "oversubscribe": True,
        "heartbeat_interval_ms": 200,
        "heartbeat_liveness": 5,
        "hang_min_s": 2.0,
        "restart_window_s": 10,
        "max_restarts": 1000,
        "models": {
            args.model: builtin_entry(
                args.model, workers=args.workers, queue_size=4 * args.clients, warmup_iterations=1
            )
        },
    }
    runtime_dir = Path(tempfile.mkdtemp(prefix="infervisor-chaos-")) / "run"
    daemon = start_daemon(config, runtime_dir)
    endpoint = f"ipc://{runtime_dir / CLIENT_SOCKET_NAME}"
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    try:
        for _ in range(args.clients):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=client, args=(endpoint, args.model, args.seconds, sender))
            proc.start()
            pipes.append(receiver)
            procs.append(proc)
        faults = chaos(runtime_dir, args.model, args.seconds, args.kill_every, args.seed)
        sent = ok = duplicates = lost = 0
        codes: Counter[str] = Counter()
        latencies: list[float] = []
        for receiver in pipes:
            n, replies, client_codes, client_latencies = receiver.recv()
            sent += n
            lost += sum(1 for i in range(n) if replies.get(i, 0) == 0)
            duplicates += sum(c - 1 for c in replies.values() if c > 1)
            codes.update(client_codes)
            latencies.extend(client_latencies)
        ok = codes.pop("OK", 0)
        status = control_request(runtime_dir, {"cmd": "status"})
    finally:
        for proc in procs:
            proc.join(30)
        daemon.send_signal(signal.SIGTERM)
        exit_code = daemon.wait(60)
    restarts = sum(w["restarts"] for w in status["models"][args.model]["workers"])
    print(f"model {args.model}, {args.workers} workers, {args.clients} clients, {args.seconds:.0f} s")
    print(f"chaos: {dict(faults)}; worker restarts seen in status: {restarts}")
    print(f"sent {sent}  ok {ok}  errors {dict(codes) or 0}  duplicates {duplicates}  lost {lost}")
    print(f"latency p50 {percentile(latencies, 50)} ms  p99 {percentile(latencies, 99)} ms")
    print(f"daemon exit code {exit_code}")
    allowed = set(codes) <= {"WORKER_LOST"}
    return 0 if lost == 0 and duplicates == 0 and allowed and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
