"""Streams of stateful models: the state each stream committed lives here, in the supervisor, between its steps.

A step goes to a worker as an ordinary request whose state inputs the broker filled from the stream's last
committed state (the model's initial state at the start), so the batcher joins steps of different streams
like any requests, their states stacked along dim 0. The state the model returns is committed only when
the step's result reaches the broker: a worker that dies, hangs or retires mid-step leaves the stream's
state as it was, and the step re-runs on another worker from that same state (the broker's retry path),
so no step is lost and no answer changes. A step's reply is the only commit, and a reply is taken once
(broker pipelines), so no step commits twice.

One step of a stream is in flight at a time; the next ones wait here, in its backlog, in order. Cost per
step in the supervisor: one header re-encode on the way in and a decode and re-encode of the result header
on the way out, plus a copy of the state each way (state bytes, e.g. 1 KiB for a 2×128 float32 GRU state).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from infervisor.protocol.client_messages import InferRequest, encode_error, encode_infer, encode_result
from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import DTYPE_ITEMSIZE, MAX_STREAM_BACKLOG, TIMING_KEYS, ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import TensorDesc, TensorSpec, check_against_spec
from infervisor.supervisor.routing.admission import Refused, SpecServed, admitting_spec
from infervisor.supervisor.routing.model_queue import ModelQueue
from infervisor.supervisor.routing.pending import OpenStream, Peer, PendingRequest, StreamKey, StreamStep
from infervisor.supervisor.settings.model_entry import ModelConfig
from infervisor.supervisor.settings.state_keys import load_initial_state
from infervisor.supervisor.settings.stream_keys import peer_share

#: How often open streams are checked for idleness and for a change of their model's state pairs.
UPKEEP_S = 0.25
#: Streams a model remembers as gone (ended, expired, ended by a config change), to say why a late step fails.
_GONE_REMEMBERED = 4096


@dataclass
class StreamTable:
    """One model's open streams, the ones it remembers as gone, and its stream counters."""

    streams: dict[StreamKey, OpenStream] = field(default_factory=dict)
    gone: collections.OrderedDict[StreamKey, tuple[ErrorCode, str]] = field(default_factory=collections.OrderedDict)
    state_bytes: int = 0
    #: Open streams and their state bytes per owner (a uid, a CURVE key, a connection): each within its share.
    peer_streams: collections.Counter[str] = field(default_factory=collections.Counter)
    peer_bytes: collections.Counter[str] = field(default_factory=collections.Counter)
    opened: int = 0
    expired: int = 0
    #: Steps put back in line after their worker was lost (re-run from the committed state).
    resumed: int = 0
    #: Streams the daemon ended because the model's state pairs changed.
    ended_by_config: int = 0

    def forget(self, stream: OpenStream, code: ErrorCode, why: str) -> None:
        """Drop an open stream and remember why, so its next step says so."""
        if self.streams.pop(stream.key, None) is not None:
            self.state_bytes -= stream.nbytes
            owner = stream.key[0]
            self.peer_streams[owner] -= 1
            self.peer_bytes[owner] -= stream.nbytes
            if self.peer_streams[owner] <= 0:
                del self.peer_streams[owner], self.peer_bytes[owner]
        self.gone[stream.key] = (code, why)
        self.gone.move_to_end(stream.key)
        while len(self.gone) > _GONE_REMEMBERED:
            self.gone.popitem(last=False)

    def report(self, model: ModelConfig) -> dict[str, Any]:
        """The status `streams` section of a stateful model."""
        share = peer_share(model.max_streams, model.max_streams_per_peer)
        return {
            "open": len(self.streams),
            "max_streams": model.max_streams,
            "state_bytes": self.state_bytes,
            "max_state_bytes": model.max_state_bytes,
            "peers": len(self.peer_streams),
            "max_streams_per_peer": share,
            "max_state_bytes_per_peer": peer_bytes_share(model, share),
            "opened": self.opened,
            "expired": self.expired,
            "resumed": self.resumed,
            "ended_by_config": self.ended_by_config,
        }


