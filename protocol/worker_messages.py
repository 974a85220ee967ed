"""Supervisor-worker messages: typed dataclasses and the one codec that frames them.

On the wire a message is a msgpack array `[type, field1, field2, ...]` in the dataclass's
field order. A REQUEST is followed by the client's own infer header and tensor frames, and a
successful REPLY by the client result header and output frames, so the broker forwards both
without re-encoding either.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from protocol.codec import pack, unpack
from protocol.constants import ErrorCode, WorkerMessageType
from protocol.errors import ProtocolError


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
    profile: str
    #: Why each profile before the serving one was skipped, "; "-separated (empty when the first served).
    profile_notes: str
    #: What building the serving profile did (compiled, loaded a cached package, timings), "; "-separated.
    build_notes: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either way: I am alive (sent by the serving loop itself, never a side thread)."""

    TYPE: ClassVar = WorkerMessageType.HEARTBEAT


@dataclass(frozen=True, slots=True)
class Request:
    """Supervisor -> worker: run the model on the client request (header and tensor frames) that follows."""

    TYPE: ClassVar = WorkerMessageType.REQUEST
    request_id: int
    #: CLOCK_MONOTONIC seconds after which the answer is useless (same host, so the clock is shared).
    deadline: float | None
    #: CLOCK_MONOTONIC seconds when the broker accepted it, so the worker can report the whole time taken.
    accepted_at: float
    #: How long it waited in the broker's queue.
    queue_ms: float


@dataclass(frozen=True, slots=True)
class Reply:
    """Worker -> supervisor: success (the client result header and output frames follow) or an error code."""

    TYPE: ClassVar = WorkerMessageType.REPLY
    request_id: int
    error_code: str | None
    message: str


