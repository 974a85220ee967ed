"""End to end through a real daemon: built-in and file models, errors, status and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.protocol.client import Client
from infervisor.worker.models import build_builtin
from tests.conftest import ENCODER_INPUTS, IMAGE_INPUTS, ROOT, TINY_INPUTS, Daemon, model_entry


class TwoHeads(torch.nn.Module):
    """A small CNN with two outputs, to check multi-output models and output naming."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.flatten(self.pool(self.conv(x)), 1)
        return self.head(features), features


def _reference(module: Any, *inputs: torch.Tensor) -> Any:
    torch.set_num_threads(1)
    with torch.inference_mode():
        return module(*inputs)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A TorchScript file and an ExportedProgram file made here, plus the modules they came from."""
    folder = tmp_path_factory.mktemp("models")
    torch.manual_seed(7)
    module = TwoHeads().eval()
    example = torch.randn(2, 3, 32, 32)
    scripted = torch.jit.trace(module, example)
    scripted.save(str(folder / "two_heads.pt"))
    exported = torch.export.export(module, (example,), dynamic_shapes={"x": {0: torch.export.Dim("batch", max=64)}})
    torch.export.save(exported, str(folder / "two_heads.pt2"))
    torch.save(module.state_dict(), folder / "two_heads_state.pt")
    return {"dir": folder}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Iterator[Daemon]:
    """One daemon serving every built-in plus a TorchScript and an ExportedProgram file."""
    small_image = [{"name": "x", "dtype": "float32", "shape": [None, 3, 32, 32]}]
    config = {
        "oversubscribe": True,
        "models": {
            "tiny": model_entry({"builtin": "tiny"}, TINY_INPUTS),
            "resnet18": model_entry({"builtin": "resnet18"}, IMAGE_INPUTS),
            "resnet50": model_entry({"builtin": "resnet50"}, IMAGE_INPUTS),
            "encoder": model_entry({"builtin": "encoder"}, ENCODER_INPUTS),
            "scripted": model_entry(
                {"torchscript": str(files["dir"] / "two_heads.pt")}, small_image, outputs=["logits", "features"]
            ),
            # Exported with Dim("batch", max=64): the config must bound the batch as the program does.
            "exported": model_entry(
                {"exported": str(files["dir"] / "two_heads.pt2")},
                [{"name": "x", "dtype": "float32", "shape": [[1, 64], 3, 32, 32]}],
            ),
        },
    }
    daemon = Daemon(tmp_path_factory.mktemp("zoo"), config)
    try:
        daemon.wait_ready(timeout=180)
        yield daemon
    finally:
        code = daemon.stop()
        assert code == 0, daemon.log_text()[-3000:]


@pytest.fixture
def client(zoo: Daemon) -> Iterator[Client]:
    """A client of the zoo daemon."""
    with zoo.client() as c:
        yield c


@pytest.mark.parametrize("name", ["tiny", "resnet18", "resnet50"])
def test_builtin_image_and_linear_models_match_in_process(client: Client, name: str) -> None:
    """Outputs through the daemon equal the same built-in run in this process."""
    shape = (2, 16) if name == "tiny" else (1, 3, 224, 224)
    key = "x" if name == "tiny" else "image"
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    out = client.infer(name, {key: x})
    expected = _reference(build_builtin(name), torch.from_numpy(x)).numpy()
    name_out = "y" if name == "tiny" else "logits"
    np.testing.assert_allclose(out[name_out], expected, rtol=1e-4, atol=1e-5)


def test_encoder_matches_in_process(client: Client) -> None:
    """The BERT-style encoder gives the in-process embedding for token ids and a padding mask."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 30522, size=(2, 128), dtype=np.int64)
    mask = np.ones((2, 128), dtype=np.int64)
    mask[1, 100:] = 0
    out = client.infer("encoder", {"input_ids": ids, "attention_mask": mask})
    expected = _reference(build_builtin("encoder"), torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert out["embedding"].shape == (2, 384)
    np.testing.assert_allclose(out["embedding"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["scripted", "exported"])
def test_file_models_match_in_process(client: Client, files: dict[str, Path], name: str) -> None:
    """TorchScript and ExportedProgram files made by the test serve the module's own outputs."""
    module = TwoHeads().eval()
    module.load_state_dict(torch.load(files["dir"] / "two_heads_state.pt"))
    x = np.random.default_rng(3).standard_normal((3, 3, 32, 32)).astype(np.float32)
    logits, features = _reference(module, torch.from_numpy(x))
    out = client.infer(name, {"x": x})
    names = ("logits", "features") if name == "scripted" else ("output", "output_1")
    np.testing.assert_allclose(out[names[0]], logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[names[1]], features.numpy(), rtol=1e-4, atol=1e-5)


class Widen(torch.nn.Module):
    """Each row of 16 floats repeated 512 times: 32 KiB out per row, for outputs longer than their input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 512)


def test_outputs_are_described_per_request_and_one_over_the_frame_limit_is_an_error(tmp_path: Path) -> None:
    """Output shapes follow each request's batch; an output over max_frame_bytes is INTERNAL, and serving goes on."""
    path = tmp_path / "widen.pt"  # beside the daemon's files (config.json, the runtime dir)
    torch.jit.script(Widen()).save(str(path))
    config = {
        "oversubscribe": True,
        "max_frame_bytes": 65536,
        "models": {"widen": model_entry({"torchscript": str(path)}, TINY_INPUTS, outputs=["wide"])},
    }
    daemon = Daemon(tmp_path, config)
    try:
        daemon.wait_ready(timeout=120)
        with daemon.client() as client:
            for batch in (1, 2, 1):  # 2 rows are 65536 bytes: at the limit, still served
                x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
                np.testing.assert_array_equal(client.infer("widen", {"x": x})["wide"], np.tile(x, (1, 512)))
            with pytest.raises(InferenceError) as caught:
                client.infer("widen", {"x": np.ones((3, 16), np.float32)}, timeout=10)
            assert caught.value.code == ErrorCode.INTERNAL
            assert caught.value.message == "output 'wide' is 98304 bytes, limit 65536"
            assert client.infer("widen", {"x": np.ones((2, 16), np.float32)})["wide"].shape == (2, 8192)
    finally:
        assert daemon.stop() == 0, daemon.log_text()[-3000:]


def _poisoned(shape: tuple[int, ...], bad: float) -> np.ndarray[Any, Any]:
    """Ones with one non-finite value at the very end, where a scan that stops early would miss it."""
    array = np.ones(shape, np.float32)
    array.reshape(-1)[-1] = bad
    return array


@pytest.mark.parametrize(
    ("model", "inputs", "code", "needle"),
    [
        ("tiny", {"x": np.zeros((1, 16), np.float64)}, ErrorCode.INVALID_INPUT, "float32[*,16]"),
        ("tiny", {"x": np.zeros((1, 17), np.float32)}, ErrorCode.INVALID_INPUT, "expected x float32[*,16]"),
        ("tiny", {"y": np.zeros((1, 16), np.float32)}, ErrorCode.INVALID_INPUT, "x float32[*,16]"),
        ("tiny", {"x": np.full((1, 16), np.nan, np.float32)}, ErrorCode.INVALID_INPUT, "NaN or Inf"),
        ("tiny", {"x": _poisoned((4096, 16), -np.inf)}, ErrorCode.INVALID_INPUT, "'x' contains NaN or Inf"),
        ("resnet18", {"image": _poisoned((1, 3, 224, 224), np.nan)}, ErrorCode.INVALID_INPUT, "'image' contains NaN"),
        ("nope", {"x": np.zeros((1, 16), np.float32)}, ErrorCode.UNKNOWN_MODEL, "serving"),
        ("encoder", {"input_ids": np.ones((1, 128), np.int64)}, ErrorCode.INVALID_INPUT, "attention_mask"),
    ],
)
def test_bad_requests_get_a_stable_code_and_say_what_was_expected(
    client: Client, model: str, inputs: dict[str, Any], code: ErrorCode, needle: str
) -> None:
    """Wrong dtype, shape, name, values or model are answered with a code and an explanation."""
    with pytest.raises(InferenceError) as caught:
        client.infer(model, inputs, timeout=10)
    assert caught.value.code == code
    assert needle in caught.value.message
    assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)


def test_a_worker_refuses_a_long_non_finite_frame_and_serves_on(zoo: Daemon, client: Client) -> None:
    """A 600 KB image with a NaN is answered INVALID_INPUT by the resnet18 worker it reached, which serves the next."""

    def answered() -> tuple[int, int]:
        model = zoo.status()["models"]["resnet18"]
        return sum(w["requests"] for w in model["workers"]), model["errors"].get("INVALID_INPUT", 0)

    served, refused = answered()
    with pytest.raises(InferenceError, match="'image' contains NaN or Inf") as caught:
        client.infer("resnet18", {"image": _poisoned((1, 3, 224, 224), np.nan)}, timeout=10)
    assert caught.value.code == ErrorCode.INVALID_INPUT
    assert answered() == (served + 1, refused + 1)  # a worker's answer, counted as the model's error
    image = np.ones((1, 3, 224, 224), np.float32)
    assert client.infer("resnet18", {"image": image}, timeout=10)["logits"].shape == (1, 1000)


def _raw_exchange(endpoint: str, frames: list[bytes]) -> dict[str, Any]:
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    try:
        socket.send_multipart(frames)
        assert socket.poll(10_000), "no reply to a malformed message"
        reply = socket.recv_multipart()
        assert reply[0] == b""
        header: dict[str, Any] = msgpack.unpackb(reply[1])
        return header
    finally:
        socket.close()


def _header(**overrides: Any) -> bytes:
    header = {
        "v": 1,
        "type": "infer",
        "id": 9,
        "model": "tiny",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 16]}],
    }
    header.update(overrides)
    return msgpack.packb({k: v for k, v in header.items() if v is not None})


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1garbage"], ErrorCode.BAD_REQUEST),
        ([b"", b"\xc1\xc1\xc1"], ErrorCode.BAD_REQUEST),
        ([b"", b"\x91" * 5000], ErrorCode.BAD_REQUEST),
        ([b"", _header(v=2), bytes(64)], ErrorCode.UNSUPPORTED_VERSION),
        ([b"", _header(), bytes(63)], ErrorCode.INVALID_INPUT),
        ([b"", _header(), bytes(64), bytes(64)], ErrorCode.BAD_REQUEST),
        (
            [b"", _header(inputs=[{"name": "x", "dtype": "object", "shape": [1, 16]}]), bytes(64)],
            ErrorCode.INVALID_INPUT,
        ),
        (
            [b"", _header(inputs=[{"name": "x", "dtype": "float32", "shape": [-1, 16]}]), bytes(64)],
            ErrorCode.INVALID_INPUT,
        ),
        ([b"", _header(id=[1, 2]), bytes(64)], ErrorCode.BAD_REQUEST),
        ([b"", msgpack.packb([1, 2, 3])], ErrorCode.BAD_REQUEST),
    ],
)
def test_garbage_frames_get_an_error_reply_and_serving_goes_on(
    zoo: Daemon, client: Client, frames: list[bytes], code: ErrorCode
) -> None:
    """Malformed envelopes, headers and frame lengths are answered, never crash the broker."""
    reply = _raw_exchange(zoo.endpoint, frames)
    assert reply["type"] == "error"
    assert reply["code"] == code.value, reply
    assert client.infer("tiny", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 16)


