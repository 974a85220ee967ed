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

from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import ErrorCode, WorkerMessageType
from infervisor.protocol.errors import ProtocolError


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
    #: Why each profile before the serving one was skipped, one reason per item (empty when the first served).
    profile_notes: list[str]
    #: What building the serving profile did (compiled, loaded a cached package, timings), one note per item.
    build_notes: list[str]


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
    #: With a shared-memory input: `[uid, gid, *groups]` of the client that sent it (SO_PEERCRED); the
    #: worker reads only an object that client could read itself. None: the request names no object.
    reader: list[int] | None = None


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
    #: The requests the session covered (a batch counts whole, so it may pass the number asked for).
    requests: int
    operators: str
    #: None when the session covered the requests asked for; else why it ended sooner ("ended by shutdown ...").
    ended: str | None


@dataclass(frozen=True, slots=True)
class Progress:
    """Worker -> supervisor, before READY: the phase it enters now (sent by its main thread at each change).

    A compile is one long phase: no message comes while it runs, and the supervisor counts its time
    from this message's arrival.
    """

    TYPE: ClassVar = WorkerMessageType.PROGRESS
    #: A StartPhase value.
    phase: str
    #: The profile of the chain the phase is about ("" for loading and warming up of no profile).
    profile: str
    #: Its place in the chain, from 1, and the chain's length (0 and 0 when the phase is about no profile).
    index: int
    count: int
    #: Since the worker started serve() (its own clock).
    elapsed_ms: float
    #: The outcome's reason (why a profile failed or was refused), or what the phase is doing; may be empty.
    detail: str


@dataclass(frozen=True, slots=True)
class LoadError:
    """Worker -> supervisor, just before it exits LOAD_FAILED: why the model could not load, in the worker's words."""

    TYPE: ClassVar = WorkerMessageType.LOAD_ERROR
    error: str


@dataclass(frozen=True, slots=True)
class Batch:
    """Supervisor -> worker: run several requests as one forward pass.

    Each member follows as a REQUEST header frame and then that request's own frames; `frame_counts`
    says how many frames each member takes, its REQUEST header included. Every member is answered
    by its own REPLY, in order.
    """

    TYPE: ClassVar = WorkerMessageType.BATCH
    frame_counts: list[int]


@dataclass(frozen=True, slots=True)
class Audit:
    """Supervisor -> audit process: re-run a served request on eager fp32 and compare with the answer it got.

    `input_frames` frames follow first (the client's infer header and tensor frames, as the worker got them),
    then the client result header and output frames the worker answered with.
    """

    TYPE: ClassVar = WorkerMessageType.AUDIT
    seq: int
    input_frames: int


@dataclass(frozen=True, slots=True)
class AuditResult:
    """Audit process -> supervisor: the served answer against eager fp32, by the gate's measures, per row."""

    TYPE: ClassVar = WorkerMessageType.AUDIT_RESULT
    seq: int
    #: Rows compared, and how many of them miss the model's tolerance.
    rows: int
    rows_below: int
    #: The worst row's cosine and its index; the worst relative error on a few-value output ("" when none is judged).
    cosine: float
    worst_row: int
    relative_error: float
    relative_output: str
    max_abs_error: float
    top1_agree: bool
    #: Why the worst row misses the tolerance, in the gate's words; None when every row meets it.
    failure: str | None
    #: The inputs' shapes, e.g. `x[4, 8]`.
    shapes: str
    #: CPU time the audit took in its process (decode, eager forward, compare): what the budget is spent on.
    cpu_ms: float


WorkerMessage = (
    Ready | Heartbeat | Request | Reply | Stats | Drain | Stop | Canary | CanaryResult | Profile | ProfileResult
    | Progress | Batch | LoadError | Audit | AuditResult
)  # fmt: skip
_CLASSES: dict[int, type[Any]] = {
    cls.TYPE: cls
    for cls in (
        Ready, Heartbeat, Request, Reply, Stats, Drain, Stop, Canary, CanaryResult, Profile, ProfileResult, Progress,
        Batch, LoadError, Audit, AuditResult,
    )
}  # fmt: skip


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


Checker = Callable[[Any], Any]


def _checker(hint: Any, where: str) -> Checker:
    """The function that checks a decoded value against a field's annotation (and makes an int a float)."""
    expected = hint.__name__ if isinstance(hint, type) else str(hint)

    def wrong(value: Any) -> ProtocolError:
        return _bad(f"field {where} has a {type(value).__name__}, expected {expected}")

    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [o for o in typing.get_args(hint) if o is not type(None)]
        check_inner = _checker(inner, where)
        return lambda value: None if value is None else check_inner(value)
    if hint is float:

        def check_float(value: Any) -> float:
            if type(value) is float or type(value) is int:
                return float(value)
            raise wrong(value)

        return check_float
    if hint in (int, str, bool):

        def check_exact(value: Any) -> Any:
            if type(value) is hint:
                return value
            raise wrong(value)

        return check_exact
    if origin is list:
        (item,) = typing.get_args(hint)
        if item not in (int, str):
            raise TypeError(f"no wire check for {where}: {hint}")

        def check_list(value: Any) -> list[Any]:
            if type(value) is list and all(type(v) is item for v in value):
                return value
            raise wrong(value)

        return check_list
    raise TypeError(f"no wire check for {where}: {hint}")


#: Each class's field names in wire order, and the checker of each.
_FIELDS: dict[type[Any], tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in _CLASSES.values()}
_CHECKERS: dict[type[Any], tuple[Checker, ...]] = {
    cls: tuple(_checker(typing.get_type_hints(cls)[name], f"{cls.__name__}.{name}") for name in names)
    for cls, names in _FIELDS.items()
}


def encode(message: WorkerMessage, frames: Sequence[Any] = ()) -> list[Any]:
    """Frames for one message: the header, then the frames that travel with it (sent without copying)."""
    return [pack([int(message.TYPE), *[getattr(message, name) for name in _FIELDS[type(message)]]]), *frames]


def decode(header: bytes | memoryview) -> WorkerMessage:
    """Decode one header; anything malformed raises ProtocolError, never an assert."""
    raw = unpack(header)
    if type(raw) is not list or not raw or type(raw[0]) is not int:
        raise _bad("worker message must be an array starting with an integer type")
    cls = _CLASSES.get(raw[0])
    if cls is None:
        raise _bad(f"unknown worker message type {raw[0]}")
    checkers = _CHECKERS[cls]
    if len(raw) != len(checkers) + 1:
        raise _bad(f"{cls.__name__} needs {len(checkers)} fields, got {len(raw) - 1}")
    message: WorkerMessage = cls(*[check(v) for check, v in zip(checkers, raw[1:], strict=True)])
    return message