def peer_bytes_share(model: ModelConfig, share: int) -> int:
    """State bytes one peer may hold: its share of the streams, as a share of `max_state_bytes`."""
    return model.max_state_bytes * share // model.max_streams


#: Sends an accepted request's final reply (the request, its code or None, header, frames): `Replies.finish`.
Send = Callable[[PendingRequest, ErrorCode | None, Any, list[Any]], None]


def state_descs(pairs: tuple[StateSpec, ...]) -> tuple[TensorDesc, ...]:
    """The descriptors of one stream's state inputs: batch of one."""
    return tuple(TensorDesc(pair.input, pair.dtype, (1, *pair.shape)) for pair in pairs)


def _state_sizes(pairs: tuple[StateSpec, ...]) -> list[int]:
    """Bytes of one stream's state, per pair."""
    return [math.prod(pair.shape) * DTYPE_ITEMSIZE[pair.dtype] for pair in pairs]


def _pairs_change(old: tuple[StateSpec, ...], new: tuple[StateSpec, ...]) -> str:
    def shown(pairs: tuple[StateSpec, ...]) -> str:
        return ", ".join(f"{p.input}->{p.output} {p.dtype}{list(p.shape)} init {p.initial or 'zeros'}" for p in pairs)

    return f"the model's state pairs changed in the config ({shown(old) or 'none'} -> {shown(new) or 'none'})"


