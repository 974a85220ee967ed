"""docs/protocol.md and the daemon agree where a second client found them apart (issue 42): each point is provoked
with raw ZeroMQ frames, as a client written from the text alone would send them, and checked against the text."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from infervisor.protocol.constants import CONTROL_SOCKET_NAME
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry, wait_for
from tests.fault_models import FAULT_INPUTS, ROW_INPUTS, SEGFAULT, SLEEP
from tests.protocol_models import FLAGS_ENV
from tests.test_protocol_doc import section, table_rows, ticked

#: The shared daemon's frame limit: small, so that frames around it are cheap to make.
MAX_FRAME_BYTES = 2**20
#: The requests a profile under batched load is asked to cover.
PROFILED = 6


def control_raw(daemon: Daemon, command: dict[str, Any]) -> dict[str, Any]:
    """One control command as section 9 frames it, `["", msgpack map]`, from a fresh DEALER; the decoded answer."""
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"ipc://{daemon.runtime_dir / CONTROL_SOCKET_NAME}")
    try:
        socket.send_multipart([b"", msgpack.packb(command)])
        if not socket.poll(10_000):
            raise AssertionError(f"no answer to {command} within 10 s")
        frames = socket.recv_multipart()
    finally:
        socket.close()
    assert len(frames) == 2 and frames[0] == b"", frames
    answer: dict[str, Any] = msgpack.unpackb(frames[1])
    return answer


def exchange(endpoint: str, frames: list[bytes], timeout_s: float = 60.0) -> tuple[dict[str, Any], list[bytes]]:
    """Send `frames` from a fresh DEALER; the reply's decoded header and its tensor frames."""
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send_multipart(frames)
        if not socket.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply within {timeout_s:.0f} s")
        reply = socket.recv_multipart()
    finally:
        socket.close()
    assert reply[0] == b"", "every reply starts with the empty delimiter"
    header: dict[str, Any] = msgpack.unpackb(reply[1])
    return header, reply[2:]


