"""The gateway's one connection to the broker: a DEALER on the daemon's client endpoint, many requests in flight.

It speaks the client protocol of docs/protocol.md (the headers of protocol/client_messages.py, tensors as raw
frames), so every OIP request meets the broker's admission, limits, deadlines, batching, fallback and audit as
any ZeroMQ client's does. Replies are matched to their requests by id; a late one (its asker gone) is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from infervisor.protocol.arrays import from_frame, to_frame
from infervisor.protocol.client_messages import InferRequest, InferResult, decode_reply, encode_infer
from infervisor.protocol.constants import MAX_DEADLINE_MS, ErrorCode
from infervisor.protocol.errors import InferenceError, ProtocolError

#: Room for a large input tensor in one write (the Python client's figure).
_SEND_BUFFER_BYTES = 4 * 2**20

Outputs = dict[str, np.ndarray[Any, Any]]


class BrokerLink:
    """Sends infer requests to the broker and hands each reply to the task that awaits it."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context) -> None:
        self.socket: zmq.asyncio.Socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDBUF, _SEND_BUFFER_BYTES)
        self.socket.connect(endpoint)
        self.waiting: dict[int, asyncio.Future[tuple[InferResult, list[Any]]]] = {}
        self.ids = itertools.count(int.from_bytes(os.urandom(4), "little"))
        self.late_replies = 0

    async def read_replies(self) -> None:
        """Forever: read a reply and resolve its request's future (the gateway's one reader task)."""
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            if len(frames) < 2 or frames[0].bytes != b"":
                continue
            payload = [f.buffer for f in frames[2:]]
            try:
                reply = decode_reply(frames[1].buffer, [len(p) for p in payload])
            except ProtocolError:
                continue
            request_id = reply.request_id
            future = self.waiting.pop(request_id, None) if isinstance(request_id, int) else None
            if future is None or future.done():
                self.late_replies += 1
                continue
            if isinstance(reply, ProtocolError):
                future.set_exception(InferenceError(reply.code, reply.message, request_id))
            else:
                future.set_result((reply, payload))

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        timeout_s: float,
        stream: tuple[str, bool, bool] | None = None,
    ) -> Outputs:
        """Run `model` on `inputs` through the broker; the outputs in the model's order, or InferenceError.

        `stream`: (id, start, end) of a stateful model's stream; the daemon fills the state inputs.
        """
        request_id = next(self.ids) % 2**64
        descs, frames = [], []
        for name, value in inputs.items():
            try:
                desc, array = to_frame(name, value)
            except ProtocolError as exc:
                raise InferenceError(exc.code, exc.message, request_id) from exc
            descs.append(desc)
            frames.append(array)
        budget = min(MAX_DEADLINE_MS, max(1, int(timeout_s * 1000)))
        stream_id, start, end = stream if stream is not None else (None, False, False)
        header = encode_infer(InferRequest(request_id, model, tuple(descs), budget, stream_id, start, end))
        future: asyncio.Future[tuple[InferResult, list[Any]]] = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        try:
            await self.socket.send_multipart([b"", header, *frames], copy=False)
            result, payload = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise InferenceError(ErrorCode.TIMEOUT, f"no reply within {timeout_s:.3f} s", request_id) from None
        finally:
            self.waiting.pop(request_id, None)
        return {d.name: from_frame(d, p) for d, p in zip(result.outputs, payload, strict=True)}

    def close(self) -> None:
        """Close the socket; whatever still waits is abandoned."""
        self.socket.close(linger=0)
