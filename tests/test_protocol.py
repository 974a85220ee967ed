"""Wire protocol v1: round trips, rejections with the right ErrorCode, and fuzzing of every decoder."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, ParamSpec, TypeVar

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from infervisor.protocol import worker_messages as wm
from infervisor.protocol.arrays import check_finite, from_frame, to_frame
from infervisor.protocol.client_messages import (
    InferRequest,
    InferResult,
    decode_infer,
    decode_reply,
    encode_error,
    encode_infer,
    encode_result,
)
from infervisor.protocol.codec import pack, unpack
from infervisor.protocol.constants import (
    DEFAULT_MAX_FRAME_BYTES,
    DTYPE_ITEMSIZE,
    MAX_DEADLINE_MS,
    MAX_HEADER_BYTES,
    MAX_MESSAGE_LEN,
    MAX_NAME_LEN,
    MAX_RANK,
    MAX_REQUEST_ID_LEN,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    TIMING_KEYS,
    ErrorCode,
    WorkerMessageType,
)
from infervisor.protocol.errors import InferenceError, ProtocolError
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import TensorDesc, TensorSpec, check_against_spec, check_frames, parse_descs

ROOT = Path(__file__).resolve().parent.parent
P = ParamSpec("P")
T = TypeVar("T")

#: Examples per fuzz test; a long run is `INFERVISOR_FUZZ_EXAMPLES=200000 pytest tests/test_protocol.py -k fuzz`.
FUZZ_EXAMPLES: Final = int(os.environ.get("INFERVISOR_FUZZ_EXAMPLES", "300"))
BYTES_FUZZ_EXAMPLES: Final = FUZZ_EXAMPLES
STRUCTURED_FUZZ_EXAMPLES: Final = FUZZ_EXAMPLES
FLIP_FUZZ_EXAMPLES: Final = FUZZ_EXAMPLES

_FUZZ_BASE: Final = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz_settings(max_examples: int) -> settings:
    """Hypothesis settings of the fuzz tests: no deadline, `max_examples` inputs."""
    return settings(_FUZZ_BASE, max_examples=max_examples)


DTYPES: Final = sorted(DTYPE_ITEMSIZE)
MULTIBYTE_DTYPES: Final = [d for d in DTYPES if DTYPE_ITEMSIZE[d] > 1]


class _Delete:
    """Marker for `remove this key` in header builders (with a stable repr for test ids)."""

    def __repr__(self) -> str:
        """Show as DELETE in test ids."""
        return "DELETE"


DELETE: Final = _Delete()
DEEP: Final = 1000  # nesting depth msgpack still decodes (its own limit is 1024 containers)


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _infer_header(**changes: object) -> dict[str, Any]:
    """A valid infer header as a dict (one float32[2,16] input), with keys replaced or DELETE'd."""
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": "infer",
        "id": 7,
        "model": "m",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 16]}],
    }
    for key, value in changes.items():
        if value is DELETE:
            header.pop(key, None)
        else:
            header[key] = value
    return header


def _inputs(*descs: dict[str, Any]) -> dict[str, Any]:
    """A valid infer header whose inputs are `descs`."""
    return _infer_header(inputs=list(descs))


