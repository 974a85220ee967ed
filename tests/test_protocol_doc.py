"""docs/protocol.md held to the daemon: its examples and tables are read from the file and checked against the code
and against a real daemon serving the built-in `tiny`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.auth
import zmq.utils.z85

from infervisor.protocol.client import Client
from infervisor.protocol.client_messages import InferRequest, encode_infer
from infervisor.protocol.constants import TIMING_KEYS, ErrorCode
from infervisor.protocol.errors import InferenceError, ProtocolError
from infervisor.protocol.tensors import TensorDesc, TensorSpec
from infervisor.supervisor.workers.health import DaemonState, ModelHealth
from infervisor.supervisor.workers.slot import SlotState
from infervisor.worker.runner import EXACT_WIDENING, ModelRunner
from tests.conftest import ROOT, TINY_INPUTS, Daemon, free_loopback_port, model_entry
from tests.test_pool_states import Rig

DOC = (ROOT / "docs" / "protocol.md").read_text()

#: The shared daemon's frame limit: small, so that an input over it is cheap to make.
MAX_FRAME_BYTES = 2**20
#: One character over section 5's name limit.
LONG_OUTPUT = "o" * 129


def section(number: str) -> str:
    """The text of section `number` (e.g. "11") of docs/protocol.md, up to the next top-level section."""
    match = re.search(rf"^## {re.escape(number)}\. .*?(?=^## )", DOC, re.S | re.M)
    if match is None:
        raise AssertionError(f"docs/protocol.md has no section {number}")
    return match.group(0)


def code_block_after(text: str, marker: str) -> str:
    """The first fenced block after `marker` in `text`."""
    start = text.index(marker)
    match = re.search(r"```\n(.*?)```", text[start:], re.S)
    if match is None:
        raise AssertionError(f"no code block after {marker!r}")
    return match.group(1)


def table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header row starts with `header`, as lists of stripped cells."""
    lines = text[text.index(header) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def ticked(cell: str) -> list[str]:
    """The `code spans` of a table cell."""
    return re.findall(r"`([^`]+)`", cell)


def doc_keys(block: str) -> dict[tuple[str, ...], set[str]]:
    """The map keys of the status document's pseudo-JSON, by path (a list's maps are under the list's key)."""
    text = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
    tokens = re.findall(r'"[^"]*"|[A-Za-z_][\w|]*|\.\.\.|[{}\[\]:,]|\S', text)
    keys: dict[tuple[str, ...], set[str]] = {}
    # Open brackets: the bracket, its path, and the last key read in it.
    stack: list[list[Any]] = []
    previous = ""
    for token in tokens:
        if token in ("{", "["):
            path: tuple[str, ...] = ()
            if stack:
                _, parent, last_key = stack[-1]
                path = (*parent, last_key) if previous == ":" and last_key else parent
            stack.append([token, path, None])
        elif token in ("}", "]"):
            stack.pop()
        elif stack and stack[-1][0] == "{" and previous in ("{", ",") and re.fullmatch(r"[A-Za-z_][\w|]*", token):
            stack[-1][2] = token
            keys.setdefault(stack[-1][1], set()).update(token.split("|"))
        previous = token
    return keys


def exchange(endpoint: str, frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    """Send `frames` from a fresh DEALER; the reply's decoded header and its tensor frames."""
    socket: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send_multipart(frames)
        if not socket.poll(10_000):
            raise AssertionError("no reply within 10 s")
        reply = socket.recv_multipart()
    finally:
        socket.close()
    assert reply[0] == b"", "every reply starts with the empty delimiter"
    header: dict[str, Any] = msgpack.unpackb(reply[1])
    return header, reply[2:]


def worked_example() -> tuple[dict[str, Any], bytes, bytes, dict[str, Any], int]:
    """Section 11: the header as a map, frame 1's bytes, frame 2's bytes, the reply header and its frame length."""
    text = section("11")
    header = json.loads(code_block_after(text, "Header as a map"))
    frames = code_block_after(text, "Frames sent by a DEALER")
    declared = re.search(r"frame 1 \((\d+) bytes\):(.*?)frame 2", frames, re.S)
    assert declared is not None
    header_bytes = bytes.fromhex("".join(re.findall(r"\b[0-9a-f]{2}\b", declared.group(2))))
    assert len(header_bytes) == int(declared.group(1)), "frame 1's stated length is its hex's"
    tensor = re.search(r"frame 2 \((\d+) bytes\):\s+((?:[0-9a-f]{2} )+)\s*× (\d+)", frames)
    assert tensor is not None
    tensor_bytes = bytes.fromhex(tensor.group(2).replace(" ", "")) * int(tensor.group(3))
    assert len(tensor_bytes) == int(tensor.group(1)), "frame 2's stated length is its bytes'"
    reply = json.loads(code_block_after(text, "A successful reply is"))
    followed = re.search(r"followed by a (\d+)-byte frame", text)
    assert followed is not None
    return header, header_bytes, tensor_bytes, reply, int(followed.group(1))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon serving the built-in tiny as section 11 configures it, with a 1 MiB frame limit."""
    config = {
        "max_frame_bytes": MAX_FRAME_BYTES,
        "tcp_endpoint": f"tcp://127.0.0.1:{free_loopback_port()}",
        "models": {
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
            # An output name the wire refuses (section 5: 1..128 characters): the worker must not send it.
            "long": model_entry({"builtin": "tiny"}, TINY_INPUTS, outputs=[LONG_OUTPUT]),
        },
    }
    running = Daemon(tmp_path_factory.mktemp("protocol_doc"), config)
    try:
        running.wait_ready(timeout=120)
        yield running
    finally:
        running.stop()


def test_worked_example_bytes_are_the_header_the_doc_shows() -> None:
    """Section 11's hex decodes to its header map and is exactly what the protocol package encodes for it."""
    header, header_bytes, tensor_bytes, _, _ = worked_example()
    assert msgpack.unpackb(header_bytes) == header
    (x,) = header["inputs"]
    request = InferRequest(header["id"], header["model"], (TensorDesc(x["name"], x["dtype"], tuple(x["shape"])),), 5000)
    assert encode_infer(request) == header_bytes
    assert np.array_equal(np.frombuffer(tensor_bytes, "<f4"), np.ones(16, np.float32))


def test_worked_example_gets_the_documented_reply(daemon: Daemon) -> None:
    """The doc's request bytes, sent to a daemon serving builtin tiny, get the doc's reply header and frame length."""
    _, header_bytes, tensor_bytes, want, frame_length = worked_example()
    assert daemon.status()["models"]["tiny"]["inputs"][0]["shape"] == [None, 16], "configured as section 11 says"
    reply, frames = exchange(daemon.endpoint, [b"", header_bytes, tensor_bytes])
    assert {k: v for k, v in reply.items() if k != "timing"} == {k: v for k, v in want.items() if k != "timing"}
    assert list(reply["timing"]) == list(want["timing"]) == list(TIMING_KEYS)
    assert [len(f) for f in frames] == [frame_length]
    assert np.frombuffer(frames[0], "<f4").shape == (16,)


def test_timing_values_are_rounded_as_section_6_says(daemon: Daemon) -> None:
    """Every timing value of real replies, and of the doc's example, is a float rounded to 3 decimals."""
    assert "rounded to 3 decimals (`round(ms, 3)`" in section("6")
    _, _, _, example, _ = worked_example()
    with daemon.client() as client:
        timings = [client.infer_with_timing("tiny", {"x": np.ones((1, 16), np.float32)})[1] for _ in range(5)]
    for timing in [example["timing"], *timings]:
        assert set(timing) == set(TIMING_KEYS)
        for key, value in timing.items():
            assert isinstance(value, float) and round(value, 3) == value, (key, value)


def test_error_table_is_the_error_code_enum() -> None:
    """Section 8's table lists exactly the codes of protocol.constants.ErrorCode, in their order."""
    rows = table_rows(section("8"), "| Code |")
    assert [ticked(row[0])[0] for row in rows] == [code.value for code in ErrorCode]


def test_descriptor_check_order_examples(daemon: Daemon) -> None:
    """Each `inputs` example of section 5's check-order table gets the code the table gives it from a real daemon."""
    rows = table_rows(section("5"), "| `inputs` | Reply |")
    assert len(rows) >= 2
    for row in rows:
        inputs = json.loads(ticked(row[0])[0])
        header = {"v": 1, "type": "infer", "id": 11, "model": "tiny", "inputs": inputs}
        reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(header)])
        assert reply["type"] == "error" and reply["code"] == ticked(row[1])[0], (inputs, reply)
        assert reply["id"] == 11


