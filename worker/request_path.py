"""A request's path up to the model (decode, check, view, encode what the reply needs) and its rehearsal.

A forward pass of a real model empties the caches (`python bench/cold_path.py`: after fp32 resnet18
every step runs 10-20 times slower than warm), so the next request would find this path cold too.
While the worker idles after such a pass, it runs the same path on a canned request of its own
spec, never the model, so the next request finds the code in cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protocol import worker_messages as wm
from protocol.client_messages import InferRequest, ResultHeader, decode_infer, encode_infer
from protocol.constants import ErrorCode
from protocol.errors import ProtocolError
from protocol.launch import LaunchSpec
from protocol.tensors import TensorDesc, check_against_spec
from worker.runner import ModelRunner
from worker.shared_inputs import SharedInputs

#: A forward pass at least this long is taken to have emptied the caches: an idle worker rehearses after it.
REHEARSE_AFTER_MS = 1.0


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
    # The NaN/Inf scan is here, not in the broker: the frames were just received into this core's
    # cache, and the rehearsal keeps the scan's code warm. The broker would scan them on code its
    # idle wait through the last forward pass left cold, in the one loop every request waits on
    # (resnet18, alternating runs: the leg to the broker 90 us shorter, decode_ms 33 us longer).
    inputs = runner.inputs_from_frames(infer.inputs, shared.buffers_in_order(infer.inputs, buffers))
    # Encoded now, while caches are warm: after the forward pass each line costs several times more.
    return Prepared(
        inputs, ResultHeader(infer.request_id, infer.model), wm.encode(wm.Reply(request.request_id, None, ""))
    )


class Rehearsal:
    """A canned request of the worker's own spec, as the link delivers one, for `prepare` to run on."""

    def __init__(self, launch: LaunchSpec, runner: ModelRunner) -> None:
        self.launch = launch
        self.runner = runner
        self.shared = SharedInputs()
        examples = runner.example_inputs()
        descs = tuple(TensorDesc(s.name, s.dtype, tuple(examples[s.name].shape)) for s in runner.specs)
        self.request = wm.Request(0, None, 0.0, 0.0)
        self.header = wm.encode(self.request)[0]
        self.frames: list[Any] = [
            encode_infer(InferRequest(0, launch.model, descs)),
            *[examples[d.name].numpy().tobytes() for d in descs],
        ]

    def run(self) -> None:
        """Decode the canned REQUEST and prepare its request as a real one; nothing is sent, the model does not run."""
        wm.decode(self.header)
        prepare(self.launch, self.runner, self.shared, self.request, self.frames)