def _reject(
    header: dict[str, Any] | bytes,
    frame_lengths: list[int] | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> ProtocolError:
    """The ProtocolError decode_infer raises for `header` (frames default to one per descriptor, sized right)."""
    data = header if isinstance(header, bytes) else pack(header)
    if frame_lengths is None:
        assert isinstance(header, dict)
        frame_lengths = [TensorDesc(d["name"], d["dtype"], tuple(d["shape"])).nbytes for d in header["inputs"]]
    with pytest.raises(ProtocolError) as info:
        decode_infer(data, frame_lengths, max_frame_bytes)
    return info.value


def _wm_reject(header: list[Any]) -> ProtocolError:
    """The ProtocolError worker_messages.decode raises for the header array `header`."""
    with pytest.raises(ProtocolError) as info:
        wm.decode(pack(header))
    return info.value


#: One valid message of each type, the base the rejection tests change field by field.
READY: Final = wm.Ready(
    worker_id="w",
    pid=10,
    load_ms=1.0,
    warmup_ms=2.0,
    threads=1,
    cpus=[0],
    profile="eager",
    profile_notes=[],
    build_notes=[],
)
REQUEST: Final = wm.Request(request_id=1, deadline=5.0, accepted_at=4.0, queue_ms=0.5)
REPLY: Final = wm.Reply(request_id=1, error_code=None, message="")
STATS: Final = wm.Stats(requests=1, threads=1, interop_threads=1, cpus=[0], rss=2)


def _header_with(message: wm.WorkerMessage, /, **changes: object) -> list[Any]:
    """The header array of `message` with fields replaced by name (positions come from the dataclass)."""
    header: list[Any] = unpack(wm.encode(message)[0])
    names = [f.name for f in dataclasses.fields(message)]
    for name, value in changes.items():
        header[1 + names.index(name)] = value
    return header


def _deep(depth: int) -> bytes:
    """msgpack bytes of `depth` nested one-element arrays around nil."""
    return b"\x91" * depth + b"\xc0"


def _map(*pairs: tuple[str, bytes]) -> bytes:
    """msgpack bytes of a small map whose values are given already packed."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(pack(key) + value for key, value in pairs)


def _valid_id(value: object) -> bool:
    """What the spec allows as a request id: a uint64, or 1..64 bytes (a str counts its UTF-8 bytes)."""
    if type(value) is int:
        return 0 <= value < 2**64
    if type(value) is str:
        value = value.encode()
    return type(value) is bytes and 0 < len(value) <= MAX_REQUEST_ID_LEN


def _valid_descs(descs: object, min_dim: int = 1) -> bool:
    """Whether `descs` is a tuple of well-formed, uniquely named tensor descriptors (outputs allow 0 dims)."""
    if not isinstance(descs, tuple) or len(descs) > MAX_TENSORS:
        return False
    names = [d.name for d in descs if isinstance(d, TensorDesc)]
    if len(names) != len(descs) or len(set(names)) != len(names):
        return False
    return all(
        type(d.name) is str
        and 0 < len(d.name) <= MAX_NAME_LEN
        and d.dtype in DTYPE_ITEMSIZE
        and type(d.shape) is tuple
        and len(d.shape) <= MAX_RANK
        and all(type(n) is int and min_dim <= n < 2**31 for n in d.shape)
        for d in descs
    )


def _conforms(value: object, hint: object, name: str) -> bool:
    """Whether a decoded worker-message field has exactly its annotated type."""
    if isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint):
        (inner,) = [h for h in typing.get_args(hint) if h is not type(None)]
        return value is None or _conforms(value, inner, name)
    if hint is float:
        return type(value) is float
    if hint in (int, str):
        return type(value) is hint
    if hint in (list[int], list[str]):
        (item,) = typing.get_args(hint)
        return type(value) is list and all(type(v) is item for v in value)
    if hint == tuple[TensorDesc, ...]:
        return _valid_descs(value, min_dim=0 if name == "outputs" else 1)
    raise AssertionError(f"no check for annotation {hint}")


def _check_infer(request: InferRequest, frame_lengths: list[int]) -> None:
    """Assert a decoded infer request is valid and survives another encode/decode unchanged."""
    assert _valid_id(request.request_id)
    assert type(request.model) is str and 0 < len(request.model) <= MAX_NAME_LEN
    assert request.deadline_ms is None or (
        type(request.deadline_ms) is int and 0 < request.deadline_ms <= MAX_DEADLINE_MS
    )
    assert _valid_descs(request.inputs)
    assert [d.nbytes for d in request.inputs] == frame_lengths
    assert decode_infer(encode_infer(request), frame_lengths, DEFAULT_MAX_FRAME_BYTES) == request


WORKER_CLASSES: Final = (wm.Ready, wm.Heartbeat, wm.Request, wm.Reply, wm.Stats, wm.Drain, wm.Stop)


def _check_worker_message(message: object, type_code: object) -> None:
    """Assert a decoded worker message has the sent type, well-typed fields and a stable re-encoding."""
    assert isinstance(message, WORKER_CLASSES)
    assert message.TYPE == type_code
    hints = typing.get_type_hints(type(message))
    for f in dataclasses.fields(message):
        assert _conforms(getattr(message, f.name), hints[f.name], f.name), f.name
    header = wm.encode(message)[0]
    assert wm.encode(wm.decode(header))[0] == header


def _check_reply(reply: InferResult | ProtocolError, frame_lengths: list[int]) -> None:
    """Assert a decoded reply is a well-formed result or a well-formed carried error."""
    if isinstance(reply, ProtocolError):
        assert isinstance(reply.code, ErrorCode)
        assert type(reply.message) is str
        assert reply.request_id is None or _valid_id(reply.request_id)
        return
    assert isinstance(reply, InferResult)
    assert _valid_id(reply.request_id)
    assert type(reply.model) is str
    assert _valid_descs(reply.outputs, min_dim=0)
    assert [d.nbytes for d in reply.outputs] == frame_lengths
    assert all(type(k) is str and type(v) is float for k, v in reply.timing.items())


def _only_protocol_errors(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """Call `func`; a ProtocolError with a real ErrorCode gives None, any other exception fails the test."""
    try:
        return func(*args, **kwargs)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert type(exc.message) is str
        return None


# ---------------------------------------------------------------------------------------------------------------
# strategies

#: Explicit alphabet: ASCII, controls and 2/3/4-byte UTF-8; also spares hypothesis its slow unicode tables.
ALPHABET: Final = "abxyz019_.-/ \x00\n\x7f\u00e9\u00ff\u0100\u4e2d\U0001f600"


def texts(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[str]:
    """Strings over ALPHABET."""
    return st.text(ALPHABET, min_size=min_size, max_size=max_size)


msgpack_scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    texts(),
    st.binary(max_size=12),
    st.sampled_from(["infer", "result", "error", "float32", "x", "m", "BAD_REQUEST", "", 0, 1, 2**31, -1]),
)
msgpack_values: st.SearchStrategy[Any] = st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts(max_size=8), children, max_size=4),
    max_leaves=12,
)
header_keys: st.SearchStrategy[str] = st.sampled_from(
    [
        "v",
        "type",
        "id",
        "model",
        "inputs",
        "outputs",
        "deadline_ms",
        "code",
        "message",
        "timing",
        "name",
        "dtype",
        "shape",
    ]
) | texts(max_size=6)
request_ids: st.SearchStrategy[int | str | bytes] = st.one_of(
    st.integers(0, 2**64 - 1),
    texts(min_size=1, max_size=MAX_REQUEST_ID_LEN // 4),
    st.text("id", min_size=MAX_REQUEST_ID_LEN - 2, max_size=MAX_REQUEST_ID_LEN),
    st.binary(min_size=1, max_size=MAX_REQUEST_ID_LEN),
)
model_names: st.SearchStrategy[str] = texts(min_size=1, max_size=16) | st.just("m" * MAX_NAME_LEN)
finite_floats: st.SearchStrategy[float] = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def tensor_descs(draw: st.DrawFn, max_tensors: int = 4) -> tuple[TensorDesc, ...]:
    """Valid descriptors with unique names and small shapes."""
    names = draw(st.lists(texts(min_size=1, max_size=12), max_size=max_tensors, unique=True))
    return tuple(
        TensorDesc(name, draw(st.sampled_from(DTYPES)), tuple(draw(st.lists(st.integers(1, 4), max_size=MAX_RANK))))
        for name in names
    )


@st.composite
def infer_requests(draw: st.DrawFn) -> InferRequest:
    """Valid infer requests."""
    deadline = draw(st.none() | st.integers(1, 2**31 - 1))
    return InferRequest(draw(request_ids), draw(model_names), draw(tensor_descs()), deadline)


worker_messages: st.SearchStrategy[wm.WorkerMessage] = st.one_of(
    st.builds(
        wm.Ready,
        worker_id=texts(max_size=16),
        pid=st.integers(1, 2**22),
        load_ms=finite_floats,
        warmup_ms=finite_floats,
        threads=st.integers(1, 256),
        cpus=st.lists(st.integers(0, 1023), max_size=8),
    ),
    st.just(wm.Heartbeat()),
    st.builds(
        wm.Request,
        request_id=st.integers(0, 2**64 - 1),
        deadline=st.none() | finite_floats,
        accepted_at=finite_floats,
        queue_ms=finite_floats,
    ),
    st.builds(
        wm.Reply,
        request_id=st.integers(0, 2**64 - 1),
        error_code=st.none() | st.sampled_from([c.value for c in ErrorCode]),
        message=texts(max_size=32),
    ),
    st.builds(
        wm.Stats,
        requests=st.integers(0, 2**63 - 1),
        threads=st.integers(1, 256),
        interop_threads=st.integers(1, 256),
        cpus=st.lists(st.integers(0, 1023), max_size=8),
        rss=st.integers(0, 2**63 - 1),
    ),
    st.just(wm.Drain()),
    st.just(wm.Stop()),
)


def _containers(obj: Any) -> list[Any]:
    """Every list and dict inside `obj`, itself included, outermost first."""
    found: list[Any] = []
    if isinstance(obj, (list, dict)):
        found.append(obj)
        for child in obj.values() if isinstance(obj, dict) else obj:
            found.extend(_containers(child))
    return found


@st.composite
def mutation_steps(draw: st.DrawFn, header: Any) -> list[bytes]:
    """Packed snapshots of `header` after each of 1..6 random deletions, replacements or insertions inside it."""
    snapshots: list[bytes] = []
    for _ in range(draw(st.integers(1, 6))):
        target = draw(st.sampled_from(_containers(header)))
        delete = draw(st.booleans())
        if isinstance(target, dict):
            key = draw(st.sampled_from(sorted(target)) | header_keys) if target else draw(header_keys)
            if delete:
                target.pop(key, None)
            else:
                target[key] = draw(msgpack_values)
        else:
            index = draw(st.integers(0, len(target)))
            if index == len(target):
                target.append(draw(msgpack_values))
            elif delete:
                del target[index]
            else:
                target[index] = draw(msgpack_values)
        snapshots.append(pack(header))
    return snapshots


@st.composite
def frame_lengths_for(draw: st.DrawFn, descs: tuple[TensorDesc, ...]) -> list[int]:
    """The right frame lengths for `descs`, or now and then arbitrary ones."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.lists(st.integers(0, 2**40), max_size=5))
    return [d.nbytes for d in descs]


@st.composite
def mutated_infer_headers(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """Mutation steps of a valid infer header, with frame lengths for its original descriptors."""
    request = draw(infer_requests())
    return draw(mutation_steps(unpack(encode_infer(request)))), draw(frame_lengths_for(request.inputs))


@st.composite
def mutated_worker_headers(draw: st.DrawFn) -> list[bytes]:
    """Mutation steps of a valid worker message header."""
    return draw(mutation_steps(unpack(wm.encode(draw(worker_messages))[0])))


@st.composite
def mutated_reply_headers(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """Mutation steps of a valid result or error header, with frame lengths for its original outputs."""
    if draw(st.booleans()):
        outputs = draw(tensor_descs())
        timing = draw(st.dictionaries(texts(max_size=8), finite_floats, max_size=4))
        data = encode_result(draw(request_ids), draw(model_names), outputs, timing)
    else:
        outputs = ()
        data = encode_error(draw(st.none() | request_ids), draw(st.sampled_from(list(ErrorCode))), draw(texts()))
    return draw(mutation_steps(unpack(data))), draw(frame_lengths_for(outputs))


@st.composite
def byte_flips(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """Variants of `data`: each of 1..16 byte flips alone, the flips piling up, then truncated and extended."""
    flips = st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), min_size=1, max_size=16)
    variants: list[bytes] = []
    piled = bytearray(data)
    for position, value in draw(flips):
        single = bytearray(data)
        single[position] = piled[position] = value
        variants += [bytes(single), bytes(piled)]
    variants.append(bytes(piled[: draw(st.integers(0, len(piled)))]))
    variants.append(bytes(piled) + draw(st.binary(min_size=1, max_size=8)))
    return variants


@st.composite
def flipped_infer_headers(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """Byte-flipped variants of a valid encoded infer request, and its frame lengths."""
    request = draw(infer_requests())
    return draw(byte_flips(encode_infer(request))), [d.nbytes for d in request.inputs]


@st.composite
def flipped_worker_headers(draw: st.DrawFn) -> list[bytes]:
    """Byte-flipped variants of a valid encoded worker message."""
    return draw(byte_flips(wm.encode(draw(worker_messages))[0]))


# ---------------------------------------------------------------------------------------------------------------
# packaging


def test_protocol_package_does_not_import_torch() -> None:
    """Importing every protocol module (and the Client) leaves torch out of sys.modules."""
    code = (
        "import sys\n"
        "from infervisor import protocol\n"
        "import infervisor.protocol.codec, infervisor.protocol.tensors, infervisor.protocol.client_messages\n"
        "import infervisor.protocol.worker_messages, infervisor.protocol.arrays, infervisor.protocol.launch\n"
        "import infervisor.protocol.errors, infervisor.protocol.client\n"
        "protocol.Client\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize(
    "request_id", [0, 1, 2**64 - 1, "req-1", "é" * (MAX_REQUEST_ID_LEN // 2), b"\x00\xff", b"i" * 64]
)
@pytest.mark.parametrize("deadline_ms", [None, 1, MAX_DEADLINE_MS])
def test_infer_request_round_trips(request_id: int | str | bytes, deadline_ms: int | None) -> None:
    """encode_infer then decode_infer gives back the same request for every id kind, with and without deadline."""
    inputs = (TensorDesc("x", "float32", (2, 16)), TensorDesc("mask", "bool", ()), TensorDesc("ids", "int64", (1,) * 8))
    request = InferRequest(request_id, "model.v1", inputs, deadline_ms)
    decoded = decode_infer(encode_infer(request), [d.nbytes for d in inputs], DEFAULT_MAX_FRAME_BYTES)
    assert decoded == request
    assert type(decoded.request_id) is type(request_id)


def test_infer_request_without_deadline_omits_the_key() -> None:
    """A request without deadline sends no deadline_ms key rather than nil."""
    header = unpack(encode_infer(InferRequest(1, "m", ())))
    assert header == {"v": PROTOCOL_VERSION, "type": "infer", "id": 1, "model": "m", "inputs": []}


def test_decode_infer_accepts_a_memoryview() -> None:
    """The broker hands zmq frame buffers (memoryviews), which decode like bytes."""
    request = InferRequest("a", "m", (TensorDesc("x", "uint8", (3,)),), 100)
    assert decode_infer(memoryview(encode_infer(request)), [3], 1024) == request


@pytest.mark.parametrize("request_id", [5, "r", b"\x01"])
def test_result_round_trips(request_id: int | str | bytes) -> None:
    """encode_result then decode_reply gives an equal InferResult."""
    outputs = (TensorDesc("y", "float32", (1, 1000)), TensorDesc("idx", "int64", (1,)))
    timing = {"queue_ms": 0.5, "model_ms": 12.0}
    reply = decode_reply(encode_result(request_id, "resnet50", outputs, timing), [4000, 8])
    assert reply == InferResult(request_id, "resnet50", outputs, timing)


@settings(max_examples=200)
@given(request_ids, model_names, tensor_descs(), st.lists(finite_floats, min_size=7, max_size=7))
def test_a_result_header_carries_every_timing_value_as_a_float64(
    request_id: int | str | bytes, model: str, outputs: tuple[TensorDesc, ...], values: list[float]
) -> None:
    """Each timing key is followed by msgpack's float64 (0xcb), even for a whole number (docs/protocol.md, 3)."""
    timing = dict(zip(TIMING_KEYS, [float(round(v)) if i % 2 else v for i, v in enumerate(values)], strict=True))
    header = encode_result(request_id, model, outputs, timing)
    for key, value in timing.items():
        assert pack(key) + b"\xcb" + struct.pack(">d", value) in header
    assert decode_reply(header, [d.nbytes for d in outputs]) == InferResult(request_id, model, outputs, timing)


def test_result_may_carry_an_empty_output() -> None:
    """Outputs, unlike inputs, may have a 0 dim (an empty tensor of zero bytes)."""
    outputs = (TensorDesc("boxes", "float32", (0, 4)),)
    assert decode_reply(encode_result(1, "m", outputs, {}), [0]) == InferResult(1, "m", outputs, {})


def test_result_timing_keeps_only_numbers() -> None:
    """Non-numeric timing values are dropped and integers become floats."""
    header = unpack(encode_result(1, "m", (), {}))
    header["timing"] = {"a": 1, "b": "x", "c": 2.5, "d": None, "e": True}
    reply = decode_reply(pack(header), [])
    assert isinstance(reply, InferResult)
    assert reply.timing == {"a": 1.0, "c": 2.5, "e": 1.0}


@pytest.mark.parametrize("request_id", [9, "r", b"\x02", None])
@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_round_trips(request_id: int | str | bytes | None, code: ErrorCode) -> None:
    """encode_error then decode_reply returns (not raises) a ProtocolError with the same code, message and id."""
    reply = decode_reply(encode_error(request_id, code, "it broke"), [])
    assert isinstance(reply, ProtocolError)
    assert (reply.code, reply.message, reply.request_id) == (code, "it broke", request_id)


def test_error_with_unknown_code_becomes_internal() -> None:
    """An error reply with a code this client does not know decodes as INTERNAL, keeping the message."""
    header = unpack(encode_error(1, ErrorCode.OVERLOADED, "later"))
    header["code"] = "SOMETHING_NEW"
    reply = decode_reply(pack(header), [])
    assert isinstance(reply, ProtocolError)
    assert (reply.code, reply.message) == (ErrorCode.INTERNAL, "later")


WORKER_MESSAGES: Final[list[wm.WorkerMessage]] = [
    wm.Ready(
        "m-0",
        1234,
        812.5,
        40.25,
        4,
        [0, 1, 2, 3],
        "jit",
        ["jit_onednn: crashed; see the log"],
        ["compiled and cached package"],
    ),
    wm.Heartbeat(),
    wm.Request(request_id=2**64 - 1, deadline=12345.678, accepted_at=12345.0, queue_ms=0.25),
    wm.Request(request_id=0, deadline=None, accepted_at=0.0, queue_ms=0.0),
    wm.Reply(3, None, ""),
    wm.Reply(4, ErrorCode.INVALID_INPUT.value, "input 'x' has NaN"),
    wm.Stats(100, 4, 1, [4, 5, 6, 7], 512 * 1024 * 1024),
    wm.Drain(),
    wm.Stop(),
    wm.LoadError("FileNotFoundError: weights.bin not found; declare a path that exists"),
]


@pytest.mark.parametrize("message", WORKER_MESSAGES, ids=lambda m: type(m).__name__)
def test_worker_message_round_trips(message: wm.WorkerMessage) -> None:
    """Every worker message type decodes to an equal dataclass, with its tensor frames passed through."""
    frames = wm.encode(message, [b"frame"])
    assert frames[1:] == [b"frame"]
    assert wm.decode(frames[0]) == message
    assert unpack(frames[0])[0] == int(message.TYPE)


def test_worker_message_float_fields_accept_integers() -> None:
    """A float field sent as a msgpack integer (as other encoders do for 5.0) decodes as a float."""
    message = wm.decode(pack(_header_with(READY, load_ms=5, warmup_ms=0)))
    assert isinstance(message, wm.Ready)
    assert (message.load_ms, message.warmup_ms) == (5.0, 0.0)
    assert type(message.load_ms) is float and type(message.warmup_ms) is float


@pytest.mark.parametrize(
    "spec",
    [
        LaunchSpec(
            worker_id="resnet50-0",
            model="resnet50",
            link_fd=3,
            source=ModelSource("builtin", name="resnet50"),
            inputs=(TensorSpec("image", "float32", (None, 3, 224, 224)),),
            output_names=None,
            cpus=(0, 1),
            threads=2,
        ),
        LaunchSpec(
            worker_id="enc-3",
            model="enc",
            link_fd=17,
            source=ModelSource("torchscript", path="/srv/models/enc.pt"),
            inputs=(TensorSpec("ids", "int64", (None, 128)), TensorSpec("x", "float16", (4,), allow_non_finite=True)),
            output_names=("logits", "hidden"),
            cpus=(5,),
            threads=1,
            warmup_iterations=1,
            heartbeat_interval_ms=100,
            heartbeat_liveness=3,
            stats_interval_ms=50,
            max_frame_bytes=1024,
            extra={"note": "x", "n": [1, 2], "nested": {"a": None}},
        ),
        LaunchSpec("e", "e", 3, ModelSource("exported", path="/e.pt2"), (), (), (), 1),
    ],
    ids=["builtin", "torchscript-everything-set", "exported-empty"],
)
def test_launch_spec_round_trips(spec: LaunchSpec) -> None:
    """LaunchSpec.from_json(spec.to_json()) equals the original, tuples and None dims included."""
    assert LaunchSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_frame_from_frame_round_trips_every_dtype(dtype: str) -> None:
    """Every whitelisted dtype converts to a descriptor and frame and back, values and shape intact."""
    array = (
        (np.arange(24) % 2).astype(dtype).reshape(2, 3, 4)
        if dtype == "bool"
        else np.arange(24, dtype=dtype).reshape(2, 3, 4)
    )
    desc, frame = to_frame("t", array)
    assert desc == TensorDesc("t", dtype, (2, 3, 4))
    assert frame.flags.c_contiguous and frame.nbytes == desc.nbytes
    assert np.shares_memory(frame, array)  # already contiguous little-endian: no copy
    back = from_frame(desc, frame.tobytes())
    assert back.dtype == np.dtype(dtype) and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, array)
    assert not back.flags.writeable


@pytest.mark.parametrize("dtype", MULTIBYTE_DTYPES)
def test_to_frame_converts_big_endian_to_little_endian(dtype: str) -> None:
    """A big-endian array is sent as little-endian bytes under the plain dtype name."""
    native = np.arange(12, dtype=dtype).reshape(3, 4)
    big = native.astype(np.dtype(dtype).newbyteorder(">"))
    desc, frame = to_frame("b", big)
    assert desc == TensorDesc("b", dtype, (3, 4))
    assert frame.dtype == np.dtype(dtype).newbyteorder("<")
    assert frame.tobytes() == native.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    np.testing.assert_array_equal(from_frame(desc, frame.tobytes()), native)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", ["strided", "transposed", "fortran", "big-endian-strided"])
def test_to_frame_makes_non_contiguous_arrays_contiguous(dtype: str, view: str) -> None:
    """Strided, transposed and Fortran-ordered arrays become C-contiguous frames with the view's shape and values."""
    base = np.arange(4 * 6 * 2).reshape(4, 6, 2).astype(dtype)
    if view == "strided":
        array = base[::2, 1::2]
    elif view == "transposed":
        array = base.transpose(2, 0, 1)
    elif view == "fortran":
        array = np.asfortranarray(base)
    else:
        array = base.astype(base.dtype.newbyteorder(">"))[:, ::3]
    assert not array.flags.c_contiguous
    desc, frame = to_frame("v", array)
    assert desc.shape == array.shape and desc.dtype == dtype
    assert frame.flags.c_contiguous and len(frame.tobytes()) == desc.nbytes
    np.testing.assert_array_equal(from_frame(desc, frame.tobytes()), array)


@pytest.mark.parametrize("dtype", ["complex64", "float128", "object", "U3", "datetime64[s]", "uint16", "uint64"])
def test_to_frame_rejects_dtypes_off_the_whitelist(dtype: str) -> None:
    """An array of a dtype the wire does not carry is INVALID_INPUT before anything is sent."""
    try:
        array = np.zeros(2, dtype=dtype)
    except TypeError:
        pytest.skip(f"numpy here has no {dtype}")
    with pytest.raises(ProtocolError) as info:
        to_frame("z", array)
    assert info.value.code is ErrorCode.INVALID_INPUT
    assert "'z'" in info.value.message


def test_to_frame_of_a_scalar_has_rank_zero() -> None:
    """A 0-d array is a rank-0 tensor of one element."""
    desc, frame = to_frame("s", np.array(3.5, dtype="float64"))
    assert desc == TensorDesc("s", "float64", ())
    assert desc.nbytes == 8 and from_frame(desc, frame.tobytes()).item() == 3.5


# ---------------------------------------------------------------------------------------------------------------
# infer request rejections


def test_a_minimal_valid_header_is_accepted() -> None:
    """The baseline header the rejection tests mutate is itself valid."""
    assert decode_infer(pack(_infer_header()), [128], DEFAULT_MAX_FRAME_BYTES) == InferRequest(
        7, "m", (TensorDesc("x", "float32", (2, 16)),)
    )


@pytest.mark.parametrize("version", [0, 2, -1, "1", b"1", None, DELETE, [1], {"v": 1}], ids=repr)
def test_wrong_version_is_unsupported_version_and_keeps_the_id(version: object) -> None:
    """Any version but the integer 1 answers UNSUPPORTED_VERSION, carrying the readable request id."""
    error = _reject(_infer_header(v=version, id="abc"))
    assert error.code is ErrorCode.UNSUPPORTED_VERSION
    assert error.request_id == "abc"
    assert str(PROTOCOL_VERSION) in error.message


@pytest.mark.parametrize("version", [True, 1.0], ids=repr)
def test_infer_version_must_be_the_integer_one_not_true_or_float(version: object) -> None:
    """A version of true or 1.0 is not the integer 1 (though Python says they are equal): UNSUPPORTED_VERSION."""
    assert _reject(_infer_header(v=version)).code is ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("version", [True, 1.0], ids=repr)
def test_reply_version_must_be_the_integer_one_not_true_or_float(version: object) -> None:
    """A reply whose version is true or 1.0 is not version 1 and raises INTERNAL."""
    with pytest.raises(ProtocolError) as info:
        decode_reply(pack({**unpack(encode_result(1, "m", (), {})), "v": version}), [])
    assert info.value.code is ErrorCode.INTERNAL


def test_wrong_version_with_unreadable_id_has_no_id() -> None:
    """With both the version and the id bad, the error still says UNSUPPORTED_VERSION, with a nil id."""
    error = _reject(_infer_header(v=2, id=True))
    assert (error.code, error.request_id) == (ErrorCode.UNSUPPORTED_VERSION, None)


def test_wrong_version_is_checked_before_the_rest_of_the_header() -> None:
    """A v2 header is UNSUPPORTED_VERSION even when its other fields would not parse under v1."""
    error = _reject(pack({"v": 2, "id": 3, "inputs": "whatever", "type": 5}), [])
    assert (error.code, error.request_id) == (ErrorCode.UNSUPPORTED_VERSION, 3)


@pytest.mark.parametrize("header", [[1, 2], "infer", None, 1, b"\x80", [{"v": 1}]])
def test_non_map_header_is_bad_request(header: object) -> None:
    """A header that is valid msgpack but not a map is BAD_REQUEST without an id."""
    error = _reject(pack(header), [])
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, None)


@pytest.mark.parametrize("kind", ["result", "error", "INFER", None, 1, DELETE])
def test_wrong_message_type_is_bad_request(kind: object) -> None:
    """A client header whose type is not 'infer' is BAD_REQUEST, with the id."""
    error = _reject(_infer_header(type=kind))
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, 7)


@pytest.mark.parametrize(
    "request_id",
    [
        True,
        False,
        -1,
        -(2**63),
        1.0,
        1.5,
        [1],
        {"a": 1},
        None,
        DELETE,
        "",
        b"",
        "a" * 65,
        b"a" * 65,
        "é" * 33,
        "\U0001f600" * 17,
    ],
    ids=repr,
)
def test_bad_request_id_is_bad_request_without_id(request_id: object) -> None:
    """Bool, negative, float, container, nil, empty or over-64-byte ids (UTF-8 for str) are BAD_REQUEST, nil id."""
    error = _reject(_infer_header(id=request_id))
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, None)
    assert "id" in error.message


@pytest.mark.parametrize("model", ["", "m" * (MAX_NAME_LEN + 1), 5, None, DELETE, b"m", ["m"]], ids=repr)
def test_bad_model_is_bad_request_with_id(model: object) -> None:
    """A model that is not a 1..128 character string is BAD_REQUEST, carrying the id."""
    error = _reject(_infer_header(model=model))
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, 7)
    assert "model" in error.message