def infer_frames(model: str, request_id: int, array: np.ndarray, name: str = "x") -> list[bytes]:
    """A DEALER's infer request (section 2): delimiter, header, one tensor frame."""
    inputs = [{"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}]
    header = {"v": 1, "type": "infer", "id": request_id, "model": model, "inputs": inputs}
    return [b"", msgpack.packb(header), np.ascontiguousarray(array).tobytes()]


def model_status(daemon: Daemon, model: str) -> dict[str, Any]:
    status: dict[str, Any] = control_raw(daemon, {"cmd": "status"})["models"][model]
    return status


@pytest.fixture(scope="module")
def flags(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the flag files that decide the next start of `drain` and `surge` (tests/protocol_models.py)."""
    return tmp_path_factory.mktemp("flags")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, flags: Path) -> Iterator[Daemon]:
    """One daemon with a model per point: each test provokes its own and leaves the others be."""
    linear = [{"name": "x", "dtype": "float32", "shape": [None, 16]}]
    config = {
        "max_frame_bytes": MAX_FRAME_BYTES,
        "oversubscribe": True,
        "max_restarts": 2,
        "models": {
            "blank": model_entry({"python": "tests.protocol_models:blank_key"}, TINY_INPUTS),
            "chain": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["jit", "eager"]),
            "faulty": model_entry({"python": "tests.fault_models:faulty"}, FAULT_INPUTS),
            "drain": model_entry({"python": "tests.protocol_models:drain_model"}, linear, rollout="drain_first"),
            "surge": model_entry({"python": "tests.protocol_models:surge_model"}, linear),
            "rows": model_entry(
                {"python": "tests.fault_models:rowfaulty"},
                ROW_INPUTS,
                batching={"max_batch_size": 8, "max_queue_delay_us": 0},
            ),
        },
    }
    running = Daemon(tmp_path_factory.mktemp("protocol_agree"), config, env={FLAGS_ENV: str(flags)})
    try:
        running.wait_ready(timeout=240)
        yield running
    finally:
        running.stop()


def test_item1_an_output_named_empty_is_internal_not_renamed(daemon: Daemon) -> None:
    """A model whose output key is "" answers INTERNAL from the descriptor checks; it is not served as "output"."""
    assert "A model's own output names (a returned dict's keys) are used as they are" in section("5")
    for request_id in (1, 2):
        reply, frames = exchange(daemon.endpoint, infer_frames("blank", request_id, np.ones((1, 16), np.float32)))
        assert reply["type"] == "error" and reply["code"] == "INTERNAL", reply
        assert "outputs[0].name must be a string of 1..128 characters" in reply["message"], reply
        assert reply["id"] == request_id and frames == []
    assert model_status(daemon, "blank")["workers"][0]["state"] == "serving", "the worker serves on"


def test_item2_fallback_reset_answers_the_profile_it_leaves(daemon: Daemon) -> None:
    """`fallback` answers `from` the profile it left (jit); its reset answers the one the reset leaves (eager)."""
    assert "`from` the profile the command leaves" in section("9")
    down = control_raw(daemon, {"cmd": "fallback", "model": "chain", "reason": "issue 42"})
    assert down["ok"] and down["from"] == "jit" and down["profiles"] == ["eager"], down
    wait_for(lambda: (model_status(daemon, "chain")["fallback"] or {}).get("state") == "in force", 120, "eager")
    back = control_raw(daemon, {"cmd": "fallback", "model": "chain", "reset": True})
    assert back["ok"] and back["from"] == "eager" and back["profiles"] == ["jit", "eager"], back
    wait_for(lambda: model_status(daemon, "chain")["fallback"] is None, 120, "the reset to end")


def test_item3_a_failed_replacement_is_the_model_s_error_until_one_succeeds(daemon: Daemon, flags: Path) -> None:
    """A `restart` whose replacement cannot load leaves `models[NAME].error` = that `rollout.last_error` and the
    model `degraded` (its worker cannot be replaced) while the old worker serves; the next that serves clears both."""
    assert "the error of its last failed replacement" in section("9")
    pid = model_status(daemon, "surge")["workers"][0]["pid"]
    (flags / "surge.fail").touch()
    try:
        assert control_raw(daemon, {"cmd": "restart", "model": "surge"}) == {"ok": True, "queued": 1}
        error = wait_for(lambda: model_status(daemon, "surge")["error"], 120, "the failed replacement's error")
    finally:
        (flags / "surge.fail").unlink()
    status = control_raw(daemon, {"cmd": "status"})
    assert error == status["rollout"]["last_error"] and error.startswith("surge/0: replacement failed"), error
    assert error.endswith("the old worker keeps serving"), error
    model = status["models"]["surge"]
    assert model["health"] == "degraded" and model["workers"][0]["pid"] == pid
    assert model["workers"][0]["state"] == "serving", model
    assert control_raw(daemon, {"cmd": "restart", "model": "surge"})["ok"]
    wait_for(lambda: model_status(daemon, "surge")["workers"][0]["pid"] != pid, 120, "a replacement serving")
    cleared = wait_for(lambda: (m := model_status(daemon, "surge"))["error"] is None and m, 30, "the error cleared")
    assert cleared["health"] == "serving", cleared


def test_item4_a_crash_loop_is_the_model_s_error(daemon: Daemon) -> None:
    """A model whose slot failed by repeated crashes has `error` saying so (killed by SIGSEGV), not null."""
    assert "a crash loop's reason" in section("9")
    reply, _ = exchange(daemon.endpoint, infer_frames("faulty", 40, np.array([[SEGFAULT, 0.0]], np.float32)))
    assert reply["type"] == "error" and reply["code"] in ("UNAVAILABLE", "WORKER_LOST"), reply
    model = wait_for(lambda: (m := model_status(daemon, "faulty"))["health"] == "failed" and m, 60, "failed")
    assert model["error"] == f"faulty/0 failed: {model['workers'][0]['reason']}", model
    assert "2 failures within 60 s; last: killed by SIGSEGV" in model["error"], model["error"]


def test_item5_only_frames_over_the_limit_plus_64_kib_drop_the_connection(daemon: Daemon) -> None:
    """A frame over max_frame_bytes is INVALID_INPUT on a working connection; only one over max_frame_bytes + 65536
    (ZMQ_MAXMSGSIZE) is dropped by ZeroMQ without a reply, as sections 1, 5 and 10 all say (issue 54: section 5
    said 2 x max_frame_bytes + 65536)."""
    text = " ".join(section("5").split())
    assert "only a frame longer than `max_frame_bytes` + 65536 (`ZMQ_MAXMSGSIZE`) makes ZeroMQ drop" in text
    assert "`ZMQ_MAXMSGSIZE=max_frame_bytes + 65536`" in section("1")
    drop_at = MAX_FRAME_BYTES + 65536
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(daemon.endpoint)
    try:
        oversize = np.zeros((drop_at // 64, 16), np.float32)  # over the limit, at the drop threshold
        assert MAX_FRAME_BYTES < len(oversize.tobytes()) <= drop_at
        socket.send_multipart(infer_frames("blank", 51, oversize))
        assert socket.poll(10_000), "an oversize frame under the drop threshold is answered"
        reply = msgpack.unpackb(socket.recv_multipart()[1])
        assert reply["code"] == "INVALID_INPUT" and reply["id"] == 51, reply
        dropped = np.zeros((drop_at // 64 + 1, 16), np.float32)  # one row over the drop threshold
        socket.send_multipart(infer_frames("blank", 52, dropped))
        assert not socket.poll(3_000), "a frame over the drop threshold gets no reply"
        socket.send_multipart(infer_frames("chain", 53, np.ones((1, 16), np.float32)))
        assert socket.poll(30_000), "the DEALER reconnects and is answered again"
        reply = msgpack.unpackb(socket.recv_multipart()[1])
        assert reply["id"] == 53 and reply["type"] == "result", reply
    finally:
        socket.close()


def test_item6_a_reload_waits_while_a_drain_first_replacement_starts(daemon: Daemon, flags: Path) -> None:
    """While a drain-first step's replacement is still starting, `reload` answers `queued` and runs after the step."""
    assert "until its replacement serves or has failed" in section("9")
    (flags / "drain.slow").touch()
    try:
        assert control_raw(daemon, {"cmd": "restart", "model": "drain"})["ok"]

        def replacement_starting() -> bool:
            status = control_raw(daemon, {"cmd": "status"})
            workers = status["models"]["drain"]["workers"]
            pool = [w["state"] for w in workers if not w.get("role")]
            return status["rollout"]["current"] == "drain/0" and pool == ["starting"]

        wait_for(replacement_starting, 60, "the drain-first replacement starting in the pool")
        answer = control_raw(daemon, {"cmd": "reload"})
        assert answer["ok"] and answer.get("queued") is True, answer
    finally:
        (flags / "drain.slow").unlink()
    wait_for(lambda: model_status(daemon, "drain")["health"] == "serving", 120, "the replacement serving")
    wait_for(
        lambda: any(e["event"] in ("config_unchanged", "config_applied") for e in daemon.log_events()),
        30,
        "the queued reload run once the step ended",
    )


@pytest.mark.parametrize("reason", [5, 1.5, True, ["why"], {"a": 1}], ids=repr)
def test_item7_a_fallback_reason_that_is_not_a_string_is_refused(daemon: Daemon, reason: Any) -> None:
    """`reason` must be a string: anything else is refused and nothing moves (it was shown as `"5"`)."""
    assert "`reason` not a string" in section("9")
    answer = control_raw(daemon, {"cmd": "fallback", "model": "chain", "reason": reason})
    assert answer == {"ok": False, "error": "fallback's reason must be a string"}, answer
    assert model_status(daemon, "chain")["fallback"] is None


def test_item8_the_descriptor_table_s_required_keys_are_required(daemon: Daemon) -> None:
    """Section 5's descriptor table has a Required column; each required key missing or nil gets its row's code,
    and the optional `shm` absent or nil is a frame."""
    text = section("5")
    rows = table_rows(text, "| Key | Required | Type | Constraint | Error if violated, missing or nil |")
    keys = {ticked(row[0])[0]: row for row in rows if row[0]}
    assert {k for k, row in keys.items() if row[1] == "yes"} == {"name", "dtype", "shape"}
    assert keys["shm"][1].startswith("no")
    full = {"name": "x", "dtype": "float32", "shape": [1, 16]}
    one = np.ones((1, 16), np.float32).tobytes()
    for key in ("name", "dtype", "shape"):
        code = ticked(keys[key][4])[0]
        for desc in ({k: v for k, v in full.items() if k != key}, {**full, key: None}):
            header = {"v": 1, "type": "infer", "id": 81, "model": "chain", "inputs": [desc]}
            reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(header), one])
            assert reply["type"] == "error" and reply["code"] == code and reply["id"] == 81, (desc, reply)
    for shm in ({}, {"shm": None}):
        header = {"v": 1, "type": "infer", "id": 82, "model": "chain", "inputs": [{**full, **shm}]}
        assert exchange(daemon.endpoint, [b"", msgpack.packb(header), one])[0]["type"] == "result"


def test_item10_a_profile_under_batched_load_reports_once_its_requests_are_served(daemon: Daemon) -> None:
    """A profile of N requests, served as one lone request then a batch, reports once those N are answered."""
    answer = control_raw(daemon, {"cmd": "profile", "model": "rows", "requests": PROFILED})
    assert answer["ok"], answer
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(daemon.endpoint)
    try:
        # A 4-wide request that sleeps keeps the worker busy: the 2-wide ones behind it leave as one batch.
        socket.send_multipart(infer_frames("rows", 100, np.array([[SLEEP, 1.0, 0.0, 0.0]], np.float32)))
        for request_id in range(101, 100 + PROFILED):
            socket.send_multipart(infer_frames("rows", request_id, np.array([[0.0, float(request_id)]], np.float32)))
        for _ in range(PROFILED):
            assert socket.poll(60_000), "every request is answered"
            assert msgpack.unpackb(socket.recv_multipart()[1])["type"] == "result"
    finally:
        socket.close()
    sizes = model_status(daemon, "rows")["batching"]["batch_sizes"]
    assert any(int(size) > 1 for size in sizes), sizes

    def report() -> dict[str, Any] | None:
        worker = model_status(daemon, "rows")["workers"][0]
        profile = worker["last_profile"]
        return profile if profile and profile["seq"] == answer["seq"] else None

    profile = wait_for(report, 30, "the profile's report once its requests were served")
    assert profile["requests"] == PROFILED and profile["ended"] is None and profile["operators"], profile


def test_item9_shutdown_with_a_profile_unfinished_ends_it_and_the_worker_exits_0(
    start_daemon: Callable[..., Daemon],
) -> None:
    """SIGTERM while a profile waits for requests: the worker exits 0 (it died of SIGSEGV) and the report comes
    with `ended` saying the shutdown ended it."""
    assert "ended by shutdown after K of N requests" in section("9")
    daemon = start_daemon({"models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}})
    daemon.wait_ready()
    answer = control_raw(daemon, {"cmd": "profile", "model": "tiny", "requests": 1000})
    assert answer["ok"], answer
    for request_id in (1, 2):
        reply, _ = exchange(daemon.endpoint, infer_frames("tiny", request_id, np.ones((1, 16), np.float32)))
        assert reply["type"] == "result", reply
    assert daemon.stop() == 0
    events = daemon.log_events()
    stopped = [e for e in events if e["event"] == "worker_state" and e.get("new") == "stopped" and "pid" in e]
    assert [e["reason"] for e in stopped if e["pid"] == answer["pid"]] == ["exit 0 (OK)"], stopped
    (received,) = [e for e in events if e["event"] == "profile_received" and e["seq"] == answer["seq"]]
    assert received["requests"] == 2 and received["ended"] == "ended by shutdown after 2 of 1000 requests", received


def test_every_error_field_is_documented_once_with_when_it_is_set_and_cleared() -> None:
    """Section 9's Error fields table has one row per error field a client reads, each saying set and cleared."""
    rows = table_rows(section("9"), "| Field | Set | Cleared |")
    fields = [ticked(row[0])[0] for row in rows]
    assert fields == ["models[NAME].error", "workers[].load_error", "workers[].last_exit", "rollout.last_error"]
    assert all(row[1] and row[2] for row in rows)
    assert ROOT.joinpath("docs", "protocol.md").read_text().count("| Field | Set | Cleared |") == 1


def test_issue54_fields_are_checked_in_the_order_of_section_4_s_table(daemon: Daemon) -> None:
    """A bad dtype in `inputs` and a bad `stream` in one header: INVALID_INPUT, the `inputs` row coming first in
    section 4's table (the stream field's BAD_REQUEST came first)."""
    rows = [ticked(row[0])[0] for row in table_rows(section("4"), "| Key | Required | Type |") if row[0]]
    assert rows.index("inputs") < rows.index("stream") < rows.index("start")
    bad = {"v": 1, "type": "infer", "id": 91, "model": "chain", "stream": 7}
    header = {**bad, "inputs": [{"name": "x", "dtype": "float128", "shape": [1, 16]}]}
    reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(header), np.ones((1, 16), np.float32).tobytes()])
    assert reply["code"] == "INVALID_INPUT" and reply["id"] == 91, reply
    header = {**bad, "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 16]}]}
    reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(header), np.ones((1, 16), np.float32).tobytes()])
    assert reply["code"] == "BAD_REQUEST" and "stream must be a string" in reply["message"], reply


