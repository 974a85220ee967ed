"""Streams of a stateful model with real workers: the daemon keeps each stream's state, in order, across worker loss."""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from infervisor.protocol.client import Client
from infervisor.protocol.constants import MAX_STREAM_BACKLOG, TIMING_KEYS, ErrorCode
from infervisor.protocol.errors import InferenceError
from tests.conftest import ROOT, Daemon, model_entry, wait_for
from tests.stream_models import FEATURES, SLEEP, STATE_ROWS, Leaky, reference

ENV = {"PYTHONPATH": str(ROOT)}
LEAKY = {"python": "tests.stream_models:leaky"}


def leaky_entry(state_rows: int = STATE_ROWS, initial: str | None = None, **extra: Any) -> dict[str, Any]:
    """A model entry of the leaky stateful model: state `h` in, `h_next` out (from zeros, or an `initial` file)."""
    inputs = [
        {"name": "x", "dtype": "float32", "shape": [None, FEATURES]},
        {"name": "h", "dtype": "float32", "shape": [None, state_rows, FEATURES]},
    ]
    pair = {"input": "h", "output": "h_next", **({"initial": initial} if initial else {})}
    return model_entry(LEAKY, inputs, state=[pair], **extra)


def chunks(seed: int, steps: int) -> list[np.ndarray]:
    """A stream's inputs: one row per step."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, FEATURES)).astype(np.float32) for _ in range(steps)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon: `leaky` (max_streams 4, all of them one peer's), `brief` (streams expire after 0.5 s idle), the
    stateless `tiny`."""
    config = {
        "oversubscribe": True,
        "models": {
            "leaky": leaky_entry(max_streams=4, max_streams_per_peer=4),
            "brief": leaky_entry(stream_idle_s=0.5),
            "tiny": model_entry({"builtin": "tiny"}, [{"name": "x", "dtype": "float32", "shape": [None, 16]}]),
        },
    }
    running = Daemon(tmp_path_factory.mktemp("streams"), config, env=ENV)
    try:
        running.wait_ready(timeout=180)
        yield running
    finally:
        running.stop()


def test_a_stream_answers_what_the_model_run_step_by_step_answers(daemon: Daemon) -> None:
    """Twenty steps of one stream equal, bit for bit, the model run step by step in this process; the state too."""
    inputs = chunks(1, 20)
    expected, final = reference(inputs)
    with daemon.client() as client, client.stream("leaky", return_state=True) as stream:
        for chunk, want in zip(inputs, expected, strict=True):
            out = stream.infer({"x": chunk})
            assert list(out) == ["y"], "the state is not among the outputs"
            np.testing.assert_array_equal(out["y"], want)
        np.testing.assert_array_equal(stream.state["h_next"], final)
    assert daemon.status()["models"]["leaky"]["streams"]["open"] == 0, "leaving the block ended the stream"


def test_two_interleaved_streams_keep_their_own_state(daemon: Daemon) -> None:
    """Two streams on one connection, stepped in turn, each answer their own reference: no state crosses."""
    a, b = chunks(2, 10), chunks(3, 10)
    (want_a, _), (want_b, _) = reference(a), reference(b)
    with daemon.client() as client, client.stream("leaky") as first, client.stream("leaky") as second:
        for step in range(10):
            np.testing.assert_array_equal(first.infer({"x": a[step]})["y"], want_a[step])
            np.testing.assert_array_equal(second.infer({"x": b[step]})["y"], want_b[step])


def test_a_stateful_model_called_without_a_stream_is_a_stateless_call(daemon: Daemon) -> None:
    """Without `stream`, the client carries the state itself and gets the next state back as an output."""
    (chunk,) = chunks(4, 1)
    (want,), final = reference([chunk])
    with daemon.client() as client:
        out = client.infer("leaky", {"x": chunk, "h": np.zeros((1, STATE_ROWS, FEATURES), np.float32)})
    np.testing.assert_array_equal(out["y"], want)
    np.testing.assert_array_equal(out["h_next"], final)