def test_model_of_exactly_max_name_len_is_accepted() -> None:
    """A 128-character model name is within the limit."""
    assert decode_infer(pack(_infer_header(model="m" * MAX_NAME_LEN)), [128], 1024).model == "m" * MAX_NAME_LEN


@pytest.mark.parametrize("deadline", [0, -1, -(2**40), True, False, 1.0, 2.5, 2**31, "100", [100]], ids=repr)
def test_bad_deadline_is_bad_request(deadline: object) -> None:
    """deadline_ms of 0, negative, bool, float, too large or non-number is BAD_REQUEST with the id."""
    error = _reject(_infer_header(deadline_ms=deadline))
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, 7)
    assert "deadline_ms" in error.message


def test_nil_deadline_means_no_deadline() -> None:
    """An explicit nil deadline_ms is the same as none."""
    assert decode_infer(pack(_infer_header(deadline_ms=None)), [128], 1024).deadline_ms is None


@pytest.mark.parametrize("inputs", [None, DELETE, {"x": 1}, "x", 3], ids=repr)
def test_inputs_not_an_array_is_bad_request(inputs: object) -> None:
    """A missing or non-array inputs field is BAD_REQUEST."""
    error = _reject(_infer_header(inputs=inputs), [])
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, 7)


@pytest.mark.parametrize("item", [1, "x", None, ["x", "float32", [1]]], ids=repr)
def test_input_that_is_not_a_map_is_bad_request(item: object) -> None:
    """Each inputs element must be a map."""
    assert _reject(_infer_header(inputs=[item]), [4]).code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("name", ["", "n" * (MAX_NAME_LEN + 1), 1, None, b"x"], ids=repr)
