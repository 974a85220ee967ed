"""Client-facing headers: the infer request, the result and the error reply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import (
    MAX_DEADLINE_MS,
    MAX_NAME_LEN,
    MAX_REQUEST_ID_LEN,
    MAX_STREAM_ID_LEN,
    PROTOCOL_VERSION,
    ClientMessageType,
    ErrorCode,
)
from infervisor.protocol.errors import ProtocolError, shown
from infervisor.protocol.tensors import TensorDesc, check_frames, parse_descs

RequestId = int | str | bytes


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A decoded, validated infer header (tensor frames travel beside it, untouched)."""

    request_id: RequestId
    model: str
    inputs: tuple[TensorDesc, ...]
    deadline_ms: int | None = None
    #: A stream of a stateful model (docs/protocol.md section 4.1): the client's id for it, or None.
    stream: str | None = None
    #: This step starts the stream (from the model's initial state).
    start: bool = False
    #: The stream ends with this message (a last step, or a bare end without inputs).
    end: bool = False
    #: Answer the state the step returns beside the other outputs.
    return_state: bool = False


@dataclass(frozen=True, slots=True)
class InferResult:
    """A decoded result header."""

    request_id: RequestId
    model: str
    outputs: tuple[TensorDesc, ...]
    timing: dict[str, float] = field(default_factory=dict)
    #: Of a stream step asked with `return_state`: which outputs are the stream's state.
    state: tuple[str, ...] = ()


def _valid_id(raw: object) -> RequestId | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int) and 0 <= raw < 2**64:
        return raw
    if isinstance(raw, bytes) and 0 < len(raw) <= MAX_REQUEST_ID_LEN:
        return raw
    if isinstance(raw, str) and 0 < len(raw.encode()) <= MAX_REQUEST_ID_LEN:
        return raw
    return None


def encode_infer(request: InferRequest) -> bytes:
    """Header bytes of an infer request."""
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": ClientMessageType.INFER.value,
        "id": request.request_id,
        "model": request.model,
        "inputs": [d.to_wire() for d in request.inputs],
    }
    if request.deadline_ms is not None:
        header["deadline_ms"] = request.deadline_ms
    if request.stream is not None:
        header["stream"] = request.stream
        for flag in _STREAM_FLAGS:
            if getattr(request, flag):
                header[flag] = True
    return pack(header)


#: The boolean keys of a stream step (each absent or nil = false).
_STREAM_FLAGS = ("start", "end", "return_state")


def _stream_fields(raw: dict[Any, Any]) -> tuple[str | None, bool, bool, bool]:
    """The stream id and its flags; ProtocolError(BAD_REQUEST) for a wrong type, a bad length or a flag alone."""
    stream = raw.get("stream")
    if stream is not None and (not isinstance(stream, str) or not 0 < len(stream.encode()) <= MAX_STREAM_ID_LEN):
        why = f"stream must be a string of 1..{MAX_STREAM_ID_LEN} bytes once UTF-8 encoded, got {shown(stream)}"
        raise ProtocolError(ErrorCode.BAD_REQUEST, why)
    flags = []
    for flag in _STREAM_FLAGS:
        value = raw.get(flag)
        if value is not None and type(value) is not bool:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{flag} must be true or false, got {shown(value)}")
        if value and stream is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{flag} needs a stream")
        flags.append(bool(value))
    return stream, flags[0], flags[1], flags[2]


def decode_infer(header: bytes | memoryview, frame_lengths: Sequence[int], max_frame_bytes: int) -> InferRequest:
    """Validate an infer header and its frame lengths; errors carry the request id when it was readable."""
    raw = unpack(header)
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "header must be a msgpack map")
    request_id = _valid_id(raw.get("id"))
    try:
        version = raw.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {shown(raw.get('v'))} is not supported; use {PROTOCOL_VERSION}",
            )
        if raw.get("type") != ClientMessageType.INFER:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"message type {shown(raw.get('type'))} is not 'infer'")
        if request_id is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"id must be a uint64 or a string/bytes of 1..{MAX_REQUEST_ID_LEN}"
            )
        model = raw.get("model")
        if not isinstance(model, str) or not 0 < len(model) <= MAX_NAME_LEN:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"model must be a string of 1..{MAX_NAME_LEN} characters")
        deadline = raw.get("deadline_ms")
        if deadline is not None and (type(deadline) is not int or not 0 < deadline <= MAX_DEADLINE_MS):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "deadline_ms must be a positive integer of milliseconds")
        inputs = parse_descs(raw.get("inputs"), allow_shm=True)
        # The keys in the order of the spec's table (docs/protocol.md section 4), then the frames (section 5).
        stream, start, end, return_state = _stream_fields(raw)
        check_frames(inputs, frame_lengths, max_frame_bytes)
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
    return InferRequest(request_id, model, inputs, deadline, stream, start, end, return_state)


def encode_result(
    request_id: RequestId,
    model: str,
    outputs: Sequence[TensorDesc],
    timing: dict[str, float],
    state: Sequence[str] = (),
) -> bytes:
    """Header bytes of a successful reply (`state`: the outputs that are a stream's state, when it asked for them)."""
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": ClientMessageType.RESULT.value,
        "id": request_id,
        "model": model,
        "outputs": [d.to_wire() for d in outputs],
        "timing": timing,
    }
    if state:
        header["state"] = list(state)
    return pack(header)


def encode_error(request_id: RequestId | None, code: ErrorCode, message: str) -> bytes:
    """Header bytes of an error reply; id is nil when the request's id was unreadable."""
    return pack(
        {
            "v": PROTOCOL_VERSION,
            "type": ClientMessageType.ERROR.value,
            "id": request_id,
            "code": code.value,
            "message": message,
        }
    )


def decode_reply(header: bytes | memoryview, frame_lengths: Sequence[int]) -> InferResult | ProtocolError:
    """Decode a reply header: an InferResult, or the error it carries as a ProtocolError value."""
    raw = unpack(header)
    if not isinstance(raw, dict) or type(raw.get("v")) is not int or raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.INTERNAL, "reply header is not a version-1 map")
    request_id = _valid_id(raw.get("id"))
    kind = raw.get("type")
    if kind == ClientMessageType.ERROR:
        code_raw = raw.get("code")
        code = (
            ErrorCode(code_raw)
            if isinstance(code_raw, str) and code_raw in ErrorCode.__members__
            else ErrorCode.INTERNAL
        )
        message = raw.get("message", "")
        return ProtocolError(code, message if isinstance(message, str) else shown(message), request_id)
    if kind != ClientMessageType.RESULT or request_id is None:
        raise ProtocolError(ErrorCode.INTERNAL, f"reply type {shown(kind)} is not 'result' or 'error'")
    outputs = parse_descs(raw.get("outputs"), "outputs", allow_empty_dims=True)
    check_frames(outputs, frame_lengths, 2**62)
    timing_raw = raw.get("timing") or {}
    timing = (
        {str(k): float(v) for k, v in timing_raw.items() if isinstance(v, (int, float))}
        if isinstance(timing_raw, dict)
        else {}
    )
    state_raw = raw.get("state")
    state = tuple(n for n in state_raw if isinstance(n, str)) if isinstance(state_raw, list) else ()
    return InferResult(request_id, str(raw.get("model", "")), outputs, timing, state)