class Wire:
    """A raw DEALER speaking the protocol with msgpack, without the Client class."""

    def __init__(self, daemon: Daemon) -> None:
        self.socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(daemon.endpoint)
        self.next_id = 1

    def send(self, inputs: dict[str, np.ndarray], model: str = "leaky", **fields: Any) -> int:
        """Send one request (header fields beside the usual ones), without waiting; returns its id."""
        request_id = self.next_id
        self.next_id += 1
        header = {
            "v": 1,
            "type": "infer",
            "id": request_id,
            "model": model,
            "inputs": [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape)} for n, a in inputs.items()],
            **fields,
        }
        tensors = [np.ascontiguousarray(a).tobytes() for a in inputs.values()]
        self.socket.send_multipart([b"", msgpack.packb(header), *tensors])
        return request_id

    def reply(self) -> tuple[dict[str, Any], list[bytes]]:
        """The next reply's header and frames."""
        if not self.socket.poll(30_000):
            raise AssertionError("no reply within 30 s")
        frames = self.socket.recv_multipart()
        return msgpack.unpackb(frames[1]), frames[2:]

    def close(self) -> None:
        """Close the socket."""
        self.socket.close()


def test_a_stream_from_the_raw_wire(daemon: Daemon) -> None:
    """A stream driven with msgpack headers: steps pipelined at once are answered in order, then a bare end."""
    inputs = chunks(5, 6)
    expected, final = reference(inputs)
    wire = Wire(daemon)
    try:
        ids = [wire.send({"x": inputs[0]}, stream="raw-1", start=True)]
        ids += [wire.send({"x": chunk}, stream="raw-1", return_state=(i == 4)) for i, chunk in enumerate(inputs[1:])]
        end = wire.send({}, stream="raw-1", end=True)
        for step, request_id in enumerate(ids):
            header, frames = wire.reply()
            assert header["type"] == "result" and header["id"] == request_id, header
            y = np.frombuffer(frames[0], np.float32).reshape(header["outputs"][0]["shape"])
            np.testing.assert_array_equal(y, expected[step])
            if step == 5:
                assert header["state"] == ["h_next"] and [o["name"] for o in header["outputs"]] == ["y", "h_next"]
                np.testing.assert_array_equal(np.frombuffer(frames[1], np.float32).reshape(final.shape), final)
        header, frames = wire.reply()
        assert header["type"] == "result" and header["id"] == end and header["outputs"] == [] and frames == []
        # A bare end ran nothing, yet its timing has every key of section 6 (it was {}).
        assert list(header["timing"]) == list(TIMING_KEYS), header["timing"]
        assert header["timing"]["model_ms"] == 0.0 and header["timing"]["total_ms"] == header["timing"]["queue_ms"]
        wire.send({"x": inputs[0]}, stream="raw-1")
        header, _ = wire.reply()
        assert header["code"] == "UNKNOWN_STREAM" and "the client ended it" in header["message"], header
    finally:
        wire.close()


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"stream": 7, "start": True}, "BAD_REQUEST", "stream must be a string"),
        ({"stream": "s" * 129, "start": True}, "BAD_REQUEST", "1..128 bytes"),
        ({"stream": "ok", "start": 1}, "BAD_REQUEST", "start must be true or false"),
        ({"start": True}, "BAD_REQUEST", "start needs a stream"),
        ({"stream": "never-started"}, "UNKNOWN_STREAM", "never started"),
    ],
)
def test_a_bad_stream_field_is_a_clear_error(daemon: Daemon, fields: dict[str, Any], code: str, words: str) -> None:
    """A wrong-typed or too-long stream id, a non-boolean flag, a flag alone, an unknown stream: each its code."""
    wire = Wire(daemon)
    try:
        wire.send({"x": chunks(6, 1)[0]}, **fields)
        header, _ = wire.reply()
        assert header["type"] == "error" and header["code"] == code and words in header["message"], header
    finally:
        wire.close()