def test_bad_input_name_is_bad_request(name: object) -> None:
    """An input name that is not a 1..128 character string is BAD_REQUEST."""
    error = _reject(_inputs({"name": name, "dtype": "uint8", "shape": [1]}), [1])
    assert error.code is ErrorCode.BAD_REQUEST
    assert "inputs[0].name" in error.message


def test_duplicate_input_names_are_bad_request() -> None:
    """Two inputs with the same name are BAD_REQUEST naming the duplicate."""
    error = _reject(
        _inputs({"name": "x", "dtype": "uint8", "shape": [1]}, {"name": "x", "dtype": "int8", "shape": [2]})
    )
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, 7)
    assert "'x'" in error.message and "twice" in error.message


def test_too_many_tensors_is_bad_request() -> None:
    """MAX_TENSORS inputs are fine; one more is BAD_REQUEST."""
    descs = [{"name": f"t{i}", "dtype": "uint8", "shape": [1]} for i in range(MAX_TENSORS + 1)]
    assert len(decode_infer(pack(_inputs(*descs[:-1])), [1] * MAX_TENSORS, 1024).inputs) == MAX_TENSORS
    error = _reject(_inputs(*descs))
    assert error.code is ErrorCode.BAD_REQUEST
    assert str(MAX_TENSORS) in error.message


