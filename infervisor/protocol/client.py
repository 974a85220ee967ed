"""The Python client: one DEALER socket, one request at a time, replies matched by id."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, NamedTuple

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
#: The codes an end met on a stream the daemon no longer holds: what ending it wanted is already true.
_GONE = (ErrorCode.UNKNOWN_STREAM, ErrorCode.STREAM_ENDED)


class Reply(NamedTuple):
    """A successful reply: output arrays (read-only views), the server's timings in ms, which outputs are state."""

    outputs: dict[str, np.ndarray[Any, Any]]
    timing: dict[str, float]
    state: tuple[str, ...]


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
        result = self.exchange(InferRequest(next(self._ids), model, (), deadline_ms), inputs, timeout)
        return result.outputs, result.timing

    def stream(self, model: str, stream_id: str | None = None, return_state: bool = False) -> Stream:
        """A stream of a stateful model: `with client.stream("vad") as s: out = s.infer({"x": chunk})`.

        The daemon keeps the stream's state between steps; the first `infer` starts the stream, leaving
        the `with` block ends it. `return_state`: each step also answers the state (`Stream.state`).
        `stream_id` (1..128 bytes, unique on this connection) defaults to a random one.
        """
        return Stream(self, model, stream_id or os.urandom(8).hex(), return_state)

    def exchange(self, request: InferRequest, inputs: Mapping[str, Input], timeout: float) -> Reply:
        """Send one infer request (its id, model and stream fields; `inputs` become its tensors) and wait for its reply.

        `request.inputs` is ignored; a `deadline_ms` of None means the timeout. Raises InferenceError.
        """
        request_id = request.request_id
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
        budget = request.deadline_ms
        if budget is None:
            budget = min(MAX_DEADLINE_MS, max(1, int(timeout * 1000)))
        header = encode_infer(dataclasses.replace(request, inputs=tuple(descs), deadline_ms=budget))
        frames: list[Any] = [b"", header, *tensor_frames]
        send_frames(self._socket, frames)
        return self._await_reply(request_id, timeout)

    def _await_reply(self, request_id: int | str | bytes, timeout: float) -> Reply:
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
            return Reply(arrays, reply.timing, reply.state)

    def next_id(self) -> int:
        """A request id not used before on this connection."""
        return next(self._ids)

    def close(self) -> None:
        """Close the socket (pending requests are abandoned)."""
        self._socket.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Stream:
    """One stream of a stateful model on one client connection (made by `Client.stream`); not thread-safe.

    Steps are answered in order; the daemon feeds each one the state the previous one returned. The
    first `infer` starts the stream; `end` (or leaving the `with` block) ends it. Errors are InferenceError.
    """

    def __init__(self, client: Client, model: str, stream_id: str, return_state: bool = False) -> None:
        self.client = client
        self.model = model
        self.stream_id = stream_id
        self.return_state = return_state
        self.started = False
        self.ended = False
        #: With `return_state`: the state the last step returned, by output name (empty until one did).
        self.state: dict[str, np.ndarray[Any, Any]] = {}
        #: The server's timings of the last step, in ms.
        self.timing: dict[str, float] = {}

    def infer(
        self, inputs: Mapping[str, Input], timeout: float = 30.0, deadline_ms: int | None = None, end: bool = False
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run one step (the state inputs are the daemon's to fill); `end`: it is the stream's last.

        Returns the outputs without the state (see `state`). A step that failed changed no state: the
        stream goes on from the state of the last step that succeeded.
        """
        if self.ended:
            raise InferenceError(ErrorCode.UNKNOWN_STREAM, f"stream {self.stream_id!r} was ended", None)
        return self._send(inputs, timeout, deadline_ms, end)

    def end(self, inputs: Mapping[str, Input] | None = None, timeout: float = 30.0) -> dict[str, np.ndarray[Any, Any]]:
        """End the stream: with a last step on `inputs`, or a bare end (no outputs). A second end does nothing."""
        if self.ended or (not self.started and not inputs):
            self.ended = True
            return {}
        return self._send(inputs or {}, timeout, None, True)

    def _send(
        self, inputs: Mapping[str, Input], timeout: float, deadline_ms: int | None, end: bool
    ) -> dict[str, np.ndarray[Any, Any]]:
        request = InferRequest(
            self.client.next_id(),
            self.model,
            (),
            deadline_ms,
            stream=self.stream_id,
            start=not self.started,
            end=end,
            return_state=self.return_state,
        )
        if end:  # whatever the daemon answers, this stream is over on this side
            self.ended = True
        try:
            reply = self.client.exchange(request, inputs, timeout)
        except InferenceError as exc:
            # A start the daemon refused opened nothing; a start it may have taken (no reply yet) did.
            if exc.code is ErrorCode.TIMEOUT:
                self.started = True
            elif exc.code in _GONE and self.started:  # the daemon dropped it (expired, or ended by a config change)
                self.ended = True
            raise
        self.started = True
        self.timing = reply.timing
        if self.return_state:
            self.state = {name: reply.outputs[name] for name in reply.state if name in reply.outputs}
        return {name: array for name, array in reply.outputs.items() if name not in reply.state}

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.end()
        except InferenceError as error:
            # Leaving on an error must not hide it; a stream the daemon already dropped is ended anyway.
            if exc is None and error.code not in _GONE:
                raise
