"""The Open Inference Protocol gateway: Triton's own clients (HTTP and gRPC, unchanged) against a real daemon."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import InferenceError
from tests.conftest import TINY_INPUTS, Daemon, free_loopback_port, model_entry, wait_for
from tests.stream_models import FEATURES, STATE_ROWS, reference

LEAKY = {"python": "tests.stream_models:leaky"}

#: The daemon's frame limit: the HTTP body cap follows it (3 bytes a byte for JSON, and 1 MiB for the header).
_MAX_FRAME_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon serving `tiny` with the OIP gateway on two free loopback ports, up and ready."""
    folder = tmp_path_factory.mktemp("oip")
    http_at, grpc_at = f"127.0.0.1:{free_loopback_port()}", f"127.0.0.1:{free_loopback_port()}"
    leaky_inputs = [
        {"name": "x", "dtype": "float32", "shape": [None, FEATURES]},
        {"name": "h", "dtype": "float32", "shape": [None, STATE_ROWS, FEATURES]},
    ]
    leaky = model_entry(LEAKY, leaky_inputs, state=[{"input": "h", "output": "h_next"}])
    config = {
        "oversubscribe": True,
        "max_frame_bytes": _MAX_FRAME_BYTES,
        "oip": {"http": http_at, "grpc": grpc_at},
        "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS), "leaky": leaky},
    }
    started = Daemon(folder, config)
    try:
        started.wait_ready(timeout=120)
        client = httpclient.InferenceServerClient(http_at)

        def model_ready() -> bool:
            try:
                return bool(client.is_model_ready("tiny"))
            except Exception:  # noqa: BLE001 - not listening yet
                return False

        wait_for(model_ready, 60, "the gateway to call tiny ready")
        yield started
    finally:
        code = started.stop()
        assert code == 0, started.log_text()[-3000:]


def _oip(daemon: Daemon) -> dict[str, Any]:
    oip: dict[str, Any] = daemon.status()["endpoints"]["oip"]
    return oip


@pytest.fixture
def http(daemon: Daemon) -> httpclient.InferenceServerClient:
    """Triton's HTTP client on the gateway."""
    return httpclient.InferenceServerClient(_oip(daemon)["http"], network_timeout=30.0)


@pytest.fixture
def grpc(daemon: Daemon) -> grpcclient.InferenceServerClient:
    """Triton's gRPC client on the gateway."""
    return grpcclient.InferenceServerClient(_oip(daemon)["grpc"])


def _http_infer(client: httpclient.InferenceServerClient, x: np.ndarray[Any, Any], binary: bool) -> Any:
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return client.infer("tiny", [tensor], outputs=[httpclient.InferRequestedOutput("y", binary_data=binary)])


def _grpc_infer(client: grpcclient.InferenceServerClient, x: np.ndarray[Any, Any], model: str = "tiny") -> Any:
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor])


def test_http_and_grpc_answer_bit_for_bit_as_the_zeromq_client(daemon: Daemon, http: Any, grpc: Any) -> None:
    """JSON, binary and gRPC answers equal the ZeroMQ client's, bit for bit, for several batch sizes."""
    rng = np.random.default_rng(57)
    with daemon.client() as zmq_client:
        for rows in (1, 3, 8):
            x = rng.standard_normal((rows, 16), dtype=np.float32)
            expected = zmq_client.infer("tiny", {"x": x})
            (name,) = expected
            for answer in (_http_infer(http, x, True), _http_infer(http, x, False), _grpc_infer(grpc, x)):
                got = answer.as_numpy(name)
                assert got.dtype == expected[name].dtype and got.shape == expected[name].shape
                assert got.tobytes() == expected[name].tobytes()