def test_rank_above_max_rank_is_bad_request() -> None:
    """A shape of MAX_RANK dims is fine; MAX_RANK + 1 dims is BAD_REQUEST."""
    ok = {"name": "x", "dtype": "uint8", "shape": [1] * MAX_RANK}
    assert decode_infer(pack(_inputs(ok)), [1], 1024).inputs[0].shape == (1,) * MAX_RANK
    error = _reject(_inputs({**ok, "shape": [1] * (MAX_RANK + 1)}), [1])
    assert error.code is ErrorCode.BAD_REQUEST
    assert "shape" in error.message


def test_rank_zero_is_a_scalar_of_one_element() -> None:
    """An empty shape is a scalar whose frame is one item long."""
    request = decode_infer(pack(_inputs({"name": "s", "dtype": "int64", "shape": []})), [8], 1024)
    assert request.inputs == (TensorDesc("s", "int64", ()),)


@pytest.mark.parametrize("shape", [None, DELETE, "2,16", {"0": 2}, 16], ids=repr)
def test_shape_that_is_not_an_array_is_bad_request(shape: object) -> None:
    """A missing or non-array shape is BAD_REQUEST."""
    desc: dict[str, Any] = {"name": "x", "dtype": "float32"}
    if shape is not DELETE:
        desc["shape"] = shape
    assert _reject(_inputs(desc), [4]).code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("dim", [0, -1, -(2**63), True, False, 1.0, "2", None, [2], 2**31, 2**64 - 1], ids=repr)
def test_bad_dims_are_invalid_input(dim: object) -> None:
    """Dims that are zero, negative, bool, non-integer or 2**31 and above are INVALID_INPUT naming the tensor."""
    error = _reject(_inputs({"name": "x", "dtype": "float32", "shape": [2, dim]}), [8])
    assert (error.code, error.request_id) == (ErrorCode.INVALID_INPUT, 7)
    assert "'x'" in error.message and "dims must be integers >= 1" in error.message


def test_largest_dim_is_accepted_when_the_frame_limit_allows() -> None:
    """A dim of 2**31 - 1 parses; the frame check then refuses it by size."""
    header = _inputs({"name": "x", "dtype": "uint8", "shape": [2**31 - 1]})
    assert decode_infer(pack(header), [2**31 - 1], 2**31).inputs[0].shape == (2**31 - 1,)
    assert _reject(header, [2**31 - 1], 1024).code is ErrorCode.INVALID_INPUT


@pytest.mark.parametrize(
    "dtype", ["complex64", "float", "f4", "<f4", "Float32", "", 5, None, DELETE, ["float32"]], ids=repr
)
def test_unknown_dtype_is_invalid_input(dtype: object) -> None:
    """A dtype off the whitelist (or missing, or not a string) is INVALID_INPUT listing the allowed ones."""
    desc: dict[str, Any] = {"name": "x", "shape": [1]}
    if dtype is not DELETE:
        desc["dtype"] = dtype
    error = _reject(_inputs(desc), [4])
    assert (error.code, error.request_id) == (ErrorCode.INVALID_INPUT, 7)
    assert "float32" in error.message


@pytest.mark.parametrize("frame_lengths", [[], [128, 128], [128, 0, 0]])
def test_frame_count_mismatch_is_bad_request(frame_lengths: list[int]) -> None:
    """A different number of frames than descriptors is BAD_REQUEST with the id."""
    error = _reject(_infer_header(), frame_lengths)
    assert (error.code, error.request_id) == (ErrorCode.BAD_REQUEST, 7)
    assert "1 tensors" in error.message and f"{len(frame_lengths)} frames" in error.message


@pytest.mark.parametrize("length", [0, 127, 129, 256])
def test_frame_length_mismatch_is_invalid_input(length: int) -> None:
    """A frame whose length is not shape x itemsize is INVALID_INPUT saying what it needs."""
    error = _reject(_infer_header(), [length])
    assert (error.code, error.request_id) == (ErrorCode.INVALID_INPUT, 7)
    assert f"{length} bytes" in error.message and "needs 128" in error.message


def test_frame_above_max_frame_bytes_is_invalid_input() -> None:
    """A tensor larger than max_frame_bytes is INVALID_INPUT even when its frame length matches."""
    assert decode_infer(pack(_infer_header()), [128], 128).inputs[0].nbytes == 128
    error = _reject(_infer_header(), [128], max_frame_bytes=127)
    assert (error.code, error.request_id) == (ErrorCode.INVALID_INPUT, 7)
    assert "limit 127" in error.message


