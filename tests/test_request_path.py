"""The worker's request path up to the model, with a real model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infervisor.protocol.client_messages import InferRequest, encode_infer
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import TensorDesc, TensorSpec
from infervisor.worker.models import build_builtin
from infervisor.worker.request_path import prepare
from infervisor.worker.runner import ModelRunner
from infervisor.worker.shared_inputs import SharedInputs

# Frames are read-only buffers, as the link delivers them; worker.runner silences this in a worker.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def _launch(model: str, specs: tuple[TensorSpec, ...]) -> LaunchSpec:
    return LaunchSpec("w0", model, -1, ModelSource("builtin", name=model), specs, None, (0,), 1)


def _runner(model: str, specs: tuple[TensorSpec, ...]) -> ModelRunner:
    return ModelRunner(build_builtin(model).eval(), specs, None)


def test_prepare_views_the_frames_and_keeps_the_clients_header() -> None:
    """The inputs are the frames' tensors; the id and model the result header echoes are the client's."""
    specs = (TensorSpec("x", "float32", (None, 16)),)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    request = InferRequest("req-7", "tiny", (TensorDesc("x", "float32", (3, 16)),))
    prepared = prepare(
        _launch("tiny", specs), _runner("tiny", specs), SharedInputs(), [encode_infer(request), x.tobytes()]
    )
    assert torch.equal(prepared.inputs["x"], torch.from_numpy(x))
    assert prepared.infer == request


@pytest.mark.parametrize(
    ("model", "inputs", "needle"),
    [
        ("resnet18", {"x": np.zeros((1, 16), np.float32)}, "reached a 'tiny' worker"),
        ("tiny", {"x": np.zeros((1, 17), np.float32)}, "float32[*,16]"),
        ("tiny", {"x": np.full((1, 16), np.inf, np.float32)}, "NaN or Inf"),
    ],
)
def test_prepare_refuses_what_the_model_must_not_see(model: str, inputs: dict[str, np.ndarray], needle: str) -> None:
    """Another model's request, a wrong shape and an Inf are protocol errors, never tensors."""
    specs = (TensorSpec("x", "float32", (None, 16)),)
    descs = tuple(TensorDesc(name, "float32", a.shape) for name, a in inputs.items())
    frames = [encode_infer(InferRequest(1, model, descs)), *[a.tobytes() for a in inputs.values()]]
    with pytest.raises(ProtocolError) as caught:
        prepare(_launch("tiny", specs), _runner("tiny", specs), SharedInputs(), frames)
    assert caught.value.code in (ErrorCode.INTERNAL, ErrorCode.INVALID_INPUT)
    assert needle in caught.value.message