def test_reply_carries_request_id_and_stage_timings(zoo: Daemon) -> None:
    """A result echoes the client's id and reports queue/model/total time."""
    reply_id = b"req-\x00\x01"
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(zoo.endpoint)
    try:
        socket.send_multipart([b"", _header(id=reply_id), np.ones((1, 16), np.float32).tobytes()])
        assert socket.poll(10_000)
        frames = socket.recv_multipart()
    finally:
        socket.close()
    header = msgpack.unpackb(frames[1])
    assert header["type"] == "result" and header["id"] == reply_id
    assert header["outputs"] == [{"name": "y", "dtype": "float32", "shape": [1, 16]}]
    assert len(frames[2]) == 64
    assert {"queue_ms", "model_ms", "total_ms"} <= set(header["timing"])


def test_status_shows_every_worker_and_a_small_supervisor(zoo: Daemon) -> None:
    """status lists pid/state/cores/threads/rss/requests/p50/p99 per worker; the supervisor stays under 80 MB."""
    status = zoo.status()
    assert set(status["models"]) == {"tiny", "resnet18", "resnet50", "encoder", "scripted", "exported"}
    for model in status["models"].values():
        for worker in model["workers"]:
            assert worker["state"] == "serving"
            assert worker["pid"] and worker["rss"] and worker["cores"] and worker["threads"] >= 1
            assert {"requests", "p50_ms", "p99_ms"} <= set(worker)
    assert status["rss"] < 80 * 2**20


