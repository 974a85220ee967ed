"""What a client message must be to be admitted: a well-formed envelope and header, a served model, inputs it takes.

Pure checks: they read the serving config and ask which specs are served, and say why a message
is refused (a `Refused`); queueing, budgets and replies are the broker's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from infervisor.protocol.client_messages import InferRequest, RequestId, decode_infer
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.tensors import TensorDesc, TensorSpec, check_against_spec
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.serving_config import ServingConfig

#: True while some worker of the model, built with this spec, serves (a rollout's new inputs are admitted then).
SpecServed = Callable[[str, tuple[TensorSpec, ...]], bool]


class Refused(Exception):
    """A client message answered with an error at admission, and the anomaly it is counted as."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: RequestId | None,
        model: str | None,
        anomaly: str,
        stream: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id, self.model, self.anomaly = code, message, request_id, model, anomaly
        #: Of an unknown model's stream step: (the model named, the stream id), to tell a removed model's stream.
        self.stream = stream


def _refused(exc: ProtocolError, request_id: RequestId | None, model: str | None) -> Refused:
    return Refused(exc.code, exc.message, request_id, model, f"rejected_{exc.code.value}")


def admit(
    frames: list[Any], from_ipc: bool, serving: ServingConfig, spec_served: SpecServed
) -> tuple[InferRequest, ModelConfig, tuple[TensorSpec, ...] | None]:
    """The decoded request, its model and the spec that admits it (None: any worker of the model); else Refused."""
    if len(frames) < 3 or len(frames[1]) != 0:
        why = "expected frames: empty delimiter, header, tensors"
        raise Refused(ErrorCode.BAD_REQUEST, why, None, None, "malformed_envelope")
    config = serving.current
    tensor_frames = frames[3:]
    try:
        request = decode_infer(frames[2].buffer, [len(f) for f in tensor_frames], config.max_frame_bytes)
    except ProtocolError as exc:
        raise _refused(exc, exc.request_id, None) from None
    if not from_ipc and any(d.shm is not None for d in request.inputs):
        # A worker opens what a shared-memory input names: only a client of this box may name it. A
        # descriptor check (7.1 step 4): before the model is looked up, and not one of its errors.
        why = "inputs in shared memory are for the ipc endpoint only"
        raise _refused(ProtocolError(ErrorCode.BAD_REQUEST, why), request.request_id, None)
    model = config.models.get(request.model)
    if model is None:
        why = f"no model {request.model!r}; serving {sorted(config.models)}"
        stream = None if request.stream is None else (request.model, request.stream)
        code = ErrorCode.UNKNOWN_MODEL
        raise Refused(code, why, request.request_id, None, f"rejected_{code.value}", stream)
    if request.stream is not None:
        return request, model, None  # a stream step's inputs are checked with its state added (routing/streams.py)
    try:
        # NaN/Inf are the worker's to find: it reads the frames anyway, right before the model.
        spec = admitting_spec(serving.target(request.model), model, request.inputs, spec_served)
    except ProtocolError as exc:
        raise _refused(exc, request.request_id, request.model) from None
    return request, model, spec


def admitting_spec(
    target: ModelConfig | None, model: ModelConfig, inputs: Sequence[TensorDesc], spec_served: SpecServed
) -> tuple[TensorSpec, ...] | None:
    """Check a request's inputs; ProtocolError when they fit no spec the model's workers serve.

    Returns None when any worker of the model may take it. While a rollout changes the model's
    inputs, a request fitting the new spec is admitted once a worker built with it serves, and
    each request then goes only to workers of the spec that admitted it.
    """
    if target is None or target.inputs == model.inputs:
        check_against_spec(inputs, model.inputs)
        return None
    try:
        check_against_spec(inputs, model.inputs)
        return model.inputs
    except ProtocolError:
        if not spec_served(model.name, target.inputs):
            raise
        check_against_spec(inputs, target.inputs)
        return target.inputs
