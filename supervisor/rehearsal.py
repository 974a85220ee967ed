"""The broker's rehearsal: its per-request calls on canned messages, run while it waits out a long forward pass.

Between a request's dispatch and its reply the broker has nothing to do, and while it waits this
host evicts its caches (README, "After the forward pass, everything is cold"), so the reply then
runs the link receive, the REPLY decode and the next request's checks on cold code. With
`keep_warm_ms` set, the broker runs the same calls on canned messages every that many
milliseconds while a worker holds a request and nothing else happens, so the real ones find their
code in cache. Nothing canned reaches a client or a worker: it crosses a private socketpair.
"""

from __future__ import annotations

import socket

from protocol import worker_messages as wm
from protocol.client_messages import InferRequest, decode_infer, encode_infer, encode_result
from protocol.constants import MAX_HEADER_BYTES
from protocol.tensors import TensorDesc, check_against_spec
from protocol.worker_link import WORKER_LINK_FRAMES, Link
from supervisor.config import ModelConfig

#: The canned reply carries an output this long: about what a classifier answers (1000 float32 logits).
_OUTPUT_BYTES = 4096


class Rehearsal:
    """A canned client request of one model's spec and a canned worker reply, with a socketpair of its own."""

    def __init__(self, model: ModelConfig, max_frame_bytes: int) -> None:
        self.model = model
        self.max_frame_bytes = max_frame_bytes
        # Dynamic dims as 1: the request is only decoded and checked, its tensors are never made.
        descs = tuple(TensorDesc(s.name, s.dtype, s.example_shape()) for s in model.inputs)
        self.header = encode_infer(InferRequest(0, model.name, descs))
        self.frame_lengths = [d.nbytes for d in descs]
        output = TensorDesc("output", "uint8", (_OUTPUT_BYTES,))
        self.request = wm.Request(0, None, 0.0, 0.0)
        self.reply = wm.encode(
            wm.Reply(0, None, ""), [encode_result(0, model.name, (output,), {}), bytes(_OUTPUT_BYTES)]
        )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        limit = max(max_frame_bytes, MAX_HEADER_BYTES)
        self.sender = Link(ours, WORKER_LINK_FRAMES, limit)
        self.receiver = Link(theirs, WORKER_LINK_FRAMES, limit)

    def run(self) -> None:
        """Check the canned request as admission does, send a REQUEST and a REPLY over the pair, read and decode both.

        Raises what the real path would raise (ProtocolError, LinkClosed): the caller disables a
        rehearsal that fails rather than let it fail every millisecond.
        """
        request = decode_infer(self.header, self.frame_lengths, self.max_frame_bytes)
        check_against_spec(request.inputs, self.model.inputs)
        self.sender.send(wm.encode(self.request))
        self.sender.send(self.reply)
        for frames in self.receiver.receive():
            wm.decode(frames[0])

    def close(self) -> None:
        """Close the socketpair."""
        self.sender.close()
        self.receiver.close()