def test_required_keys_missing_or_nil_get_the_documented_code(daemon: Daemon) -> None:
    """Each key section 4 marks required, dropped or sent as nil, gets the code of its row (id nil for `id`)."""
    rows = [row for row in table_rows(section("4"), "| Key | Required |") if row[0]]
    required = {ticked(row[0])[0]: ticked(row[4])[0] for row in rows if row[1] == "yes"}
    assert set(required) == {"v", "type", "id", "model", "inputs"}
    base, header_bytes, tensor_bytes, _, _ = worked_example()
    assert exchange(daemon.endpoint, [b"", header_bytes, tensor_bytes])[0]["type"] == "result"
    for key, code in required.items():
        for header in ({k: v for k, v in base.items() if k != key}, {**base, key: None}):
            reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(header), tensor_bytes])
            assert reply["type"] == "error" and reply["code"] == code, (key, header, reply)
            assert reply["id"] == (None if key == "id" else base["id"]), (key, reply)


def test_status_document_keys_match_a_real_status(daemon: Daemon) -> None:
    """The keys of section 9's status document are those of a real status: top level, sections, a model, a worker."""
    block = code_block_after(section("9"), "Status document")
    documented = doc_keys(block)
    status = daemon.status()
    model = status["models"]["tiny"]
    assert documented[()] == set(status)
    for part in ("cpu_latency", "config", "limits", "rollout", "endpoints", "thermal"):
        assert documented[(part,)] == set(status[part]), part
    assert documented[("models", "NAME")] == set(model)
    assert documented[("models", "NAME", "workers")] - {"role"} == set(model["workers"][0])
    assert status["limits"]["max_frame_bytes"] == MAX_FRAME_BYTES


