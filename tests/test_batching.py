"""Dynamic batching with real workers: joined rows come back to their own requests, each with its own fate."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq
from prometheus_client.parser import text_string_to_metric_families

from infervisor.protocol.client_messages import InferRequest, encode_infer
from infervisor.protocol.tensors import TensorDesc
from tests.conftest import ENCODER_INPUTS, ROOT, TINY_INPUTS, Daemon, model_entry, wait_for
from tests.fault_models import ROW_INPUTS, SEGFAULT, SLEEP

ENV = {"PYTHONPATH": str(ROOT)}
ROWFAULTY = {"python": "tests.fault_models:rowfaulty"}


class Burst:
    """One DEALER that sends requests at once (so the broker sees them together) and collects every reply."""

    def __init__(self, daemon: Daemon) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(daemon.endpoint)
        self.replies: dict[int, list[tuple[dict[str, Any], list[bytes]]]] = {}

    def send(self, request_id: int, model: str, inputs: dict[str, np.ndarray], deadline_ms: int | None = None) -> None:
        """Send one request without waiting for its reply."""
        descs = tuple(TensorDesc(name, array.dtype.name, array.shape) for name, array in inputs.items())
        header = encode_infer(InferRequest(request_id, model, descs, deadline_ms=deadline_ms))
        self.socket.send_multipart([b"", header, *[np.ascontiguousarray(a) for a in inputs.values()]])

    def collect(self, count: int, timeout_s: float = 120) -> None:
        """Wait for `count` replies in all (and a moment more, to catch a duplicate)."""
        deadline = time.monotonic() + timeout_s
        while sum(len(r) for r in self.replies.values()) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.socket.poll(int(remaining * 1000)):
                break
            self._read()
        while self.socket.poll(300):
            self._read()

    def _read(self) -> None:
        frames = self.socket.recv_multipart()
        header = msgpack.unpackb(frames[1])
        self.replies.setdefault(header["id"], []).append((header, frames[2:]))

    def result(self, request_id: int) -> np.ndarray:
        """The one output of a successful reply, as an array."""
        ((header, frames),) = self.replies[request_id]
        assert header["type"] == "result", header
        (desc,) = header["outputs"]
        return np.frombuffer(frames[0], dtype=desc["dtype"]).reshape(desc["shape"])

    def code(self, request_id: int) -> str:
        """The error code of the one reply to a request ("result" for a success)."""
        ((header, _),) = self.replies[request_id]
        return "result" if header["type"] == "result" else str(header["code"])

    def close(self) -> None:
        """Close the socket."""
        self.socket.close()


#: The id of the request that keeps a worker busy while a test's requests gather in line behind it.
BLOCKER = 1000


def occupy_rows_worker(burst: Burst, seconds: float = 1.0) -> None:
    """Keep the one `rows` worker busy for `seconds`: what comes next waits in line and leaves as one batch.

    An idle worker takes a request at once, alone; one busy with a batch (prefetch 1) takes the whole
    line when it is done. The blocker is 4 wide, so it never joins a test's 2- or 3-wide requests.
    """
    burst.send(BLOCKER, "rows", {"x": np.array([[SLEEP, seconds, 0.0, 0.0]], np.float32)})


def _batches(daemon: Daemon, model: str) -> dict[str, int]:
    sizes: dict[str, int] = daemon.status()["models"][model]["batching"]["batch_sizes"]
    return sizes


def _rows(*values: float) -> np.ndarray:
    return np.array([[v, 0.0] for v in values], np.float32)


def test_joined_rows_are_bit_identical_to_serving_each_request_alone(start_daemon: Callable[..., Daemon]) -> None:
    """Eight encoder requests joined into one forward pass get exactly the bits each gets when sent alone."""
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0}
    encoder = model_entry({"builtin": "encoder"}, ENCODER_INPUTS, batching=batching)
    daemon = start_daemon({"models": {"encoder": encoder}})
    daemon.wait_ready(180)
    rng = np.random.default_rng(7)
    inputs = [
        {"input_ids": rng.integers(0, 1000, (1, 128)).astype(np.int64), "attention_mask": np.ones((1, 128), np.int64)}
        for _ in range(8)
    ]
    together = Burst(daemon)
    # 32 rows keep the idle worker busy (about a second) while the eight gather in line behind them.
    blocker = {"input_ids": np.zeros((32, 128), np.int64), "attention_mask": np.ones((32, 128), np.int64)}
    together.send(BLOCKER, "encoder", blocker)
    for request_id, request in enumerate(inputs):
        together.send(request_id, "encoder", request)
    together.collect(9)
    assert _batches(daemon, "encoder") == {"32": 1, "8": 1}, "the eight were joined"
    families = {f.name: f for f in text_string_to_metric_families(daemon.control({"cmd": "metrics"})["text"])}
    (count,) = [s.value for s in families["infervisor_batch_size_rows"].samples if s.name.endswith("_count")]
    assert count == 2
    with daemon.client() as client:
        for request_id, request in enumerate(inputs):
            alone = client.infer("encoder", request, timeout=60)["embedding"]
            assert np.array_equal(together.result(request_id), alone), f"request {request_id} differs"
    together.close()


def test_an_expired_request_leaves_its_batch_and_the_batch_goes_on(start_daemon: Callable[..., Daemon]) -> None:
    """Waiting in line behind a busy worker, a request with a 30 ms deadline expires; the others go as one batch."""
    batching = {"max_batch_size": 4, "max_queue_delay_us": 0}
    daemon = start_daemon({"models": {"rows": model_entry(ROWFAULTY, ROW_INPUTS, batching=batching)}}, env=ENV)
    daemon.wait_ready()
    burst = Burst(daemon)
    occupy_rows_worker(burst)
    burst.send(0, "rows", {"x": _rows(1.0)}, deadline_ms=30)
    for request_id in (1, 2):
        burst.send(request_id, "rows", {"x": _rows(float(request_id))})
    burst.collect(4)
    assert burst.code(0) == "DEADLINE_EXCEEDED"
    assert [burst.result(i)[0, 0] for i in (1, 2)] == [2.0, 3.0]
    assert _batches(daemon, "rows") == {"1": 1, "2": 1}, "the blocker alone, then the two left of three"
    burst.close()


def test_a_bad_input_fails_alone_and_its_neighbours_are_served(start_daemon: Callable[..., Daemon]) -> None:
    """A NaN input in a batch of four is answered INVALID_INPUT; the three others get their own rows back."""
    batching = {"max_batch_size": 4, "max_queue_delay_us": 0}
    daemon = start_daemon({"models": {"rows": model_entry(ROWFAULTY, ROW_INPUTS, batching=batching)}}, env=ENV)
    daemon.wait_ready()
    burst = Burst(daemon)
    occupy_rows_worker(burst)
    for request_id in range(4):
        burst.send(request_id, "rows", {"x": _rows(float("nan") if request_id == 2 else float(request_id))})
    burst.collect(5)
    assert burst.code(2) == "INVALID_INPUT"
    assert [burst.result(i)[0, 0] for i in (0, 1, 3)] == [1.0, 2.0, 4.0]
    assert _batches(daemon, "rows") == {"1": 1, "4": 1}, "the four went to the worker as one batch"
    burst.close()


def test_a_poison_request_in_a_batch_is_found_by_splitting_and_answered_alone(
    start_daemon: Callable[..., Daemon],
) -> None:
    """A request that kills its worker, batched with seven others: the batch is halved until it runs alone."""
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0}
    model = model_entry(ROWFAULTY, ROW_INPUTS, batching=batching, max_retries=1)
    daemon = start_daemon({"models": {"rows": model}}, env=ENV)
    daemon.wait_ready()
    burst = Burst(daemon)
    occupy_rows_worker(burst)
    for request_id in range(8):
        burst.send(request_id, "rows", {"x": _rows(SEGFAULT if request_id == 5 else float(request_id))})
    burst.collect(9, timeout_s=240)
    assert burst.code(5) == "WORKER_LOST"
    assert all(burst.code(i) == "result" and burst.result(i)[0, 0] == i + 1 for i in range(8) if i != 5)
    splits = [e for e in daemon.log_events() if e["event"] == "batch_split"]
    assert [e["size"] for e in splits] == [8, 4, 2], "halved until the poison ran alone"
    status = daemon.status()["models"]["rows"]
    assert status["health"] == "serving" and status["workers"][0]["state"] == "serving"
    burst.close()


def test_a_worker_killed_with_a_batch_in_flight_loses_and_duplicates_nothing(
    start_daemon: Callable[..., Daemon],
) -> None:
    """kill -9 of busy workers while batches run: every numbered request gets exactly one result."""
    batching = {"max_batch_size": 8, "max_queue_delay_us": 20_000}
    rows = model_entry(ROWFAULTY, ROW_INPUTS, batching=batching, workers=2)
    config = {"oversubscribe": True, "models": {"rows": rows}}
    daemon = start_daemon(config, env=ENV)
    daemon.wait_ready()
    stop = threading.Event()
    bursts: list[tuple[Burst, list[int]]] = []

    def client(index: int) -> None:
        burst = Burst(daemon)
        sent = [0]
        bursts.append((burst, sent))
        while not stop.is_set():
            for _ in range(4):  # four in flight per client: the broker has something to join
                burst.send(sent[0], "rows", {"x": np.array([[SLEEP, 0.05]], np.float32)})
                sent[0] += 1
            burst.collect(sent[0], timeout_s=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for _ in range(2):
        busy = wait_for(
            lambda: [w for w in daemon.status()["models"]["rows"]["workers"] if w["busy"] and w["state"] == "serving"],
            30,
            "a busy worker",
        )
        os.kill(busy[0]["pid"], signal.SIGKILL)
        wait_for(lambda pid=busy[0]["pid"]: pid not in [w["pid"] for w in daemon.status()["models"]["rows"]["workers"]]
                 and all(w["state"] == "serving" for w in daemon.status()["models"]["rows"]["workers"]),
                 60, "replacement serving")  # fmt: skip
    stop.set()
    for thread in threads:
        thread.join(120)
    for burst, sent in bursts:
        burst.collect(sent[0])
        assert sorted(burst.replies) == list(range(sent[0])), "a request got no reply"
        assert all(len(r) == 1 for r in burst.replies.values()), "a request got two replies"
        assert all(burst.code(i) == "result" for i in burst.replies)
        burst.close()
    assert any(int(size) > 1 for size in _batches(daemon, "rows")), "batches were formed"


def test_requests_whose_other_dims_differ_are_never_joined(start_daemon: Callable[..., Daemon]) -> None:
    """[1, 2] and [1, 3] inputs of one model go in separate batches, each answered with its own shape."""
    batching = {"max_batch_size": 4, "max_queue_delay_us": 0}
    daemon = start_daemon({"models": {"rows": model_entry(ROWFAULTY, ROW_INPUTS, batching=batching)}}, env=ENV)
    daemon.wait_ready()
    burst = Burst(daemon)
    occupy_rows_worker(burst)
    burst.send(0, "rows", {"x": np.zeros((1, 2), np.float32)})
    burst.send(1, "rows", {"x": np.zeros((1, 3), np.float32)})
    burst.send(2, "rows", {"x": np.zeros((2, 2), np.float32)})
    burst.collect(4)
    assert burst.result(0).shape == (1, 2) and burst.result(1).shape == (1, 3) and burst.result(2).shape == (2, 2)
    assert _batches(daemon, "rows") == {"3": 1, "1": 2}, "the two [*, 2] requests joined (3 rows), [1, 3] alone"
    burst.close()


def test_the_accuracy_gate_checks_the_batch_sizes_the_broker_will_form(start_daemon: Callable[..., Daemon]) -> None:
    """With batching up to 8 rows (preferring 4), a profile is checked batched at 4 and 8 before it serves."""
    batching = {"max_batch_size": 8, "preferred_batch_sizes": [4]}
    tiny = model_entry({"builtin": "tiny"}, TINY_INPUTS, batching=batching, profiles=["jit", "eager"])
    daemon = start_daemon({"models": {"tiny": tiny}})
    (worker,) = daemon.wait_ready()["models"]["tiny"]["workers"]
    assert worker["profile"] == "jit"
    checked = " ".join(worker["profile_build"])
    assert "batched at" in checked and "4" in checked.split("batched at")[1] and "8" in checked.split("batched at")[1]