def test_health_and_metadata_describe_the_configured_model(daemon: Daemon, http: Any, grpc: Any) -> None:
    """Live, ready, model ready and metadata: inputs as configured, outputs as answered."""
    _grpc_infer(grpc, np.zeros((1, 16), np.float32))
    assert http.is_server_live() and http.is_server_ready() and http.is_model_ready("tiny")
    assert grpc.is_server_live() and grpc.is_server_ready() and grpc.is_model_ready("tiny")
    assert not grpc.is_model_ready("nope")
    meta = http.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 16]}]
    output = daemon.client().infer("tiny", {"x": np.zeros((1, 16), np.float32)})
    (name,) = output
    assert meta["outputs"] == [{"name": name, "datatype": "FP32", "shape": [-1, *output[name].shape[1:]]}]
    grpc_meta = grpc.get_model_metadata("tiny", as_json=True)
    assert [(i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in grpc_meta["inputs"]] == [
        ("x", "FP32", [-1, 16])
    ]


def _zmq_error(daemon: Daemon, model: str, x: np.ndarray[Any, Any]) -> InferenceError:
    with daemon.client() as client, pytest.raises(InferenceError) as caught:
        client.infer(model, {"x": x})
    return caught.value


@pytest.mark.parametrize(
    ("model", "x", "code", "http_status", "grpc_status"),
    [
        ("nope", np.zeros((1, 16), np.float32), ErrorCode.UNKNOWN_MODEL, "404", "StatusCode.NOT_FOUND"),
        ("tiny", np.zeros((1, 15), np.float32), ErrorCode.INVALID_INPUT, "400", "StatusCode.INVALID_ARGUMENT"),
        ("tiny", np.full((1, 16), np.nan, np.float32), ErrorCode.INVALID_INPUT, "400", "StatusCode.INVALID_ARGUMENT"),
    ],
)
def test_errors_carry_the_zeromq_code_and_message_under_the_protocol_status(
    daemon: Daemon,
    http: Any,
    grpc: Any,
    model: str,
    x: np.ndarray[Any, Any],
    code: ErrorCode,
    http_status: str,
    grpc_status: str,
) -> None:
    """An unknown model, a wrong shape, a NaN: ZeroMQ's `CODE: message` under 404/400, NOT_FOUND/INVALID_ARGUMENT."""
    zmq_error = _zmq_error(daemon, model, x)
    assert zmq_error.code is code
    want = f"{code}: {zmq_error.message}"
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as over_http:
        http.infer(model, [tensor])
    assert (over_http.value.status(), over_http.value.message()) == (http_status, want)
    with pytest.raises(InferenceServerException) as over_grpc:
        _grpc_infer(grpc, x, model)
    assert (over_grpc.value.status(), over_grpc.value.message()) == (grpc_status, want)


def _post(daemon: Daemon, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    host, port = _oip(daemon)["http"].rsplit(":", 1)
    connection = HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v2/models/tiny/infer", body, headers or {})
        response = connection.getresponse()
        text = response.read()
        return response.status, json.loads(text) if response.getheader("Content-Type", "").startswith(
            "application/json"
        ) else {"error": text.decode(errors="replace")}
    finally:
        connection.close()


#: A binary-extension header announcing 64 bytes for x: the tests send 60, then 68.
_SHORT_BINARY = json.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}]}
).encode()
_BINARY_AT = {"Inference-Header-Content-Length": str(len(_SHORT_BINARY))}


def _json_input(datatype: str, shape: list[int], data: list[Any]) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}).encode()


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", None, 400, "BAD_REQUEST"),
        (b"[" * 100_000, None, 400, "BAD_REQUEST"),
        (_json_input("FP32", [1, 16], ["a"] * 16), None, 400, "INVALID_INPUT"),
        (_json_input("INT8", [1, 1], [300]), None, 400, "INVALID_INPUT"),
        (_json_input("BOOL", [1, 1], [1]), None, 400, "INVALID_INPUT"),
        (_json_input("FP32", [1, 16], [1.0]), None, 400, "INVALID_INPUT"),
        (_json_input("FP64", [1, 16], [1.0] * 16), None, 400, "INVALID_INPUT"),
        (_json_input("FP32", [4_000_000_000, 16], []), None, 400, "INVALID_INPUT"),
        (_SHORT_BINARY + b"\0" * 60, _BINARY_AT, 400, "INVALID_INPUT"),
        (_SHORT_BINARY + b"\0" * 68, _BINARY_AT, 400, "INVALID_INPUT"),
        (b"{}", {"Inference-Header-Content-Length": "99"}, 400, "BAD_REQUEST"),
    ],
)
def test_bad_input_is_answered_with_the_protocol_error(
    daemon: Daemon, body: bytes, headers: dict[str, str] | None, status: int, code: str
) -> None:
    """Malformed JSON, nesting bombs, lying datatypes and shapes, binary size mismatches: 400 with the daemon's code."""
    got_status, answer = _post(daemon, body, headers)
    assert got_status == status and answer["error"].startswith(f"{code}: "), answer


