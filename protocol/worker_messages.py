"""Supervisor-worker messages: typed dataclasses and the one codec that frames them.

On the wire a message is a msgpack array `[type, field1, field2, ...]` in the dataclass's
field order, followed by raw tensor frames for REQUEST and REPLY.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from protocol.codec import pack, unpack
from protocol.constants import ErrorCode, WorkerMessageType
from protocol.errors import ProtocolError
from protocol.tensors import TensorDesc, parse_descs


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker -> supervisor: model loaded, optimised, warmed and checked; it may get requests."""

    TYPE: ClassVar = WorkerMessageType.READY
    worker_id: str
    pid: int
    load_ms: float
    warmup_ms: float
    threads: int
    cpus: list[int]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either way: I am alive (sent by the serving loop itself, never a side thread)."""

    TYPE: ClassVar = WorkerMessageType.HEARTBEAT


@dataclass(frozen=True, slots=True)
class Request:
    """Supervisor -> worker: run the model on the tensor frames that follow."""

    TYPE: ClassVar = WorkerMessageType.REQUEST
    request_id: int
    model: str
    inputs: tuple[TensorDesc, ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """Worker -> supervisor: outputs (frames follow) or an error code and message."""

    TYPE: ClassVar = WorkerMessageType.REPLY
    request_id: int
    error_code: str | None
    message: str
    outputs: tuple[TensorDesc, ...]
    decode_ms: float
    model_ms: float
    encode_ms: float


@dataclass(frozen=True, slots=True)
class Stats:
    """Worker -> supervisor: what the worker itself sees (threads, affinity, RSS)."""

    TYPE: ClassVar = WorkerMessageType.STATS
    requests: int
    threads: int
    interop_threads: int
    cpus: list[int]
    rss: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Supervisor -> worker: finish what you hold, take nothing new, then exit 0."""

    TYPE: ClassVar = WorkerMessageType.DRAIN


@dataclass(frozen=True, slots=True)
class Stop:
    """Supervisor -> worker: exit now."""

    TYPE: ClassVar = WorkerMessageType.STOP


WorkerMessage = Union[Ready, Heartbeat, Request, Reply, Stats, Drain, Stop]
_CLASSES: dict[int, type[Any]] = {cls.TYPE: cls for cls in (Ready, Heartbeat, Request, Reply, Stats, Drain, Stop)}
_HINTS: dict[type[Any], list[tuple[str, Any]]] = {
    cls: [(f.name, typing.get_type_hints(cls)[f.name]) for f in fields(cls)] for cls in _CLASSES.values()
}


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check one decoded field against its annotation (and convert tensor lists)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(value, inner, where)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint in (int, str, bool):
        if type(value) is hint:
            return value
    elif origin is list:
        if isinstance(value, list) and all(type(v) is int for v in value):
            return value
    elif origin is tuple:
        return parse_descs(value, where)
    raise _bad(f"field {where} has a {type(value).__name__}, expected {hint}")


def encode(message: WorkerMessage, frames: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message: the header, then the tensor frames (sent without copying)."""
    header: list[Any] = [int(message.TYPE)]
    for name, _ in _HINTS[type(message)]:
        value = getattr(message, name)
        header.append([d.to_wire() for d in value] if isinstance(value, tuple) else value)
    return [pack(header), *frames]


def decode(header: bytes | memoryview) -> WorkerMessage:
    """Decode one header; anything malformed raises ProtocolError, never an assert."""
    raw = unpack(header)
    if not isinstance(raw, list) or not raw or type(raw[0]) is not int:
        raise _bad("worker message must be an array starting with an integer type")
    cls = _CLASSES.get(raw[0])
    if cls is None:
        raise _bad(f"unknown worker message type {raw[0]}")
    hints = _HINTS[cls]
    if len(raw) != len(hints) + 1:
        raise _bad(f"{cls.__name__} needs {len(hints)} fields, got {len(raw) - 1}")
    values = [_coerce(v, hint, f"{cls.__name__}.{name}") for v, (name, hint) in zip(raw[1:], hints)]
    message: WorkerMessage = cls(*values)
    return message