def test_misuses_of_a_stream_are_refused_and_other_streams_go_on(daemon: Daemon) -> None:
    """A second start, a stream on a stateless model, state sent by the client, too many streams: each refused
    with its code, while a stream stepped between them keeps answering its reference."""
    inputs = chunks(7, 8)
    expected, _ = reference(inputs)
    step = iter(zip(inputs, expected, strict=True))
    with daemon.client() as client, client.stream("leaky", stream_id="steady") as steady:

        def step_steady() -> None:
            chunk, want = next(step)
            np.testing.assert_array_equal(steady.infer({"x": chunk})["y"], want)

        step_steady()
        with pytest.raises(InferenceError) as caught:
            client.stream("leaky", stream_id="steady").infer({"x": inputs[0]})
        assert caught.value.code is ErrorCode.STREAM_EXISTS
        step_steady()
        with pytest.raises(InferenceError) as caught:
            client.stream("tiny").infer({"x": np.zeros((1, 16), np.float32)})
        assert caught.value.code is ErrorCode.INVALID_INPUT and "declares no state" in caught.value.message
        with pytest.raises(InferenceError) as caught:
            client.stream("leaky").infer({"x": inputs[0], "h": np.zeros((1, STATE_ROWS, FEATURES), np.float32)})
        assert caught.value.code is ErrorCode.INVALID_INPUT and "the daemon feeds them" in caught.value.message
        step_steady()
        others = [client.stream("leaky") for _ in range(3)]  # with "steady": max_streams (4) open
        for other in others:
            other.infer({"x": inputs[0]})
        with pytest.raises(InferenceError) as caught:
            client.stream("leaky").infer({"x": inputs[0]})
        assert caught.value.code is ErrorCode.TOO_MANY_STREAMS and "max_streams" in caught.value.message
        step_steady()
        others[0].end()
        client.stream("leaky").end(inputs={"x": inputs[0]})  # room again: a one-step stream
        step_steady()
        for other in others[1:]:
            other.end()
    streams = daemon.status()["models"]["leaky"]["streams"]
    assert streams["open"] == 0 and streams["max_streams"] == 4


def test_an_idle_stream_expires_and_says_so(daemon: Daemon) -> None:
    """A stream idle past stream_idle_s is dropped: its next step is UNKNOWN_STREAM (expired), counted in status."""
    with daemon.client() as client:
        stream = client.stream("brief")
        stream.infer({"x": chunks(8, 1)[0]})
        wait_for(lambda: daemon.status()["models"]["brief"]["streams"]["expired"] == 1, 10, "the stream expired")
        with pytest.raises(InferenceError) as caught:
            stream.infer({"x": chunks(8, 1)[0]})
        assert caught.value.code is ErrorCode.UNKNOWN_STREAM and "expired" in caught.value.message
        assert daemon.status()["models"]["brief"]["streams"]["open"] == 0
        stream.end()  # the client's side of it: nothing to send any more


def test_steps_past_the_backlog_are_refused_in_order(daemon: Daemon) -> None:
    """Steps sent at once queue behind the one in flight up to the backlog bound; past it, OVERLOADED."""
    wire = Wire(daemon)
    inputs = chunks(9, 1) * (MAX_STREAM_BACKLOG + 4)
    held = np.array([[SLEEP, 0.5, *[0.0] * (FEATURES - 2)]], np.float32)  # the first step stays in flight
    try:
        ids = [wire.send({"x": held}, stream="flood", start=True)]
        ids += [wire.send({"x": chunk}, stream="flood") for chunk in inputs[1:]]
        ids.append(wire.send({}, stream="flood", end=True))
        replies = [wire.reply()[0] for _ in ids]  # refusals come at once, results in their turn
        codes = {r["id"]: r["type"] if r["type"] == "result" else r["code"] for r in replies}
        assert set(codes.values()) == {"result", "OVERLOADED"} and len(codes) == len(ids), codes
        assert codes[ids[0]] == "result" and codes[ids[-1]] == "result", "the start and the end were taken"
        answered = [r["id"] for r in replies if r["type"] == "result"]
        assert answered == sorted(answered), "the steps the daemon took were answered in order"
    finally:
        wire.close()