class Streams:
    """Every stateful model's stream table, and the stage every accepted request's final reply passes on its way out.

    The broker hands it stream requests, and every final reply of a request it accepted; a step's reply commits
    its stream's state here before `send` (the broker's replies, given at assembly) takes it to the client, and
    the stream's next step goes after it. Nothing flows back: the replies know nothing of streams.
    """

    def __init__(self, queues: dict[str, ModelQueue], send: Send) -> None:
        self.queues = queues
        self.send = send
        self.tables: dict[str, StreamTable] = {}
        #: Models whose queue got a released step since the broker last dispatched them.
        self.released: set[str] = set()
        self._initial: dict[tuple[StateSpec, ...], list[bytes]] = {}
        self.next_upkeep = 0.0
        #: Streams of models that left the config, and why each is gone: their later steps say so (STREAM_ENDED).
        self.removed: collections.OrderedDict[tuple[str, StreamKey], tuple[ErrorCode, str]] = collections.OrderedDict()

    def table(self, model: str) -> StreamTable:
        """The model's stream table (made on first use)."""
        return self.tables.setdefault(model, StreamTable())

    # ---- admission --------------------------------------------------------------------------

    def admit(
        self,
        pending: PendingRequest,
        request: InferRequest,
        model: ModelConfig,
        target: ModelConfig | None,
        spec_served: SpecServed,
        owner: str,
    ) -> None:
        """Open, step or end the stream `request` names, of `owner` (who sent it); Refused when it cannot."""
        if request.stream is None:
            raise ValueError("not a stream request")
        if not model.state:
            why = f"model {model.name!r} declares no state: it takes no stream (send the request without `stream`)"
            raise _refusal(ErrorCode.INVALID_INPUT, why, request, "stream_on_stateless")
        table = self.table(model.name)
        key: StreamKey = (owner, pending.client, request.stream)
        stream = table.streams.get(key)
        if request.start and stream is not None:
            why = f"stream {request.stream!r} is already open on this connection; end it first or choose a new id"
            raise _refusal(ErrorCode.STREAM_EXISTS, why, request, "stream_exists")
        if not request.start and stream is None:
            never = (ErrorCode.UNKNOWN_STREAM, "it was never started on this connection")
            code, why = table.gone.get(key) or self.removed.get((model.name, key)) or never
            raise _refusal(code, f"stream {request.stream!r} is not open: {why}", request, "unknown_stream")
        pairs = stream.pairs if stream is not None else self._starting_pairs(model, target, spec_served, request)
        bare = not request.inputs
        if bare and not request.end and not request.start:
            raise _refusal(ErrorCode.INVALID_INPUT, "a step needs inputs (only a start or an end may be bare)", request)
        if not bare:
            pending.spec = self._check_inputs(request, model, target, pairs, spec_served)
        # A bare end may take one place past the bound: ending a busy stream must not need a free place.
        limit = MAX_STREAM_BACKLOG + (1 if bare and request.end else 0)
        if stream is not None and len(stream.backlog) >= limit:
            why = f"stream {request.stream!r} already has {MAX_STREAM_BACKLOG} steps waiting behind its step in flight"
            raise _refusal(ErrorCode.OVERLOADED, why, request, "stream_backlog_full")
        queue = self.queues[model.name]
        if (stream is None or stream.in_flight is None) and not bare and len(queue.waiting) >= queue.capacity:
            raise _refusal(ErrorCode.OVERLOADED, f"queue of {model.name!r} is full ({queue.capacity})", request)
        if stream is None:
            stream = self._open(table, model, key, pairs, request)
        pending.step = StreamStep(stream, request.inputs, request.end, request.return_state)
        stream.last_active = time.monotonic()
        stream.backlog.append(pending)
        if stream.in_flight is None:
            self.release_next(stream)

    def _starting_pairs(
        self, model: ModelConfig, target: ModelConfig | None, spec_served: SpecServed, request: InferRequest
    ) -> tuple[StateSpec, ...]:
        """A new stream's pairs: the model's; while a rollout changes them, the new ones once served."""
        if target is None or target.state == model.state:
            return model.state
        if target.state and spec_served(model.name, target.inputs):
            return target.state
        why = f"model {model.name!r} is rolling out new state pairs; streams start once a worker built with them serves"
        raise _refusal(ErrorCode.UNAVAILABLE, why, request, "stream_start_in_state_rollout")

    def _check_inputs(
        self,
        request: InferRequest,
        model: ModelConfig,
        target: ModelConfig | None,
        pairs: tuple[StateSpec, ...],
        spec_served: SpecServed,
    ) -> tuple[TensorSpec, ...] | None:
        """The spec that admits the step with its state inputs added; Refused(INVALID_INPUT) when none does."""
        state_inputs = {pair.input for pair in pairs}
        sent = sorted(d.name for d in request.inputs if d.name in state_inputs)
        if sent:
            why = f"input(s) {sent} are the stream's state: the daemon feeds them; send the other inputs only"
            raise _refusal(ErrorCode.INVALID_INPUT, why, request)
        for desc in request.inputs:
            if desc.shape and desc.shape[0] != 1:
                why = f"input {desc.name!r} has {desc.shape[0]} rows: a stream step is one row (dim 0 = 1)"
                raise _refusal(ErrorCode.INVALID_INPUT, why, request)
        full = (*request.inputs, *state_descs(pairs))
        try:
            if target is not None and pairs == target.state and pairs != model.state:
                check_against_spec(full, target.inputs)  # a stream started on a rollout's new pairs
                return target.inputs
            return admitting_spec(target, model, full, spec_served)
        except ProtocolError as exc:
            raise _refusal(exc.code, exc.message, request) from None

    def _open(
        self,
        table: StreamTable,
        model: ModelConfig,
        key: StreamKey,
        pairs: tuple[StateSpec, ...],
        request: InferRequest,
    ) -> OpenStream:
        initial = self._initial_state(pairs)
        nbytes = sum(len(buffer) for buffer in initial)
        if len(table.streams) >= model.max_streams:
            why = f"model {model.name!r} has {len(table.streams)} open streams, its max_streams"
            raise _refusal(ErrorCode.TOO_MANY_STREAMS, why, request, "too_many_streams")
        owner, share = key[0], peer_share(model.max_streams, model.max_streams_per_peer)
        held, bytes_share = table.peer_streams[owner], peer_bytes_share(model, share)
        if held >= share or table.peer_bytes[owner] + nbytes > bytes_share:
            why = (
                f"{owner} holds {held} open streams of model {model.name!r} ({table.peer_bytes[owner]} bytes of "
                f"state); one more would pass its share: max_streams_per_peer {share}, {bytes_share} bytes"
            )
            raise _refusal(ErrorCode.TOO_MANY_STREAMS, why, request, "too_many_streams_per_peer")
        if table.state_bytes + nbytes > model.max_state_bytes:
            why = (
                f"model {model.name!r} streams hold {table.state_bytes} bytes of state; one more ({nbytes}) would pass "
                f"its max_state_bytes of {model.max_state_bytes}"
            )
            raise _refusal(ErrorCode.TOO_MANY_STREAMS, why, request, "too_many_streams")
        stream = OpenStream(key, model.name, pairs, list(initial), nbytes, time.monotonic())
        table.streams[key] = stream
        table.gone.pop(key, None)
        table.state_bytes += nbytes
        table.peer_streams[owner] += 1
        table.peer_bytes[owner] += nbytes
        table.opened += 1
        return stream

    def _initial_state(self, pairs: tuple[StateSpec, ...]) -> list[bytes]:
        """Each pair's initial state as raw bytes, read once per set of pairs (the config checked the files)."""
        initial = self._initial.get(pairs)
        if initial is None:
            initial = [load_initial_state(pair).tobytes() for pair in pairs]
            self._initial[pairs] = initial
        return initial

    # ---- a step's turn ----------------------------------------------------------------------

    def release_next(self, stream: OpenStream) -> None:
        """Give the stream's next waiting step its turn: into its model's line with the committed state, or answered."""
        while stream.in_flight is None and stream.backlog:
            pending = stream.backlog.popleft()
            step = pending.step
            if step is None:
                raise ValueError("a stream backlog holds a request without a step")
            if not step.inputs:  # a bare start or end: nothing to run, answered in its turn
                stream.in_flight = pending
                pending.dispatched_at = time.monotonic()
                timing = _bare_timing(pending.accepted_at, pending.dispatched_at)
                self.finish(pending, None, encode_result(pending.request_id, pending.model, (), timing), [])
                continue
            descs = (*step.inputs, *state_descs(stream.pairs))
            header = encode_infer(InferRequest(pending.request_id, pending.model, descs))
            pending.frames = [header, *pending.frames[1:], *stream.state]
            if pending.shape_key:
                pending.shape_key = tuple((d.name, d.dtype, d.shape[1:]) for d in descs)
            stream.in_flight = pending
            queue = self.queues.get(pending.model)
            if queue is None:
                self.fail(pending, ErrorCode.UNKNOWN_MODEL, f"model {pending.model!r} was removed")
                continue
            queue.waiting.append(pending)
            self.released.add(pending.model)

    def dispatch_released(self, dispatch: Callable[[str], None]) -> None:
        """Dispatch the models whose line got a stream's next step (released as its last step was answered)."""
        while self.released:
            dispatch(self.released.pop())

    def finish(self, request: PendingRequest, code: ErrorCode | None, header: Any, frames: list[Any]) -> None:
        """Send the one final reply of an accepted request; a stream step's through its stream (see `_settle`)."""
        step = request.step
        if step is None:
            self.send(request, code, header, frames)
            return
        code, header, frames = self._settle(request, step, code, header, frames)
        self.send(request, code, header, frames)
        if not step.stream.closed:  # only now, so the stream's next reply goes after this one
            self.release_next(step.stream)

    def fail(self, request: PendingRequest, code: ErrorCode, message: str) -> None:
        """Finish an accepted request with an error."""
        self.finish(request, code, encode_error(request.request_id, code, message), [])

    def _settle(
        self, request: PendingRequest, step: StreamStep, code: ErrorCode | None, header: Any, frames: list[Any]
    ) -> tuple[ErrorCode | None, Any, list[Any]]:
        """A step's final reply is about to go: commit the state it returned, and answer the client's outputs.

        Only the stream's step in flight commits, and only a result does: an error leaves the state as it was.
        """
        stream = step.stream
        table = self.table(stream.model)
        if code is None and step.inputs:
            try:
                code, header, frames = _commit(request, step, header, frames)
            except ProtocolError as exc:
                code, header, frames = exc.code, encode_error(request.request_id, exc.code, exc.message), []
        if stream.in_flight is request:
            stream.in_flight = None
            stream.last_active = time.monotonic()
        if step.end and not stream.closed:
            self._end(table, stream, ErrorCode.UNKNOWN_STREAM, "the client ended it")
        return code, header, frames

    def requeued(self, request: PendingRequest) -> None:
        """A stream step goes back in line after its worker was lost: it re-runs from the same committed state."""
        if request.step is not None:
            self.table(request.model).resumed += 1

    # ---- ending streams ---------------------------------------------------------------------

    def _end(self, table: StreamTable, stream: OpenStream, code: ErrorCode, why: str) -> None:
        """Close a stream: steps waiting behind it fail with `code`; its step in flight is answered, uncommitted."""
        stream.closed = True
        table.forget(stream, code, why)
        while stream.backlog:
            self.fail(stream.backlog.popleft(), code, f"stream {stream.key[2]!r} ended: {why}")

    def upkeep(self, now: float, desired: Callable[[str], ModelConfig | None]) -> None:
        """Drop idle streams and answer their waiting steps past their deadline (and catch up on config changes).

        At most every UPKEEP_S: a pass reads every open stream, and the broker's housekeeping runs every 20 ms.
        """
        if now < self.next_upkeep:
            return
        self.next_upkeep = now + UPKEEP_S
        self.end_changed(desired)
        for name, table in self.tables.items():
            config = desired(name)
            for stream in list(table.streams.values()):
                self._expire_waiting(stream, now)
                if config is not None and _idle(stream, now, config.stream_idle_s):
                    table.expired += 1
                    why = f"it expired after {config.stream_idle_s:g} s without a step (stream_idle_s)"
                    self._end(table, stream, ErrorCode.UNKNOWN_STREAM, why)

    def end_changed(self, desired: Callable[[str], ModelConfig | None]) -> None:
        """End, at once, the streams whose model's state pairs changed in the config or that left it (STREAM_ENDED)."""
        for name, table in list(self.tables.items()):
            config = desired(name)
            if config is None:
                self.end_model(name)
                continue
            for stream in list(table.streams.values()):
                if stream.pairs != config.state:
                    table.ended_by_config += 1
                    self._end(table, stream, ErrorCode.STREAM_ENDED, _pairs_change(stream.pairs, config.state))

    def end_model(self, name: str) -> None:
        """A model left the config: end its streams (STREAM_ENDED) and remember them, so later steps say why."""
        table = self.tables.pop(name, None)
        if table is None:
            return
        for stream in list(table.streams.values()):
            self._end(table, stream, ErrorCode.STREAM_ENDED, f"model {name!r} was removed from the config")
        for key, gone in table.gone.items():
            self.removed[(name, key)] = gone
            self.removed.move_to_end((name, key))
        while len(self.removed) > _GONE_REMEMBERED:
            self.removed.popitem(last=False)

    def removed_refusal(self, refused: Refused, owner: str, client: Peer) -> Refused:
        """An UNKNOWN_MODEL refusal of a step on a stream of a removed model: STREAM_ENDED, saying why, instead."""
        if refused.stream is None:
            return refused
        model, stream = refused.stream
        gone = self.removed.get((model, (owner, client, stream)))
        if gone is None:
            return refused
        why = f"stream {stream!r} is not open: {gone[1]}"
        return Refused(gone[0], why, refused.request_id, None, "unknown_stream")

    def _expire_waiting(self, stream: OpenStream, now: float) -> None:
        """Answer the steps waiting behind the stream's step in flight whose deadline passed (they commit nothing)."""
        if any(pending.expired(now) for pending in stream.backlog):
            late = [pending for pending in stream.backlog if pending.expired(now)]
            stream.backlog = collections.deque(pending for pending in stream.backlog if not pending.expired(now))
            for pending in late:
                why = "deadline passed while waiting behind its stream's step in flight"
                self.fail(pending, ErrorCode.DEADLINE_EXCEEDED, why)

    def fail_waiting(self, code: ErrorCode, message: str) -> None:
        """Answer every step waiting in a stream backlog (the daemon stops)."""
        for stream in self.open_streams():
            while stream.backlog:
                self.fail(stream.backlog.popleft(), code, message)

    def open_streams(self) -> Iterator[OpenStream]:
        """Every open stream of every model."""
        for table in list(self.tables.values()):
            yield from list(table.streams.values())

    def report(self, model: ModelConfig) -> dict[str, Any] | None:
        """The status `streams` section of a model: None for a model without state."""
        if not model.state:
            return None
        return self.table(model.name).report(model)