def test_huge_headers_and_bodies_are_refused_and_the_gateway_serves_on(daemon: Daemon, http: Any) -> None:
    """A 64 KiB header field, an HTTP body and a gRPC message over the cap are refused; the next request is served."""
    host, port = _oip(daemon)["http"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n")
        assert raw.recv(64).split(b" ")[1] == b"400"
    status, answer = _post(daemon, b"{" + b" " * (_MAX_FRAME_BYTES * 3 + 2**20) + b"}")
    assert status == 413
    grpc_client = grpcclient.InferenceServerClient(_oip(daemon)["grpc"])
    with pytest.raises(InferenceServerException) as too_big:
        _grpc_infer(grpc_client, np.zeros(((_MAX_FRAME_BYTES * 3 + 2**20) // 64 + 1, 16), np.float32))
    assert too_big.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert _http_infer(http, np.ones((2, 16), np.float32), True).as_numpy("y") is not None


def test_a_client_that_vanishes_mid_request_loses_nothing(daemon: Daemon, http: Any) -> None:
    """HTTP and gRPC clients that send an infer and hang up at once: every request the gateway sent is answered
    (none fails, no worker is lost), and the next client is served."""
    tiny = daemon.status()["models"]["tiny"]
    before, errors_before = tiny["completed"], tiny["errors"]
    pids_before = [w["pid"] for w in tiny["workers"]]
    host, port = _oip(daemon)["http"].rsplit(":", 1)
    x = np.ones((2, 16), np.float32)
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 16], "parameters": {"binary_data_size": x.nbytes}}]}
    ).encode()
    request = (
        f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(header) + x.nbytes}\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\n\r\n"
    ).encode()
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            raw.sendall(request + header + x.tobytes())
    for _ in range(3):  # gRPC callers that close their channel with the call in flight
        vanishing = grpcclient.InferenceServerClient(_oip(daemon)["grpc"])
        tensor = grpcclient.InferInput("x", [2, 16], "FP32")
        tensor.set_data_from_numpy(x)
        vanishing.async_infer("tiny", [tensor], callback=lambda result, error: None)
        vanishing.close()
    wait_for(lambda: daemon.status()["models"]["tiny"]["completed"] >= before + 5, 30, "the vanished clients' answers")
    tiny = daemon.status()["models"]["tiny"]
    assert tiny["errors"] == errors_before and [w["pid"] for w in tiny["workers"]] == pids_before
    assert _http_infer(http, x, True).as_numpy("y").shape[0] == 2


def test_a_large_tensor_travels_both_ways(daemon: Daemon, http: Any, grpc: Any) -> None:
    """A 2 MiB input over HTTP binary and gRPC answers as ZeroMQ does."""
    x = np.random.default_rng(1).standard_normal((32768, 16), dtype=np.float32)
    expected = daemon.client().infer("tiny", {"x": x})["y"]
    assert _http_infer(http, x, True).as_numpy("y").tobytes() == expected.tobytes()
    assert _grpc_infer(grpc, x).as_numpy("y").tobytes() == expected.tobytes()


def test_a_killed_gateway_is_reaped_and_started_again(daemon: Daemon, http: Any) -> None:
    """kill -9 of the gateway: status counts a restart and a new gateway serves."""
    old_pid = _oip(daemon)["pid"]
    os.kill(old_pid, signal.SIGKILL)
    oip = wait_for(
        lambda: (o := _oip(daemon))["restarts"] >= 1 and o["pid"] not in (None, old_pid) and o,
        30,
        "a new gateway",
    )
    assert oip["last_exit"] is not None and oip["state"] == "running"
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == "zombie"
    wait_for(lambda: _ready(http), 30, "the new gateway to answer")
    assert _http_infer(http, np.ones((1, 16), np.float32), True).as_numpy("y").shape[0] == 1


def _ready(client: httpclient.InferenceServerClient) -> bool:
    try:
        return bool(client.is_model_ready("tiny"))
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def test_triton_sequences_are_streams_of_the_stateful_model(daemon: Daemon, grpc: Any, http: Any) -> None:
    """sequence_id/start/end over gRPC and HTTP step a stream: each answer is the step-by-step reference's."""
    rng = np.random.default_rng(5)
    steps = [rng.standard_normal((1, FEATURES)).astype(np.float32) for _ in range(4)]
    expected, _ = reference(steps)
    for module, client, sequence_id in ((grpcclient, grpc, 5701), (httpclient, http, "oip-5702")):
        for index, step in enumerate(steps):
            tensor = module.InferInput("x", [1, FEATURES], "FP32")
            tensor.set_data_from_numpy(step)
            answer = client.infer(
                "leaky",
                [tensor],
                outputs=[module.InferRequestedOutput("y")],
                sequence_id=sequence_id,
                sequence_start=index == 0,
                sequence_end=index == len(steps) - 1,
            )
            assert answer.as_numpy("y").tobytes() == expected[index].tobytes(), (module.__name__, index)
    tensor = grpcclient.InferInput("x", [1, FEATURES], "FP32")
    tensor.set_data_from_numpy(steps[0])
    with pytest.raises(InferenceServerException) as ended:
        grpc.infer("leaky", [tensor], sequence_id=5701)
    assert ended.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert ended.value.message().startswith("UNKNOWN_STREAM: ")


def test_no_gateway_outlives_a_daemon_killed_with_sigkill(start_daemon: Any) -> None:
    """kill -9 of the daemon: the kernel kills its gateway (parent-death signal), no orphan keeps the ports."""
    http_at = f"127.0.0.1:{free_loopback_port()}"
    config = {"oip": {"http": http_at, "grpc": None}, "models": {"tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS)}}
    killed: Daemon = start_daemon(config)
    gateway_pid = wait_for(
        lambda: (s := killed.try_status()) and (s["endpoints"]["oip"] or {}).get("pid"), 120, "the gateway"
    )
    killed.process.kill()
    killed.process.wait(30)
    wait_for(
        lambda: not psutil.pid_exists(gateway_pid) or psutil.Process(gateway_pid).status() == "zombie",
        30,
        "the gateway to die with the daemon",
    )
