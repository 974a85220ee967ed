"""A request's path up to the model: decode and check the client's header and tensors, then view them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infervisor.protocol.client_messages import InferRequest, decode_infer
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.launch import LaunchSpec
from infervisor.protocol.tensors import check_against_spec
from infervisor.worker.runner import ModelRunner
from infervisor.worker.shared_inputs import SharedInputs


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request, ready for the model."""

    #: The client's header: its id and model go back in the result header.
    infer: InferRequest
    inputs: dict[str, torch.Tensor]


def prepare(
    launch: LaunchSpec,
    runner: ModelRunner,
    shared: SharedInputs,
    frames: list[Any],
    reader: Sequence[int] | None = None,
) -> Prepared:
    """Decode and check the client's header and tensors, and view them as the model's inputs.

    ProtocolError for anything the model must not see. The broker checked this header already; the
    worker checks again because it is about to point tensors at these frames, and must not trust any
    sender with that. `reader`: `[uid, gid, *groups]` of the client, for its shared-memory inputs.
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
    tensors = shared.buffers_in_order(infer.inputs, buffers, reader)
    return Prepared(infer, runner.inputs_from_frames(infer.inputs, tensors))
