"""A request's path up to the model: decode, check and view the client's tensors, and encode what the reply needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protocol import worker_messages as wm
from protocol.client_messages import ResultHeader, decode_infer
from protocol.constants import ErrorCode
from protocol.errors import ProtocolError
from protocol.launch import LaunchSpec
from protocol.tensors import check_against_spec
from worker.runner import ModelRunner
from worker.shared_inputs import SharedInputs


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, ready for the model, with the reply's parts that do not depend on the outputs."""

    inputs: dict[str, torch.Tensor]
    result_header: ResultHeader
    #: The REPLY message of a success, encoded (its frames go before the result header).
    success: list[Any]


def prepare(
    launch: LaunchSpec, runner: ModelRunner, shared: SharedInputs, request: wm.Request, frames: list[Any]
) -> Prepared:
    """Decode and check the client's header and tensors, view them, and encode the reply's fixed parts.

    ProtocolError for anything the model must not see. The broker checked this header already; the
    worker checks again because it is about to point tensors at these frames, and must not trust any
    sender with that.
    """
    if not frames:
        raise ProtocolError(ErrorCode.INTERNAL, "the request carries no client header")
    buffers = frames[1:]
    infer = decode_infer(frames[0], [len(b) for b in buffers], launch.max_frame_bytes)
    if infer.model != launch.model:
        raise ProtocolError(ErrorCode.INTERNAL, f"request for {infer.model!r} reached a {launch.model!r} worker")
    check_against_spec(infer.inputs, runner.specs)
    # The NaN/Inf scan (inputs_from_frames) is here, not in the broker: it reads frames just
    # received into this core's cache, and stays out of the one loop every request waits on.
    inputs = runner.inputs_from_frames(infer.inputs, shared.buffers_in_order(infer.inputs, buffers))
    # Encoded now, while caches are warm: after the forward pass each line costs several times more.
    return Prepared(
        inputs, ResultHeader(infer.request_id, infer.model), wm.encode(wm.Reply(request.request_id, None, ""))
    )