def test_supervisor_never_imports_torch_or_numpy(zoo: Daemon) -> None:
    """The daemon process maps neither torch nor numpy: only workers carry the model and look into tensors."""
    maps = Path(f"/proc/{zoo.process.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "_multiarray_umath" not in maps


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infervisor", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_status_and_infer_commands(zoo: Daemon, tmp_path: Path) -> None:
    """`infervisor status` and `infervisor infer` (random and .npy input) talk to the running daemon."""
    table = _cli("status", "--runtime-dir", str(zoo.runtime_dir))
    assert table.returncode == 0 and "model resnet50" in table.stdout and "serving" in table.stdout
    as_json = json.loads(_cli("status", "--runtime-dir", str(zoo.runtime_dir), "--json").stdout)
    assert as_json["models"]["tiny"]["workers"][0]["state"] == "serving"
    random = json.loads(
        _cli("infer", "--runtime-dir", str(zoo.runtime_dir), "--model", "resnet18", "--random", "--json").stdout
    )
    assert random["outputs"][0]["shape"] == [1, 1000] and random["latency_ms"] > 0
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    np.save(tmp_path / "x.npy", x)
    from_file = json.loads(
        _cli(
            "infer",
            "--runtime-dir",
            str(zoo.runtime_dir),
            "--model",
            "tiny",
            "--input",
            str(tmp_path / "x.npy"),
            "--json",
        ).stdout
    )
    assert from_file["outputs"][0]["shape"] == [2, 16]
    bad = _cli(
        "infer", "--runtime-dir", str(zoo.runtime_dir), "--model", "tiny", "--input", str(tmp_path / "missing.npy")
    )
    assert bad.returncode != 0
