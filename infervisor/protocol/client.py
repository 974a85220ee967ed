"""The Python client: one DEALER socket, one request at a time, replies matched by id."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np
import zmq

from infervisor.protocol.arrays import from_frame, to_frame
from infervisor.protocol.client_messages import InferRequest, decode_reply, encode_infer
from infervisor.protocol.constants import MAX_DEADLINE_MS, ErrorCode
from infervisor.protocol.errors import InferenceError, ProtocolError
from infervisor.protocol.shared_memory import SharedTensor
from infervisor.protocol.sockets import recv_frames, send_frames
from infervisor.protocol.tensors import TensorDesc

#: What an input may be: an array sent as a frame, or a tensor already in a shared-memory region.
Input = np.ndarray[Any, Any] | SharedTensor

#: Socket send buffer: room for a large input tensor in one write.
_SEND_BUFFER_BYTES = 4 * 2**20


class Client:
    """Sends infer requests to a daemon endpoint; not thread-safe (use one per thread)."""

    def __init__(
        self,
        endpoint: str,
        context: zmq.Context[Any] | None = None,
        server_public_key: bytes | None = None,
        client_keys: tuple[bytes, bytes] | None = None,
        max_frame_bytes: int | None = None,
    ) -> None:
        """Connect to `endpoint`; a CURVE tcp endpoint needs the server's public key and our (public, secret) keys.

        `max_frame_bytes` is the daemon's limit (status `limits.max_frame_bytes`): when given, an input over it
        raises INVALID_INPUT here instead of being sent (far over it, the daemon drops the connection and the
        request would only time out). None: no check.
        """
        if max_frame_bytes is not None and (type(max_frame_bytes) is not int or max_frame_bytes < 1):
            raise ValueError(f"max_frame_bytes must be a positive integer or None, got {max_frame_bytes!r}")
        self.endpoint = endpoint
        self.max_frame_bytes = max_frame_bytes
        self._context = context or zmq.Context.instance()
        self._socket: zmq.Socket[Any] = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A 600 KB image in one write instead of three 208 KB ones, each waiting for the daemon to drain
        # the last (resnet18, one client: ~0.05 ms less per request). The kernel caps it at wmem_max.
        self._socket.setsockopt(zmq.SNDBUF, _SEND_BUFFER_BYTES)
        if server_public_key is not None:
            if client_keys is None:
                raise ValueError("a CURVE connection needs client_keys=(public, secret) as well")
            self._socket.curve_serverkey = server_public_key
            self._socket.curve_publickey, self._socket.curve_secretkey = client_keys
        self._socket.connect(endpoint)
        self._rcvtimeo = -1
        # Ids only need to be unique per connection; a random start keeps them apart across runs in logs.
        self._ids = itertools.count(int.from_bytes(os.urandom(4), "little"))

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Input],
        timeout: float = 30.0,
        deadline_ms: int | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run `model` on `inputs`; returns output arrays (read-only views) or raises InferenceError.

        An input given as a `SharedTensor` travels by reference (ipc endpoint only): see `SharedRegion`.
        """
        outputs, _ = self.infer_with_timing(model, inputs, timeout, deadline_ms)
        return outputs

    def infer_with_timing(
        self,
        model: str,
        inputs: Mapping[str, Input],
        timeout: float = 30.0,
        deadline_ms: int | None = None,
    ) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, float]]:
        """Like infer, also returning the server's per-stage timings in ms."""
        request_id = next(self._ids)
        descs: list[TensorDesc] = []
        tensor_frames: list[Any] = []
        try:
            for name, value in inputs.items():
                if isinstance(value, SharedTensor):
                    descs.append(value.desc(name))
                else:
                    desc, array = to_frame(name, value)
                    descs.append(desc)
                    tensor_frames.append(array)
        except ProtocolError as exc:
            raise InferenceError(exc.code, exc.message, request_id) from exc
        limit = self.max_frame_bytes
        if limit is not None:
            for desc in descs:  # shared-memory inputs too: the daemon holds them to the same limit
                if desc.nbytes > limit:
                    raise InferenceError(
                        ErrorCode.INVALID_INPUT,
                        f"input {desc.name!r} is {desc.nbytes} bytes, over the daemon's max_frame_bytes of {limit}",
                        request_id,
                    )
        # By default the server's deadline is our timeout: it must not start work we will not wait for.
        budget = deadline_ms if deadline_ms is not None else min(MAX_DEADLINE_MS, max(1, int(timeout * 1000)))
        header = encode_infer(InferRequest(request_id, model, tuple(descs), budget))
        frames: list[Any] = [b"", header, *tensor_frames]
        send_frames(self._socket, frames)
        give_up = time.monotonic() + timeout
        while True:
            remaining_ms = int((give_up - time.monotonic()) * 1000) + 1
            if remaining_ms <= 0:
                raise InferenceError(ErrorCode.TIMEOUT, f"no reply within {timeout:.3f} s", request_id)
            # A blocking receive with a timeout is one wake-up; poll-then-receive would be two.
            if remaining_ms != self._rcvtimeo:
                self._socket.setsockopt(zmq.RCVTIMEO, remaining_ms)
                self._rcvtimeo = remaining_ms
            try:
                frames = recv_frames(self._socket)
            except zmq.Again:
                continue
            if len(frames) < 2 or frames[0].bytes != b"":
                continue
            payload = [f.buffer for f in frames[2:]]
            try:
                reply = decode_reply(frames[1].buffer, [len(p) for p in payload])
            except ProtocolError as exc:
                raise InferenceError(ErrorCode.INTERNAL, f"malformed reply: {exc.message}", request_id) from exc
            # An error without an id answers a message whose id the server could not read: ours,
            # since this client has one request outstanding. Other ids are late replies to
            # earlier requests that timed out here.
            if reply.request_id != request_id and not (isinstance(reply, ProtocolError) and reply.request_id is None):
                continue
            if isinstance(reply, ProtocolError):
                raise InferenceError(reply.code, reply.message, request_id)
            arrays = {d.name: from_frame(d, p) for d, p in zip(reply.outputs, payload, strict=True)}
            return arrays, reply.timing

    def close(self) -> None:
        """Close the socket (pending requests are abandoned)."""
        self._socket.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