def test_oversized_descriptor_is_refused_before_its_length_is_compared() -> None:
    """A huge declared shape with a tiny frame is refused for its size, never for the length."""
    error = _reject(_inputs({"name": "x", "dtype": "float64", "shape": [2**31 - 1] * MAX_RANK}), [8])
    assert error.code is ErrorCode.INVALID_INPUT
    assert "limit" in error.message


# ---------------------------------------------------------------------------------------------------------------
# codec limits


def test_header_above_max_header_bytes_is_bad_request() -> None:
    """A header of MAX_HEADER_BYTES decodes; one byte more is BAD_REQUEST before any parsing."""
    exact = pack("a" * (MAX_HEADER_BYTES - 3))  # str16: 3 bytes of prefix
    assert len(exact) == MAX_HEADER_BYTES
    assert unpack(exact) == "a" * (MAX_HEADER_BYTES - 3)
    big = pack(_infer_header(padding="a" * MAX_HEADER_BYTES))
    for decoder in (unpack, lambda d: decode_infer(d, [128], 1024), wm.decode, lambda d: decode_reply(d, [])):
        with pytest.raises(ProtocolError) as info:
            decoder(big)
        assert info.value.code is ErrorCode.BAD_REQUEST
        assert str(MAX_HEADER_BYTES) in info.value.message


@pytest.mark.parametrize(
    "data", [b"\x91" * 100_000, _deep(2000), _deep(1100), b"\x81\xa1a" * 2000 + b"\xc0"], ids=lambda d: f"{len(d)}B"
)
def test_deep_nesting_is_bad_request(data: bytes) -> None:
    """Deeply nested arrays or maps are refused as BAD_REQUEST by every decoder, without a RecursionError."""
    for decoder in (unpack, lambda d: decode_infer(d, [], 1024), wm.decode, lambda d: decode_reply(d, [])):
        with pytest.raises(ProtocolError) as info:
            decoder(data)
        assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "data",
    [
        b"\xd4\x01\x00",  # fixext1
        b"\xd6\xff\x00\x00\x00\x01",  # timestamp32
        msgpack.packb(msgpack.ExtType(5, b"abc")),
        b"\x81\xa1v" + msgpack.packb(msgpack.ExtType(1, b"\x01")),  # ext as a map value
        b"\x91\xd6\xff\x00\x00\x00\x00",  # timestamp inside an array
    ],
    ids=lambda d: d.hex(),
)
def test_ext_types_are_bad_request(data: bytes) -> None:
    """msgpack ext types (timestamps included) are refused by the codec as BAD_REQUEST."""
    with pytest.raises(ProtocolError) as info:
        unpack(data)
    assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "data",
    [b"\xc7\x00\x05", b"\xc8\x00\x00\x05", b"\xc9\x00\x00\x00\x00\x05", b"\x81\xa1v\xc7\x00\x05"],
    ids=lambda d: d.hex(),
)
def test_zero_length_ext_types_are_bad_request(data: bytes) -> None:
    """An ext type with an empty payload is refused like any other ext type."""
    with pytest.raises(ProtocolError) as info:
        unpack(data)
    assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "data",
    [
        b"\x81\x01\x02",  # int key
        b"\x81\xc0\x02",  # nil key
        b"\x81\xc3\x02",  # bool key
        b"\x81\xcb" + b"\x00" * 8 + b"\x02",  # float key
        b"\x81\x91\x01\x02",  # array key
        b"\x81\x80\x02",  # map key
        b"\x81\xa1v\x81\x01\x02",  # int key one level down
    ],
    ids=lambda d: d.hex(),
)
def test_non_string_map_keys_are_bad_request(data: bytes) -> None:
    """Maps keyed by anything but strings are BAD_REQUEST from the codec and from decode_infer."""
    for decoder in (unpack, lambda d: decode_infer(d, [], 1024)):
        with pytest.raises(ProtocolError) as info:
            decoder(data)
        assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        b"\x01\x02",
        b"\xa1\xff",
        b"\xdb\xff\xff\xff\xff",
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\x00\x01\x00\x00",
    ],
    ids=lambda d: d.hex() or "empty",
)
def test_malformed_msgpack_is_bad_request(data: bytes) -> None:
    """Empty, reserved, truncated, trailing-garbage, bad UTF-8 and over-long containers are BAD_REQUEST."""
    with pytest.raises(ProtocolError) as info:
        unpack(data)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert "not valid msgpack" in info.value.message


def test_pack_unpack_round_trip_plain_data() -> None:
    """The codec round-trips the plain data types headers use, keeping str and bytes apart."""
    value = {"s": "é", "b": b"\x00", "i": -5, "u": 2**64 - 1, "f": 1.5, "n": None, "t": True, "l": [1, [2]], "m": {}}
    assert unpack(pack(value)) == value


# ---------------------------------------------------------------------------------------------------------------
# deep values inside headers (bug: repr() of a nested value overflows the stack)


@pytest.mark.parametrize(
    "header",
    [
        _map(("v", _deep(DEEP))),
        _map(("v", pack(1)), ("type", _deep(DEEP))),
        _map(
            ("v", pack(1)),
            ("type", pack("infer")),
            ("id", pack(1)),
            ("model", pack("m")),
            ("inputs", b"\x91" + _map(("name", pack("x")), ("dtype", _deep(DEEP)), ("shape", pack([1])))),
        ),
    ],
    ids=["version", "type", "dtype"],
)
def test_deeply_nested_value_in_infer_header_is_a_protocol_error(header: bytes) -> None:
    """A deeply nested value where a scalar belongs is refused with a ProtocolError, not RecursionError."""
    with pytest.raises(ProtocolError):
        decode_infer(header, [4], 1024)


def test_deeply_nested_message_in_error_reply_is_a_protocol_error() -> None:
    """An error reply whose message is deeply nested decodes (or fails) as a ProtocolError, not RecursionError."""
    header = _map(("v", pack(1)), ("type", pack("error")), ("id", pack(1)), ("message", _deep(DEEP)))
    assert isinstance(_only_protocol_errors(decode_reply, header, []), (ProtocolError, type(None)))


def test_deeply_nested_field_in_worker_request_is_a_protocol_error() -> None:
    """A worker Request whose accepted_at is deeply nested is refused with a ProtocolError, not RecursionError."""
    fields = _header_with(REQUEST)
    at = [f.name for f in dataclasses.fields(REQUEST)].index("accepted_at") + 1
    packed = [pack(v) for v in fields]
    packed[at] = _deep(DEEP)
    with pytest.raises(ProtocolError):
        wm.decode(bytes([0x90 | len(fields)]) + b"".join(packed))


@pytest.mark.parametrize("key", ["v", "type", "dtype"])
def test_error_messages_are_bounded(key: str) -> None:
    """A rejection caused by a huge value has a message of at most MAX_MESSAGE_LEN characters."""
    huge = b"\xff" * 60_000
    header = _inputs({"name": "x", "dtype": huge, "shape": [1]}) if key == "dtype" else _infer_header(**{key: huge})
    assert len(pack(header)) <= MAX_HEADER_BYTES
    assert len(_reject(header, [4]).message) <= MAX_MESSAGE_LEN


# ---------------------------------------------------------------------------------------------------------------
# replies


@pytest.mark.parametrize(
    "header",
    [[1], "x", {"v": 2, "type": "result"}, {"type": "error", "code": "BAD_REQUEST"}, {"v": "1", "type": "result"}],
    ids=repr,
)
def test_reply_that_is_not_a_v1_map_is_internal(header: object) -> None:
    """A reply header that is not a version-1 map raises INTERNAL (the server broke the protocol)."""
    with pytest.raises(ProtocolError) as info:
        decode_reply(pack(header), [])
    assert info.value.code is ErrorCode.INTERNAL


@pytest.mark.parametrize(
    "changes", [{"type": "infer"}, {"type": None}, {"id": None}, {"id": True}, {"id": -1}], ids=repr
)
def test_result_with_bad_type_or_id_is_internal(changes: dict[str, object]) -> None:
    """A reply that is neither an error nor a result with a valid id raises INTERNAL."""
    header = {**unpack(encode_result(1, "m", (), {})), **changes}
    with pytest.raises(ProtocolError) as info:
        decode_reply(pack(header), [])
    assert info.value.code is ErrorCode.INTERNAL