def stream_loop(
    client: Client, inputs: list[np.ndarray], results: list[Any], stop_after: threading.Event | None = None
) -> None:
    """Step one stream through `inputs`, keeping each answer or the error it got."""
    try:
        with client.stream("leaky") as stream:
            for chunk in inputs:
                results.append(stream.infer({"x": chunk}, timeout=120)["y"])
    except InferenceError as exc:
        results.append(exc)


def run_streams(daemon: Daemon, count: int, steps: int, during: Callable[[list[list[Any]]], None]) -> None:
    """`count` streams of `steps` steps on their own clients while `during` acts; every answer is checked."""
    inputs = [chunks(100 + i, steps) for i in range(count)]
    results: list[list[Any]] = [[] for _ in range(count)]
    clients = [daemon.client() for _ in range(count)]
    threads = [
        threading.Thread(target=stream_loop, args=(clients[i], inputs[i], results[i]), daemon=True)
        for i in range(count)
    ]
    try:
        for thread in threads:
            thread.start()
        during(results)
        for thread in threads:
            thread.join(300)
        stuck = [i for i, thread in enumerate(threads) if thread.is_alive()]
        # A socket closed under a thread still reading it aborts this process (libzmq's assertion): a stuck stream
        # fails the test here, with what the daemon says, and its client is left to the daemon's stop.
        assert not stuck, (stuck, [len(r) for r in results], daemon.status()["counters"])
    finally:
        for thread, client in zip(threads, clients, strict=True):
            if not thread.is_alive():
                client.close()
    for i in range(count):
        errors = [r for r in results[i] if isinstance(r, Exception)]
        assert not errors, errors
        expected, _ = reference(inputs[i])
        assert len(results[i]) == steps
        for got, want in zip(results[i], expected, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_worker_killed_mid_stream_costs_no_step_and_changes_no_answer(start_daemon: Callable[..., Daemon]) -> None:
    """Eight streams of 150 steps, batched, while the worker is recycled after 250 replies and then killed -9 twice:
    every answer is the reference's, none fails, the steps re-run are counted as resumed, and steps of several
    streams were joined."""
    batching = {"max_batch_size": 8, "max_queue_delay_us": 2000}
    entry = leaky_entry(batching=batching, max_requests=250, recycle_jitter=0.0)
    # Checked every 0.1 s, the first worker is recycled within a few steps of its 250th, with 900 of 1200 to go.
    daemon = start_daemon({"monitor_interval_s": 0.1, "models": {"leaky": entry}}, env=ENV)
    daemon.wait_ready(180)

    def recycle_then_kill_twice(results: list[list[Any]]) -> None:
        wait_for(functools.partial(_recycled, daemon), 120, "the first worker recycled at its request limit")
        assert _answered(results) < 600, "the recycle came with most steps still to go"
        for answers in (600, 900):
            wait_for(lambda n=answers: _answered(results) > n, 120, "streams under way")
            pid = wait_for(functools.partial(_serving_pid, daemon), 120, "a serving worker")
            os.kill(pid, signal.SIGKILL)
            wait_for(functools.partial(_replaced, daemon, pid), 120, "a new worker serving")

    run_streams(daemon, 8, 150, recycle_then_kill_twice)
    model = daemon.status()["models"]["leaky"]
    assert model["streams"]["open"] == 0 and model["streams"]["opened"] == 8
    assert model["streams"]["resumed"] >= 1, "the steps in flight at the kills were re-run"
    assert any(int(size) > 1 for size in model["batching"]["batch_sizes"]), model["batching"]


def _answered(results: list[list[Any]]) -> int:
    return sum(len(r) for r in results)


def _recycled(daemon: Daemon) -> bool:
    return any(e["event"] == "rollout_step_started" for e in daemon.log_events())


def _replaced(daemon: Daemon, pid: int) -> bool:
    return _serving_pid(daemon) not in (None, pid)


def _serving_pid(daemon: Daemon) -> int | None:
    """The pid of a serving worker of `leaky`: a recycle may have put a successor beside a draining one."""
    workers = daemon.status()["models"]["leaky"]["workers"]
    return next((int(w["pid"]) for w in workers if w["state"] == "serving" and w["pid"]), None)


def test_a_rolling_restart_mid_stream_keeps_streams_and_a_state_change_ends_them(
    start_daemon: Callable[..., Daemon],
) -> None:
    """A restart with the same state pairs: the streams go on, every answer the reference's. A config that changes
    the state pairs: open streams end with STREAM_ENDED naming the change as the reload is applied (no step answered
    from the old pairs after it), and new ones start on the new state. A config without the model: its stream's
    later steps are STREAM_ENDED too, saying it was removed, and a stream it never had is UNKNOWN_MODEL."""
    tiny = model_entry({"builtin": "tiny"}, [{"name": "x", "dtype": "float32", "shape": [None, 16]}])
    config = {"oversubscribe": True, "models": {"leaky": leaky_entry(), "tiny": tiny}}
    daemon = start_daemon(config, env=ENV)
    daemon.wait_ready(180)

    def restart(results: list[list[Any]]) -> None:
        wait_for(lambda: sum(len(r) for r in results) > 100, 120, "streams under way")
        assert daemon.control({"cmd": "restart", "model": "leaky"})["queued"] == 1
        wait_for(lambda: daemon.status()["rollout"]["completed"] == 1, 120, "the restart done")

    run_streams(daemon, 4, 120, restart)

    with daemon.client() as client:
        old = client.stream("leaky")
        old.infer({"x": chunks(10, 1)[0]})
        config["models"]["leaky"] = leaky_entry(state_rows=3)
        daemon.write_config(config)
        assert daemon.control({"cmd": "reload"})["ok"]  # applied by now (by this command or the file watcher)
        with pytest.raises(InferenceError) as caught:
            old.infer({"x": chunks(10, 1)[0]})
        assert caught.value.code is ErrorCode.STREAM_ENDED and "state pairs changed" in caught.value.message
        assert daemon.status()["models"]["leaky"]["streams"]["ended_by_config"] == 1
        assert "[2, 8]" in caught.value.message and "[3, 8]" in caught.value.message
        wait_for(lambda: daemon.status()["rollout"]["completed"] == 2, 180, "the new state's workers serving")
        inputs = chunks(11, 5)
        expected, _ = reference(inputs, state_rows=3)
        with client.stream("leaky") as new:
            for chunk, want in zip(inputs, expected, strict=True):
                np.testing.assert_array_equal(new.infer({"x": chunk})["y"], want)
    _initial_alone_applies_at_once(daemon, config)
    wire = Wire(daemon)
    try:
        wire.send({"x": chunks(12, 1)[0]}, stream="last", start=True)
        assert wire.reply()[0]["type"] == "result"
        daemon.write_config({"oversubscribe": True, "models": {"tiny": tiny}})
        assert daemon.control({"cmd": "reload"})["ok"]
        for fields in ({"x": chunks(12, 1)[0]}, {}):
            wire.send(fields, stream="last", end=not fields)
            header, _ = wire.reply()
            assert header["code"] == "STREAM_ENDED", header
            assert "model 'leaky' was removed from the config" in header["message"], header
        wire.send({"x": chunks(12, 1)[0]}, stream="never")
        assert wire.reply()[0]["code"] == "UNKNOWN_MODEL"
    finally:
        wire.close()


def _initial_alone_applies_at_once(daemon: Daemon, config: dict[str, Any]) -> None:
    """A change of `initial` alone: the open stream ends (STREAM_ENDED), and a start sent as the reload is applied,
    with the rollout under way, is served from the new initial value at once (section 4.1), not UNAVAILABLE."""
    ones = daemon.tmp / "ones.npy"
    np.save(ones, np.ones((3, FEATURES), np.float32))
    (x,) = chunks(15, 1)
    with torch.no_grad():
        want = Leaky()(torch.from_numpy(x), torch.ones((1, 3, FEATURES)))["y"].numpy()
    wire = Wire(daemon)
    try:
        wire.send({"x": x}, stream="kept", start=True)
        assert wire.reply()[0]["type"] == "result"
        config["models"]["leaky"] = leaky_entry(state_rows=3, initial=str(ones))
        daemon.write_config(config)
        assert daemon.control({"cmd": "reload"})["ok"]
        wire.send({"x": x}, stream="fresh", start=True, end=True)
        header, frames = wire.reply()
        assert header["type"] == "result", header
        np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32).reshape(want.shape), want)
        wire.send({"x": x}, stream="kept")
        assert wire.reply()[0]["code"] == "STREAM_ENDED"
    finally:
        wire.close()


