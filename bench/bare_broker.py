"""The baseline: the smallest pyzmq broker that could serve a model (ROUTER<->DEALER, msgpack, raw frames).

It has no validation, queue bound, deadlines, heartbeats or recovery; the transport benchmark runs it
beside the daemon in the same session so the daemon's cost is read as a ratio, not a noisy absolute.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq


def broker(runtime_dir: str) -> None:
    """Forward client requests to ready workers, first come first served."""
    context: zmq.Context[Any] = zmq.Context()
    front = context.socket(zmq.ROUTER)
    front.bind(f"ipc://{runtime_dir}/infer.sock")
    back = context.socket(zmq.ROUTER)
    back.bind(f"ipc://{runtime_dir}/workers.sock")
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    idle: collections.deque[bytes] = collections.deque()
    waiting: collections.deque[list[Any]] = collections.deque()
    while True:
        events = dict(poller.poll(100))
        if back in events:
            frames = back.recv_multipart(copy=False)
            idle.append(frames[0].bytes)
            if len(frames) > 2:
                front.send_multipart(frames[1:], copy=False)
        if front in events:
            waiting.append(front.recv_multipart(copy=False))
        while idle and waiting:
            back.send_multipart([idle.popleft(), *waiting.popleft()], copy=False)


def worker(runtime_dir: str, model: str, cpu: int) -> None:
    """Run the built-in model on each request and answer with a result header."""
    os.sched_setaffinity(0, {cpu})
    os.environ["OMP_NUM_THREADS"] = "1"
    import numpy as np
    import torch

    from infervisor.worker.models import BUILTIN_OUTPUTS, build_builtin

    torch.set_num_threads(1)
    module = build_builtin(model)
    output = BUILTIN_OUTPUTS[model][0]
    context: zmq.Context[Any] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(f"ipc://{runtime_dir}/workers.sock")
    socket.send(b"ready")
    while True:
        client, empty, header, *tensors = socket.recv_multipart(copy=False)
        request = msgpack.unpackb(header.bytes)
        desc = request["inputs"][0]
        x = torch.frombuffer(tensors[0].buffer, dtype=torch.float32).reshape(desc["shape"])
        started = time.perf_counter()
        with torch.inference_mode():
            y = np.ascontiguousarray(module(x).numpy())
        # The model's own time, as the daemon's workers report it, so both get an overhead column.
        timing = {"model_ms": (time.perf_counter() - started) * 1000.0}
        reply = {"v": 1, "type": "result", "id": request["id"], "model": model, "timing": timing,
                 "outputs": [{"name": output, "dtype": "float32", "shape": list(y.shape)}]}  # fmt: skip
        socket.send_multipart([client, empty, msgpack.packb(reply), y], copy=False)


def start(runtime_dir: Path, model: str, workers: int) -> list[multiprocessing.process.BaseProcess]:
    """Start the broker and `workers` pinned workers (spawned, daemonic); returns the processes."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    cpus = sorted(os.sched_getaffinity(0))
    processes: list[multiprocessing.process.BaseProcess] = [
        context.Process(target=broker, args=(str(runtime_dir),), daemon=True)
    ]
    processes += [
        context.Process(target=worker, args=(str(runtime_dir), model, cpus[i % len(cpus)]), daemon=True)
        for i in range(workers)
    ]
    for process in processes:
        process.start()
    return processes