def test_issue54_stream_flags_false_without_a_stream_are_accepted(daemon: Daemon) -> None:
    """`start`, `end`, `return_state` false without `stream` ask for nothing: a result; true is BAD_REQUEST."""
    assert "set to `false` without `stream` it asks for nothing and is accepted" in " ".join(section("4").split())
    one = np.ones((1, 16), np.float32).tobytes()
    inputs = [{"name": "x", "dtype": "float32", "shape": [1, 16]}]
    for flag in ("start", "end", "return_state"):
        header = {"v": 1, "type": "infer", "id": 92, "model": "chain", "inputs": inputs}
        reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb({**header, flag: False}), one])
        assert reply["type"] == "result", (flag, reply)
        reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb({**header, flag: True}), one])
        assert reply["code"] == "BAD_REQUEST" and f"{flag} needs a stream" in reply["message"], (flag, reply)


def test_issue54_clients_budget_is_one_rule_in_both_documents() -> None:
    """configuration.md's `clients_budget_mb` row says what section 7.4 says: any connection, a fresh one too."""
    doc = " ".join(section("7").split())
    assert "a request that would take the total past it is refused `OVERLOADED`, whichever connection sends it" in doc
    lines = (ROOT / "docs" / "configuration.md").read_text().splitlines()
    (row,) = [line for line in lines if line.startswith("| `clients_budget_mb` |")]
    assert "a request that would take the total past this is answered `OVERLOADED`, whichever connection" in row
    assert "that already holds something" not in row