def test_a_failed_step_commits_nothing(daemon: Daemon) -> None:
    """A step the worker refuses (NaN input) changes no state: the next steps answer as if it was never sent."""
    inputs = chunks(12, 4)
    expected, _ = reference(inputs)
    bad = np.full((1, FEATURES), np.nan, np.float32)
    with daemon.client() as client, client.stream("leaky") as stream:
        np.testing.assert_array_equal(stream.infer({"x": inputs[0]})["y"], expected[0])
        with pytest.raises(InferenceError) as caught:
            stream.infer({"x": bad})
        assert caught.value.code is ErrorCode.INVALID_INPUT
        for chunk, want in zip(inputs[1:], expected[1:], strict=True):
            np.testing.assert_array_equal(stream.infer({"x": chunk})["y"], want)


def test_a_start_whose_step_fails_leaves_the_stream_open_at_its_initial_state(daemon: Daemon) -> None:
    """A start whose step the worker refuses (NaN) opens the stream all the same: a second start is STREAM_EXISTS,
    and the next step answers the reference's first step, from the initial state (section 4.1)."""
    inputs = chunks(14, 2)
    expected, _ = reference(inputs)
    wire = Wire(daemon)
    try:
        wire.send({"x": np.full((1, FEATURES), np.nan, np.float32)}, stream="bad-start", start=True)
        header, _ = wire.reply()
        assert header["type"] == "error" and header["code"] == "INVALID_INPUT", header
        wire.send({"x": inputs[0]}, stream="bad-start", start=True)
        assert wire.reply()[0]["code"] == "STREAM_EXISTS"
        for chunk, want in zip(inputs, expected, strict=True):
            wire.send({"x": chunk}, stream="bad-start")
            header, frames = wire.reply()
            assert header["type"] == "result", header
            np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32).reshape(want.shape), want)
        wire.send({}, stream="bad-start", end=True)
        assert wire.reply()[0]["type"] == "result"
    finally:
        wire.close()


def test_a_waiting_step_past_its_deadline_is_answered_before_the_step_ahead_of_it(daemon: Daemon) -> None:
    """A step queued behind a slow one, with a short deadline, gets DEADLINE_EXCEEDED while the slow one still runs."""
    wire = Wire(daemon)
    held = np.array([[SLEEP, 1.5, *[0.0] * (FEATURES - 2)]], np.float32)
    try:
        slow = wire.send({"x": held}, stream="late", start=True)
        late = wire.send({"x": chunks(13, 1)[0]}, stream="late", deadline_ms=100)
        first, _ = wire.reply()
        assert first["id"] == late and first["code"] == "DEADLINE_EXCEEDED", first
        second, _ = wire.reply()
        assert second["id"] == slow and second["type"] == "result", second
        wire.send({}, stream="late", end=True)
        assert wire.reply()[0]["type"] == "result"
    finally:
        wire.close()