def test_result_frames_are_checked_against_outputs() -> None:
    """A result whose frames do not match its outputs raises BAD_REQUEST / INVALID_INPUT like a request would."""
    header = encode_result(1, "m", (TensorDesc("y", "float32", (4,)),), {})
    with pytest.raises(ProtocolError) as count:
        decode_reply(header, [])
    assert count.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError) as length:
        decode_reply(header, [15])
    assert length.value.code is ErrorCode.INVALID_INPUT
    assert "'y'" in length.value.message


@pytest.mark.parametrize("code", [[], {}, ["BAD_REQUEST"], {"a": 1}, 5, None, b"BAD_REQUEST"], ids=repr)
def test_error_reply_with_unhashable_code_becomes_internal(code: object) -> None:
    """An error reply whose code is not a known code string (array, map, int, nil, bytes) decodes as INTERNAL."""
    header = {**unpack(encode_error(1, ErrorCode.BAD_REQUEST, "m")), "code": code}
    reply = decode_reply(pack(header), [])
    assert isinstance(reply, ProtocolError) and reply.code is ErrorCode.INTERNAL


# ---------------------------------------------------------------------------------------------------------------
# worker message rejections


@pytest.mark.parametrize("type_code", [0, max(WorkerMessageType) + 1, 99, -1, 2**64 - 1])
def test_unknown_worker_message_type_is_a_protocol_error(type_code: int) -> None:
    """A type number that names no worker message is refused naming the type."""
    error = _wm_reject([type_code])
    assert error.code is ErrorCode.BAD_REQUEST
    assert str(type_code) in error.message


@pytest.mark.parametrize("header", [[], ["1"], [True], [1.0], [None], {"type": 1}, 1, "ready", None], ids=repr)
def test_worker_message_not_an_array_with_integer_type_is_a_protocol_error(header: object) -> None:
    """A worker header must be a non-empty array whose first element is an integer (not a bool or float)."""
    with pytest.raises(ProtocolError) as info:
        wm.decode(pack(header))
    assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("message", "change"),
    [(m, "one-more") for m in WORKER_MESSAGES] + [(m, "one-less") for m in WORKER_MESSAGES if dataclasses.fields(m)],
    ids=lambda v: type(v).__name__ if dataclasses.is_dataclass(v) else str(v),
)
def test_wrong_field_count_is_a_protocol_error(message: wm.WorkerMessage, change: str) -> None:
    """One field too many or too few for the type is refused, saying how many are needed."""
    header: list[Any] = unpack(wm.encode(message)[0])
    if change == "one-more":
        header.append(0)
    else:
        header.pop()
    error = _wm_reject(header)
    assert error.code is ErrorCode.BAD_REQUEST
    assert f"{type(message).__name__} needs {len(dataclasses.fields(message))} fields" in error.message


@pytest.mark.parametrize(
    ("message", "field", "value"),
    [
        (READY, "worker_id", 5),
        (READY, "worker_id", None),
        (READY, "worker_id", b"w"),
        (READY, "pid", "12"),
        (READY, "pid", True),
        (READY, "pid", 1.5),
        (READY, "pid", 12.0),
        (READY, "pid", None),
        (READY, "load_ms", True),
        (READY, "load_ms", "1.0"),
        (READY, "load_ms", None),
        (READY, "threads", False),
        (READY, "cpus", "0-3"),
        (READY, "cpus", [True]),
        (READY, "cpus", ["0"]),
        (READY, "cpus", [0.0]),
        (READY, "cpus", {"0": 0}),
        (REQUEST, "request_id", "1"),
        (REQUEST, "request_id", True),
        (REQUEST, "request_id", 1.0),
        (REQUEST, "deadline", "5"),
        (REQUEST, "deadline", True),
        (REQUEST, "accepted_at", None),
        (REQUEST, "queue_ms", "0"),
        (REPLY, "request_id", -1.5),
        (REPLY, "error_code", 5),
        (REPLY, "message", None),
        (STATS, "requests", True),
        (STATS, "interop_threads", 2.5),
        (STATS, "cpus", [1.0]),
        (STATS, "rss", None),
    ],
    ids=lambda v: type(v).__name__ if dataclasses.is_dataclass(v) else repr(v),
)
def test_wrong_field_type_is_a_protocol_error(message: wm.WorkerMessage, field: str, value: object) -> None:
    """Str, bool, float or nil where an int (and the like for every field) is wanted is refused naming the field."""
    error = _wm_reject(_header_with(message, **{field: value}))
    assert error.code in (ErrorCode.BAD_REQUEST, ErrorCode.INVALID_INPUT)
    assert f"{type(message).__name__}.{field}" in error.message


@pytest.mark.parametrize("message", [READY, REQUEST, REPLY, STATS], ids=lambda m: type(m).__name__)
def test_field_base_messages_are_valid(message: wm.WorkerMessage) -> None:
    """The messages the field-type tests start from decode unchanged, so each refusal is down to its one change."""
    assert wm.decode(pack(_header_with(message))) == message


# ---------------------------------------------------------------------------------------------------------------
# tensors: descriptors, frames and specs


def test_tensor_desc_nbytes_and_wire_form() -> None:
    """nbytes is the product of the shape times the itemsize; to_wire is the map parse_descs reads."""
    desc = TensorDesc("x", "float16", (2, 3, 4))
    assert desc.nbytes == 48
    assert TensorDesc("s", "int64", ()).nbytes == 8
    assert parse_descs([desc.to_wire()]) == (desc,)


def test_parse_descs_names_the_field_it_reads() -> None:
    """Errors of parse_descs name the array they come from (inputs, outputs or a worker field)."""
    with pytest.raises(ProtocolError) as info:
        parse_descs([{"name": "", "dtype": "uint8", "shape": [1]}], "outputs")
    assert "outputs[0].name" in info.value.message


def test_check_frames_accepts_matching_frames() -> None:
    """Frames of exactly shape x itemsize bytes under the limit pass."""
    check_frames([TensorDesc("a", "int16", (3,)), TensorDesc("b", "bool", ())], [6, 1], 6)


SPEC: Final = TensorSpec("x", "float32", (None, 16))


def test_tensor_spec_describe() -> None:
    """describe() writes dynamic dims as * and fixed dims as numbers."""
    assert SPEC.describe() == "x float32[*,16]"
    assert TensorSpec("image", "float32", (None, 3, 224, 224)).describe() == "image float32[*,3,224,224]"
    assert TensorSpec("s", "int64", ()).describe() == "s int64[]"


@pytest.mark.parametrize("shape", [(1, 16), (64, 16), (2**31 - 1, 16)])
def test_tensor_spec_accepts_any_size_on_dynamic_dims(shape: tuple[int, ...]) -> None:
    """A dynamic dim matches any size while fixed dims must be equal."""
    assert SPEC.mismatch(TensorDesc("x", "float32", shape)) is None


@pytest.mark.parametrize(
    ("desc", "says"),
    [
        (TensorDesc("x", "float64", (2, 16)), "dtype float64"),
        (TensorDesc("x", "float32", (2, 15)), "shape [2, 15]"),
        (TensorDesc("x", "float32", (16,)), "shape [16]"),
        (TensorDesc("x", "float32", (2, 16, 1)), "shape [2, 16, 1]"),
        (TensorDesc("x", "float32", ()), "shape []"),
    ],
    ids=["dtype", "dim", "rank-low", "rank-high", "scalar"],
)
def test_tensor_spec_mismatch_says_what_was_expected(desc: TensorDesc, says: str) -> None:
    """mismatch() names the input, what it got and the expected spec like `x float32[*,16]`."""
    message = SPEC.mismatch(desc)
    assert message is not None
    assert "'x'" in message and says in message and "expected x float32[*,16]" in message