@dataclass(frozen=True, slots=True)
class Stats:
    """Worker -> supervisor: what the worker itself sees (threads, affinity, RSS)."""

    TYPE: ClassVar = WorkerMessageType.STATS
    requests: int
    threads: int
    interop_threads: int
    cpus: list[int]
    rss: int
    #: Times the worker ran its request path on a canned request while idle (worker/request_path.py).
    rehearsals: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Supervisor -> worker: finish what you hold, take nothing new, then exit 0."""

    TYPE: ClassVar = WorkerMessageType.DRAIN


@dataclass(frozen=True, slots=True)
class Stop:
    """Supervisor -> worker: exit now."""

    TYPE: ClassVar = WorkerMessageType.STOP


@dataclass(frozen=True, slots=True)
class Canary:
    """Supervisor -> worker: run the golden inputs again and compare with your outputs from warm-up."""

    TYPE: ClassVar = WorkerMessageType.CANARY
    seq: int


@dataclass(frozen=True, slots=True)
class CanaryResult:
    """Worker -> supervisor: largest absolute difference from the warm-up outputs, and their scale."""

    TYPE: ClassVar = WorkerMessageType.CANARY_RESULT
    seq: int
    max_abs_error: float
    scale: float
    ms: float


@dataclass(frozen=True, slots=True)
class Profile:
    """Supervisor -> worker: run your next `requests` requests under torch.profiler and report the top operators."""

    TYPE: ClassVar = WorkerMessageType.PROFILE
    seq: int
    requests: int


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """Worker -> supervisor: the profiled operators as JSON text (a list of {name, calls, self_ms, total_ms})."""

    TYPE: ClassVar = WorkerMessageType.PROFILE_RESULT
    seq: int
    requests: int
    operators: str


@dataclass(frozen=True, slots=True)
class Batch:
    """Supervisor -> worker: run several requests as one forward pass.

    Each member follows as a REQUEST header frame and then that request's own frames; `frame_counts`
    says how many frames each member takes, its REQUEST header included. Every member is answered
    by its own REPLY, in order.
    """

    TYPE: ClassVar = WorkerMessageType.BATCH
    frame_counts: list[int]


WorkerMessage = (
    Ready | Heartbeat | Request | Reply | Stats | Drain | Stop | Canary | CanaryResult | Profile | ProfileResult | Batch
)
_CLASSES: dict[int, type[Any]] = {
    cls.TYPE: cls
    for cls in (
        Ready, Heartbeat, Request, Reply, Stats, Drain, Stop, Canary, CanaryResult, Profile, ProfileResult, Batch
    )
}  # fmt: skip


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _wrong(where: str, value: Any, expected: str) -> ProtocolError:
    return _bad(f"field {where} has a {type(value).__name__}, expected {expected}")


def _check_lines(hint: Any, var: str, where: str) -> list[str]:
    """Source lines that check (and for floats, convert) local `var` against the annotation `hint`."""
    expected = hint.__name__ if isinstance(hint, type) else str(hint)
    fail = f"raise _wrong({where!r}, {var}, {expected!r})"
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [o for o in typing.get_args(hint) if o is not type(None)]
        return [f"if {var} is not None:", *["    " + line for line in _check_lines(inner, var, where)]]
    if hint is float:
        return [f"if type({var}) is not float:", f"    if type({var}) is not int: {fail}", f"    {var} = float({var})"]
    if hint in (int, str, bool):
        return [f"if type({var}) is not {hint.__name__}: {fail}"]
    if origin is list:
        (item,) = typing.get_args(hint)
        if item not in (int, str):
            raise TypeError(f"no wire check for {where}: {hint}")
        return [f"if type({var}) is not list or not all(type(v) is {item.__name__} for v in {var}): {fail}"]
    raise TypeError(f"no wire check for {where}: {hint}")


def _compile(cls: type[Any]) -> tuple[Callable[[Any], bytes], Callable[[list[Any]], Any]]:
    """Compile the encoder and the checking decoder of one message class, each a single function.

    Straight-line code, as dataclasses compiles `__init__`: the broker decodes a REPLY right after
    a forward pass has evicted its caches, where every extra function it calls costs microseconds
    (`bench/cold_path.py`: the generic per-field checkers took 50 us there, this 26).
    """
    names = [f.name for f in fields(cls)]
    if set(names) & {"raw", "cls", "pack", "_bad", "_wrong", "_"}:
        raise TypeError(f"{cls.__name__}: a field name clashes with a name of the compiled decoder")
    hints = typing.get_type_hints(cls)
    fields_src = ", ".join(names)
    values_src = ", ".join(f"message.{name}" for name in names)
    lines = [
        "def encode(message):",
        f"    return pack([{int(cls.TYPE)}{', ' if names else ''}{values_src}])",
        "def decode(raw):",
        f"    if len(raw) != {len(names) + 1}:",
        f"        raise _bad(f'{cls.__name__} needs {len(names)} fields, got {{len(raw) - 1}}')",
    ]
    if names:
        lines.append(f"    _, {fields_src}{',' if len(names) == 1 else ''} = raw")
    for name in names:
        lines += ["    " + line for line in _check_lines(hints[name], name, f"{cls.__name__}.{name}")]
    lines.append(f"    return cls({fields_src})")
    namespace: dict[str, Any] = {"pack": pack, "_bad": _bad, "_wrong": _wrong, "cls": cls}
    exec("\n".join(lines), namespace)  # the source is built above from the dataclass's own fields only
    return namespace["encode"], namespace["decode"]


_CODECS: dict[type[Any], tuple[Callable[[Any], bytes], Callable[[list[Any]], Any]]] = {
    cls: _compile(cls) for cls in _CLASSES.values()
}
_DECODERS: dict[int, Callable[[list[Any]], Any]] = {cls.TYPE: _CODECS[cls][1] for cls in _CLASSES.values()}


def encode(message: WorkerMessage, frames: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message: the header, then the frames that travel with it (sent without copying)."""
    return [_CODECS[type(message)][0](message), *frames]


def decode(header: bytes | memoryview) -> WorkerMessage:
    """Decode one header; anything malformed raises ProtocolError, never an assert."""
    raw = unpack(header)
    if type(raw) is not list or not raw or type(raw[0]) is not int:
        raise _bad("worker message must be an array starting with an integer type")
    decoder = _DECODERS.get(raw[0])
    if decoder is None:
        raise _bad(f"unknown worker message type {raw[0]}")
    message: WorkerMessage = decoder(raw)
    return message
