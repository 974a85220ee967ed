"""Load generators against a served model: paced (open loop, what `probe` and `optimize`'s check offer) and closed loop.

`infervisor probe` and the final check of `infervisor optimize` use the same paced load, so the
P99 that optimize promises for a QPS is measured the way probe measures it later against the
served model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from infervisor.protocol.client import Client
from infervisor.protocol.errors import InferenceError
from infervisor.supervisor.toolkit.probe import Sample

#: One request's named arrays, or several sent in turn (the sizes a model serves, optimize's check).
Inputs = dict[str, Any] | Sequence[dict[str, Any]]


def _cycle(inputs: Inputs) -> Sequence[dict[str, Any]]:
    return [inputs] if isinstance(inputs, dict) else inputs


def paced_load(
    endpoint: str, model: str, inputs: Inputs, qps: float, seconds: float, clients: int
) -> tuple[list[Sample], int]:
    """`clients` threads sending at `qps` in total for `seconds` (bounded in time and count); samples and errors.

    Several inputs are sent in turn, each client starting at its own one.
    """
    turns = _cycle(inputs)
    samples: list[Sample] = []
    errors = [0]
    lock = threading.Lock()
    start = time.monotonic() + 0.2
    interval = clients / qps
    count = max(1, int(qps * seconds / clients))

    def run(offset: int) -> None:
        with Client(endpoint) as client:
            for k in range(count):
                due = start + (offset / clients + k) * interval
                time.sleep(max(0.0, due - time.monotonic()))
                sent = time.monotonic() * 1000.0
                try:
                    arrays = turns[(offset + k) % len(turns)]
                    _, timing = client.infer_with_timing(model, arrays, timeout=30)
                except InferenceError:
                    with lock:
                        errors[0] += 1
                    continue
                received = time.monotonic() * 1000.0
                with lock:
                    samples.append(Sample(sent, received, timing))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    return samples, errors[0]


def closed_loop(endpoint: str, model: str, inputs: Inputs, clients: int, seconds: float) -> tuple[int, int]:
    """`clients` threads each sending its next request as soon as the last is answered: (answered, errors)."""
    turns = _cycle(inputs)
    counts = [0] * clients
    errors = [0] * clients
    stop = time.monotonic() + seconds

    def run(index: int) -> None:
        with Client(endpoint) as client:
            sent = index
            while time.monotonic() < stop:
                sent += 1
                try:
                    client.infer(model, turns[sent % len(turns)], timeout=30)
                except InferenceError:
                    errors[index] += 1
                    continue
                counts[index] += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    return sum(counts), sum(errors)