def test_check_against_spec_accepts_exact_inputs_in_any_order() -> None:
    """The request's tensors may come in any order as long as each fits its spec."""
    specs = [SPEC, TensorSpec("mask", "bool", (None,))]
    check_against_spec([TensorDesc("mask", "bool", (3,)), TensorDesc("x", "float32", (3, 16))], specs)


@pytest.mark.parametrize(
    "names",
    [["x"], ["x", "mask", "extra"], ["mask", "y"], []],
    ids=["missing", "extra", "renamed", "none"],
)
def test_check_against_spec_wrong_input_names_list_expected(names: list[str]) -> None:
    """Missing, extra or renamed inputs are INVALID_INPUT listing what was sent and what the model takes."""
    specs = [SPEC, TensorSpec("mask", "bool", (None,))]
    with pytest.raises(ProtocolError) as info:
        check_against_spec([TensorDesc(n, "float32", (1, 16)) for n in names], specs)
    assert info.value.code is ErrorCode.INVALID_INPUT
    assert str(sorted(names)) in info.value.message
    assert "x float32[*,16], mask bool[*]" in info.value.message


def test_check_against_spec_reports_the_mismatch() -> None:
    """A wrongly shaped input is INVALID_INPUT carrying the mismatch message."""
    with pytest.raises(ProtocolError) as info:
        check_against_spec([TensorDesc("x", "float32", (1, 8))], [SPEC])
    assert info.value.code is ErrorCode.INVALID_INPUT
    assert info.value.message == "input 'x' has shape [1, 8], expected x float32[*,16]"


# ---------------------------------------------------------------------------------------------------------------
# errors


def test_protocol_error_carries_code_message_and_id() -> None:
    """ProtocolError keeps its fields and puts the code first in its string."""
    error = ProtocolError(ErrorCode.OVERLOADED, "queue full", 3)
    assert (error.code, error.message, error.request_id) == (ErrorCode.OVERLOADED, "queue full", 3)
    assert str(error) == "OVERLOADED: queue full"


@pytest.mark.parametrize(("code", "expected"), [("OVERLOADED", ErrorCode.OVERLOADED), ("NEW_CODE", "NEW_CODE")])
def test_inference_error_converts_known_codes(code: str, expected: object) -> None:
    """InferenceError turns a known code string into an ErrorCode and keeps unknown ones as strings."""
    error = InferenceError(code, "m", 1)
    assert error.code == expected and type(error.code) is type(expected)


# ---------------------------------------------------------------------------------------------------------------
# fuzz: arbitrary bytes

BYTE_DECODERS: Final[tuple[Callable[[bytes], object], ...]] = (
    unpack,
    lambda data: decode_infer(data, [], DEFAULT_MAX_FRAME_BYTES),
    wm.decode,
    lambda data: decode_reply(data, []),
)
arbitrary_headers: st.SearchStrategy[bytes] = st.one_of(
    st.binary(max_size=64),
    msgpack_values.map(pack),
    st.tuples(msgpack_values.map(pack), st.binary(max_size=8)).map(lambda p: p[0][: len(p[0]) // 2] + p[1]),
)


@fuzz_settings(BYTES_FUZZ_EXAMPLES)
@given(data=arbitrary_headers)
def test_fuzz_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    """Arbitrary bytes and every prefix of them make unpack and each decoder raise ProtocolError or nothing."""
    for end in range(len(data) + 1):
        for decoder in BYTE_DECODERS:
            _only_protocol_errors(decoder, data[:end])


# ---------------------------------------------------------------------------------------------------------------
# fuzz: valid headers, structurally mutated


@fuzz_settings(STRUCTURED_FUZZ_EXAMPLES)
@given(case=mutated_infer_headers())
def test_fuzz_mutated_infer_headers_are_refused_or_valid(case: tuple[list[bytes], list[int]]) -> None:
    """Each step of mutating an infer header raises ProtocolError or decodes to a valid request that round-trips."""
    headers, lengths = case
    for header in headers:
        request = _only_protocol_errors(decode_infer, header, lengths, DEFAULT_MAX_FRAME_BYTES)
        if request is not None:
            assert isinstance(request, InferRequest)
            _check_infer(request, lengths)


@fuzz_settings(STRUCTURED_FUZZ_EXAMPLES)
@given(headers=mutated_worker_headers())
def test_fuzz_mutated_worker_messages_are_refused_or_valid(headers: list[bytes]) -> None:
    """Each step of mutating a worker header raises ProtocolError or decodes well-typed and round-trips."""
    for header in headers:
        message = _only_protocol_errors(wm.decode, header)
        if message is not None:
            _check_worker_message(message, unpack(header)[0])


@fuzz_settings(STRUCTURED_FUZZ_EXAMPLES)
@given(case=mutated_reply_headers())
@example(case=([pack({"v": 1, "type": "error", "id": 1, "code": ["BAD_REQUEST"], "message": "m"})], []))
def test_fuzz_mutated_replies_are_refused_or_valid(case: tuple[list[bytes], list[int]]) -> None:
    """Each step of mutating a reply raises ProtocolError or decodes to a well-formed result or error value."""
    headers, lengths = case
    for header in headers:
        reply = _only_protocol_errors(decode_reply, header, lengths)
        if reply is not None:
            assert isinstance(reply, (InferResult, ProtocolError))
            _check_reply(reply, lengths)


# ---------------------------------------------------------------------------------------------------------------
# fuzz: byte flips of valid encodings


@fuzz_settings(FLIP_FUZZ_EXAMPLES)
@given(case=flipped_infer_headers())
def test_fuzz_byte_flipped_infer_requests_are_refused_or_valid(case: tuple[list[bytes], list[int]]) -> None:
    """A valid infer request with flipped, cut or appended bytes raises ProtocolError or decodes to a valid request."""
    headers, lengths = case
    for header in headers:
        request = _only_protocol_errors(decode_infer, header, lengths, DEFAULT_MAX_FRAME_BYTES)
        if request is not None:
            assert isinstance(request, InferRequest)
            _check_infer(request, lengths)


@fuzz_settings(FLIP_FUZZ_EXAMPLES)
@given(headers=flipped_worker_headers())
def test_fuzz_byte_flipped_worker_messages_are_refused_or_valid(headers: list[bytes]) -> None:
    """A valid worker message with flipped, cut or appended bytes raises ProtocolError or decodes well-typed."""
    for header in headers:
        message = _only_protocol_errors(wm.decode, header)
        if message is not None:
            _check_worker_message(message, unpack(header)[0])


@pytest.mark.parametrize("elements", [1, 15, 16, 17, 4096, 150_528])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_scan_finds_one_non_finite_value_anywhere(elements: int, bad: float) -> None:
    """A float frame of any length passes when finite and is refused for one NaN/Inf at its very end."""
    array = np.zeros(elements, np.float32)
    specs = [TensorSpec("x", "float32", (None,))]
    desc, frame = to_frame("x", array)
    assert check_finite([desc], [frame.data], specs) == ["x"]
    array[-1] = bad  # at the very end, where a scan that stops early would miss it
    with pytest.raises(ProtocolError, match="'x' contains NaN or Inf") as caught:
        check_finite([desc], [frame.data], specs)
    assert caught.value.code is ErrorCode.INVALID_INPUT


@pytest.mark.parametrize("elements", [32, 32_768])
def test_the_scan_skips_what_the_spec_allows_and_integers(elements: int) -> None:
    """allow_non_finite inputs and integer inputs pass whatever they hold; finite float16 passes, NaN does not."""
    nan = np.full(elements, np.nan, np.float16)
    ints = np.full(elements, -1, np.int64)
    descs = [to_frame("a", nan)[0], to_frame("i", ints)[0]]
    allowed = [TensorSpec("a", "float16", (None,), allow_non_finite=True), TensorSpec("i", "int64", (None,))]
    assert check_finite(descs, [nan.data, ints.data], allowed) == []
    guarded = [TensorSpec("a", "float16", (None,)), allowed[1]]
    assert check_finite(descs, [np.ones_like(nan).data, ints.data], guarded) == ["a"]
    with pytest.raises(ProtocolError, match="'a' contains NaN"):
        check_finite(descs, [nan.data, ints.data], guarded)
