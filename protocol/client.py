"""The Python client: one DEALER socket, one request at a time, replies matched by id."""

from __future__ import annotations

import itertools
import os
import time
from types import TracebackType
from typing import Any

import numpy as np
import zmq

from protocol.arrays import from_frame, to_frame
from protocol.client_messages import InferRequest, decode_reply, encode_infer
from protocol.constants import ErrorCode
from protocol.errors import InferenceError, ProtocolError


class Client:
    """Sends infer requests to a daemon endpoint; not thread-safe (use one per thread)."""

    def __init__(self, endpoint: str, context: zmq.Context[Any] | None = None) -> None:
        self.endpoint = endpoint
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        # Ids only need to be unique per connection; a random start keeps them apart across runs in logs.
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little"))

    def infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray[Any, Any]],
        timeout: float = 30.0,
        deadline_ms: int | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run `model` on `inputs`; returns output arrays (read-only views) or raises InferenceError."""
        outputs, _ = self.infer_with_timing(model, inputs, timeout, deadline_ms)
        return outputs

    def infer_with_timing(
        self,
        model: str,
        inputs: dict[str, np.ndarray[Any, Any]],
        timeout: float = 30.0,
        deadline_ms: int | None = None,
    ) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, float]]:
        """Like infer, also returning the server's per-stage timings in ms."""
        request_id = next(self._ids)
        try:
            pairs = [to_frame(name, array) for name, array in inputs.items()]
        except ProtocolError as exc:
            raise InferenceError(exc.code, exc.message, request_id) from exc
        # The server stops working on a request the client has given up on.
        budget = deadline_ms if deadline_ms is not None else max(1, int(timeout * 1000))
        header = encode_infer(InferRequest(request_id, model, tuple(d for d, _ in pairs), budget))
        self._socket.send_multipart([b"", header, *(a for _, a in pairs)], copy=False)
        give_up = time.monotonic() + timeout
        while True:
            remaining = give_up - time.monotonic()
            if remaining <= 0 or not self._socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                if time.monotonic() >= give_up:
                    raise InferenceError(ErrorCode.TIMEOUT, f"no reply within {timeout:.3f} s", request_id)
                continue
            frames = self._socket.recv_multipart(copy=False)
            if len(frames) < 2 or frames[0].bytes != b"":
                continue
            payload = [f.buffer for f in frames[2:]]
            reply = decode_reply(frames[1].buffer, [len(p) for p in payload])
            if reply.request_id != request_id:
                continue  # a late reply to an earlier request that timed out here
            if isinstance(reply, ProtocolError):
                raise InferenceError(reply.code, reply.message, request_id)
            arrays = {d.name: from_frame(d, p) for d, p in zip(reply.outputs, payload)}
            return arrays, reply.timing

    def close(self) -> None:
        """Close the socket (pending requests are abandoned)."""
        self._socket.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