def _bare_timing(accepted_at: float, answered_at: float) -> dict[str, float]:
    """A bare start's or end's `timing`: every key of a result's (section 6); it waited its turn and ran nothing."""
    waited = round((answered_at - accepted_at) * 1000.0, 3)
    timing = dict.fromkeys(TIMING_KEYS, 0.0)
    timing.update(queue_ms=waited, total_ms=waited, accepted_clock_ms=round(accepted_at * 1000.0, 3))
    return timing


def _refusal(code: ErrorCode, why: str, request: InferRequest, anomaly: str | None = None) -> Refused:
    return Refused(code, why, request.request_id, request.model, anomaly or f"rejected_{code.value}")


def _idle(stream: OpenStream, now: float, limit_s: float) -> bool:
    return stream.in_flight is None and not stream.backlog and now - stream.last_active > limit_s


def _commit(
    request: PendingRequest, step: StreamStep, header: Any, frames: list[Any]
) -> tuple[ErrorCode | None, Any, list[Any]]:
    """Take the state out of a worker's result: commit it, and the header the client gets.

    The worker wrote the header (and the worker link checked its frames), so it is read as a plain map:
    a full descriptor check would cost four times the decode, on every step.
    """
    stream = step.stream
    raw = unpack(getattr(header, "buffer", header))
    outputs = raw.get("outputs") if isinstance(raw, dict) else None
    if not isinstance(outputs, list) or len(outputs) != len(frames):
        raise ProtocolError(ErrorCode.INTERNAL, "the worker's result header does not describe its frames")
    position = {entry.get("name"): i for i, entry in enumerate(outputs) if isinstance(entry, dict)}
    new_state: list[bytes] = []
    for pair, nbytes in zip(stream.pairs, _state_sizes(stream.pairs), strict=True):
        index = position.get(pair.output)
        entry = outputs[index] if index is not None else None
        shape = [1, *pair.shape]
        if not isinstance(entry, dict) or entry.get("dtype") != pair.dtype or entry.get("shape") != shape:
            got = "nothing" if entry is None else f"{entry.get('dtype')}{entry.get('shape')}"
            why = f"the model returned {got} as state output {pair.output!r}, not {pair.dtype}{shape}"
            raise ProtocolError(ErrorCode.INTERNAL, why)
        frame = frames[position[pair.output]]
        if len(frame) != nbytes:
            raise ProtocolError(ErrorCode.INTERNAL, f"state output {pair.output!r} is not {nbytes} bytes")
        new_state.append(frame.bytes if hasattr(frame, "bytes") else bytes(frame))
    if stream.in_flight is request and not stream.closed:
        stream.state = new_state
    if step.return_state:
        raw["state"] = [pair.output for pair in stream.pairs]
        return None, pack(raw), frames
    names = {pair.output for pair in stream.pairs}
    keep = [i for i, entry in enumerate(outputs) if not (isinstance(entry, dict) and entry.get("name") in names)]
    raw["outputs"] = [outputs[i] for i in keep]
    return None, pack(raw), [frames[i] for i in keep]