def test_state_and_health_values_are_the_code_s(daemon: Daemon) -> None:
    """Section 9's state and health tables list exactly DaemonState and ModelHealth; a fully serving daemon is ready."""
    text = section("9")
    states = [ticked(row[0])[0] for row in table_rows(text, "| `state` | When |")]
    healths = [ticked(row[0])[0] for row in table_rows(text, "| `health` | When |")]
    assert set(states) == {s.value for s in DaemonState}
    assert set(healths) == {h.value for h in ModelHealth}
    block = code_block_after(text, "Status document")
    for key, values in (("state", states), ("health", healths)):
        listed = re.search(rf"\b{key}: (\S+)", block)
        assert listed is not None and set(re.findall(r'"(\w+)"', listed.group(1))) == set(values), key
    status = daemon.status()
    assert status["state"] == "ready" and status["models"]["tiny"]["health"] == "serving"


def test_client_refuses_an_input_over_a_known_frame_limit(daemon: Daemon) -> None:
    """A client told the daemon's max_frame_bytes raises INVALID_INPUT for a larger input without sending it."""
    limit = daemon.status()["limits"]["max_frame_bytes"]
    over = np.zeros((limit // 64 + 1, 16), np.float32)
    with Client(daemon.endpoint, max_frame_bytes=limit) as client:
        with pytest.raises(InferenceError) as caught:
            client.infer("tiny", {"x": over}, timeout=30)
        assert caught.value.code is ErrorCode.INVALID_INPUT
        assert f"over the daemon's max_frame_bytes of {limit}" in caught.value.message
        assert client.infer("tiny", {"x": np.ones((limit // 64, 16), np.float32)})["y"].shape == (limit // 64, 16)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="max_frame_bytes"):
            Client(daemon.endpoint, max_frame_bytes=bad)


class _Returns(torch.nn.Module):
    """A model returning its input converted to one dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 3).to(self.dtype)


def _runner(dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(_Returns(dtype), [TensorSpec("x", "float32", (1, 4))], ["y"])


def test_output_widening_table_is_the_runner_s() -> None:
    """Section 5's output dtype table names exactly the runner's exact widenings, and the runner keeps every value."""
    rows = table_rows(section("5"), "| torch output dtype | sent as | exact |")
    widened = {name: ticked(row[1])[0] for row in rows if row[2] == "yes" and ticked(row[1]) for name in ticked(row[0])}
    available = {name: target for name, target in widened.items() if hasattr(torch, name)}
    assert {getattr(torch, n): getattr(torch, t) for n, t in available.items()} == EXACT_WIDENING
    x = torch.tensor([[1.0, 2.0, 5.0, 40.0]])
    for source, target in EXACT_WIDENING.items():
        ((name, array),) = _runner(source).forward({"x": x})
        assert name == "y" and str(array.dtype) == str(target).removeprefix("torch.")
        assert np.array_equal(array, (x * 3).to(source).to(target).numpy())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint64], ids=str)
def test_output_the_wire_cannot_carry_is_refused_as_documented(dtype: torch.dtype) -> None:
    """An output of a dtype with no exact wire form is INTERNAL with section 5's message, not converted."""
    documented = " ".join(section("5").split())
    assert "A refused output makes the request fail with `INTERNAL`" in documented
    template = re.search(r"the message `(output 'NAME' has dtype DTYPE, [^`]+)`", documented)
    assert template is not None
    head, tail = template.group(1).replace("NAME", "y").replace("DTYPE", str(dtype).removeprefix("torch.")).split("...")
    with pytest.raises(ProtocolError) as caught:
        _runner(dtype).forward({"x": torch.ones(1, 4)})
    assert caught.value.code is ErrorCode.INTERNAL
    assert caught.value.message.startswith(head) and caught.value.message.endswith(tail), caught.value.message


def _tiny_header(**changes: Any) -> dict[str, Any]:
    header = {
        "v": 1,
        "type": "infer",
        "id": 21,
        "model": "tiny",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 16]}],
    }
    return {**header, **changes}


def test_output_descriptors_are_checked_by_the_worker_before_it_replies(daemon: Daemon) -> None:
    """Sections 5 and 6 agree: a 129-character output name is the worker's INTERNAL; the broker forwards unread."""
    assert "The worker checks its own output descriptors before it replies" in section("5")
    assert "the broker forwards it without decoding or re-encoding it" in section("6")
    x = np.ones((1, 16), np.float32)
    pids = {w["pid"] for w in daemon.status()["models"]["long"]["workers"]}
    with Client(daemon.endpoint) as client:
        for _ in range(2):
            with pytest.raises(InferenceError, match="outputs fail the descriptor checks: outputs.0..name") as caught:
                client.infer("long", {"x": x}, timeout=10)
            assert caught.value.code == ErrorCode.INTERNAL
        assert client.infer("tiny", {"x": x}, timeout=10)["y"].shape == (1, 16)
    assert {w["pid"] for w in daemon.status()["models"]["long"]["workers"]} == pids, "the worker serves on"


def test_every_control_command_the_daemon_knows_is_in_section_9(daemon: Daemon) -> None:
    """The unknown-command answer's list is the spec's, and each command on it has its row in section 9."""
    answer = daemon.control({"cmd": "no-such-command"})
    known = answer["error"].rsplit("known: ", 1)[1]
    assert f"known: {known}" in section("9")
    for name in known.split(", "):
        assert f'`{{"cmd": "{name}"' in section("9"), name


def test_shared_memory_on_tcp_is_a_descriptor_check_before_the_model_lookup(daemon: Daemon) -> None:
    """Over tcp, an shm input is BAD_REQUEST even for an unknown model or a wrong dtype; no model counts it."""
    assert "an input in shared memory (5.1) sent to the tcp endpoint → `BAD_REQUEST`" in section("7")
    endpoint = json.loads(daemon.config_path.read_text())["tcp_endpoint"]
    shm = {"name": "infervisor-nothing", "offset": 0}
    before = daemon.status()["models"]["tiny"]["errors"]
    for header in (
        _tiny_header(model="no-such-model", inputs=[{"name": "x", "dtype": "float32", "shape": [1, 16], "shm": shm}]),
        _tiny_header(inputs=[{"name": "x", "dtype": "float64", "shape": [1, 16], "shm": shm}]),
    ):
        reply, _ = exchange(endpoint, [b"", msgpack.packb(header)])
        assert reply["code"] == "BAD_REQUEST" and "ipc endpoint only" in reply["message"], reply
    assert daemon.status()["models"]["tiny"]["errors"] == before


def test_frame_checks_run_in_the_three_passes_section_5_gives(daemon: Daemon) -> None:
    """A later tensor over the size limit is reported before an earlier frame of the wrong length."""
    assert "So a later tensor over the size limit is reported before an earlier frame of the wrong length" in DOC
    big = MAX_FRAME_BYTES // 4 + 1
    inputs = [{"name": "a", "dtype": "float32", "shape": [1, 16]}, {"name": "b", "dtype": "float32", "shape": [big]}]
    reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(_tiny_header(inputs=inputs)), b"short", b"tiny"])
    assert reply["code"] == "INVALID_INPUT" and "'b'" in reply["message"] and "limit" in reply["message"], reply


def test_the_shm_keys_section_5_1_marks_required_are_required(daemon: Daemon) -> None:
    """Each shm key whose Required cell says yes, missing or nil, gets its row's code (offset has no default)."""
    rows = table_rows(section("5"), "| Key | Required | Type | Constraint | Error if violated or missing |")
    required = {ticked(row[0])[0]: ticked(row[4])[0] for row in rows if row[1].startswith("yes")}
    assert set(required) == {"shm.name", "shm.offset"}
    for key, code in required.items():
        field = key.split(".", 1)[1]
        full = {"name": "infervisor-nothing", "offset": 0}
        for shm in ({k: v for k, v in full.items() if k != field}, {**full, field: None}):
            inputs = [{"name": "x", "dtype": "float32", "shape": [1, 16], "shm": shm}]
            reply, _ = exchange(daemon.endpoint, [b"", msgpack.packb(_tiny_header(inputs=inputs))])
            assert reply["code"] == code and "shm" in reply["message"], (shm, reply)


def test_the_curve_certificate_of_section_1_1_is_what_the_daemon_reads(tmp_path: Path) -> None:
    """The certificate file the spec shows is the layout pyzmq writes, and the daemon's loader admits its key."""
    shown = code_block_after(section("1"), "This is the file `zmq.auth.create_certificates` writes")
    (tmp_path / "client.key").write_text(shown)
    (key,) = zmq.auth.load_certificates(str(tmp_path))
    assert len(zmq.utils.z85.decode(key)) == 32
    (tmp_path / "made").mkdir()
    public, _ = zmq.auth.create_certificates(str(tmp_path / "made"), "made")
    written = [line for line in Path(public).read_text().splitlines() if line and not line.startswith("#")]
    documented = [line for line in shown.splitlines() if line and not line.startswith("#")]
    assert [line.split("=")[0] for line in written] == [line.split("=")[0] for line in documented]


def test_rollout_last_error_says_the_old_worker_is_failed_when_it_is(tmp_path: Path) -> None:
    """Restarting a failed slot whose replacement fails too does not claim the old worker keeps serving."""
    rig = Rig(tmp_path)
    try:
        rig.pool.start()
        (slot,) = rig.slots()
        while slot.state is not SlotState.FAILED:
            rig.exit(slot, 4)
            rig.tick()
            if slot.state is SlotState.BACKOFF:
                rig.tick(slot.respawn_at - rig.now + 0.01)
        rig.pool.restart("tiny", "test")
        rig.tick()
        successor = rig.pool.rollout.successor
        assert successor is not None
        rig.exit(successor, 4)
        rig.tick()
        rig.tick()
        error = rig.pool.rollout.last_error or ""
        assert "keeps serving" not in error and error.endswith("the old worker is failed: this slot serves nothing")
        assert "the old worker is failed: this slot serves nothing" in section("9")
    finally:
        rig.close()
