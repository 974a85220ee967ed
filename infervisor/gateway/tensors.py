"""OIP tensors and numpy arrays: the request decoder (JSON, the binary tensor extension, gRPC) and the reply encoder.

Everything here is pure and bounded: a request is refused with INVALID_INPUT or BAD_REQUEST (the daemon's codes,
status_codes.py maps them) before an array larger than the daemon's `max_frame_bytes` is made.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from infervisor.protocol.constants import MAX_NAME_LEN, MAX_RANK, MAX_TENSORS, ErrorCode
from infervisor.protocol.errors import ProtocolError, shown

#: The OIP datatypes the daemon's wire carries, and their numpy names (BYTES, BF16 and the wide unsigned ones: no).
OIP_DTYPES: Final[dict[str, str]] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
NUMPY_DTYPES: Final[dict[str, str]] = {numpy: oip for oip, numpy in OIP_DTYPES.items()}
#: What a JSON `data` element of each kind may be (bool is an int in Python: told apart on purpose).
_JSON_KINDS: Final[dict[str, tuple[type, ...]]] = {"b": (bool,), "i": (int,), "u": (int,), "f": (int, float)}


@dataclass(frozen=True, slots=True)
class SequenceStep:
    """Triton's sequence parameters: the stream id and whether this step starts or ends it."""

    stream: str
    start: bool
    end: bool


@dataclass(frozen=True, slots=True)
class OipRequest:
    """A decoded infer request: the inputs as arrays, what to answer and how."""

    request_id: str
    inputs: dict[str, np.ndarray[Any, Any]]
    #: Requested outputs by name (True: as binary data over HTTP); None: all, in the default form.
    outputs: dict[str, bool] | None
    binary_default: bool
    timeout_us: int | None
    sequence: SequenceStep | None


def invalid(message: str) -> ProtocolError:
    """An INVALID_INPUT refusal."""
    return ProtocolError(ErrorCode.INVALID_INPUT, message)


def bad(message: str) -> ProtocolError:
    """A BAD_REQUEST refusal (the request's form, not its tensors)."""
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _name(raw: object, what: str) -> str:
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_NAME_LEN:
        raise bad(f"{what} needs a name of 1..{MAX_NAME_LEN} characters, got {shown(raw)}")
    return raw


def tensor_header(raw: Mapping[str, Any], max_bytes: int) -> tuple[str, np.dtype[Any], tuple[int, ...]]:
    """Name, numpy dtype and shape of one input, its byte size held to `max_bytes`."""
    name = _name(raw.get("name"), "an input")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in OIP_DTYPES:
        raise invalid(f"input {name!r}: datatype {shown(datatype)} is not one of {sorted(OIP_DTYPES)}")
    shape = raw.get("shape")
    if (
        not isinstance(shape, list | tuple)
        or len(shape) > MAX_RANK
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise invalid(f"input {name!r}: shape must be at most {MAX_RANK} integers >= 0, got {shown(shape)}")
    dtype = np.dtype(OIP_DTYPES[datatype]).newbyteorder("<")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_bytes:
        raise invalid(f"input {name!r} is {nbytes} bytes, over the daemon's max_frame_bytes of {max_bytes}")
    return name, dtype, tuple(shape)


def from_raw(name: str, dtype: np.dtype[Any], shape: tuple[int, ...], raw: bytes | memoryview) -> np.ndarray[Any, Any]:
    """An array over raw little-endian bytes whose length must be what the shape and datatype say."""
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise invalid(
            f"input {name!r}: {len(raw)} bytes of data, but shape {list(shape)} of {dtype.name} is {expected}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if dtype.kind == "b" and array.view(np.uint8).max(initial=0) > 1:
        raise invalid(f"input {name!r}: BOOL bytes must be 0 or 1")
    return array


def _flatten(data: object, name: str, limit: int) -> list[Any]:
    """The elements of nested JSON lists in row-major order, at most `limit` of them."""
    flat: list[Any] = []
    stack: list[Any] = [iter([data])]
    while stack:
        item = next(stack[-1], stack)
        if item is stack:
            stack.pop()
        elif isinstance(item, list):
            if len(stack) > MAX_RANK + 1:
                raise invalid(f"input {name!r}: data nested deeper than {MAX_RANK}")
            stack.append(iter(item))
        else:
            flat.append(item)
            if len(flat) > limit:
                raise invalid(f"input {name!r}: more data elements than its shape holds ({limit})")
    return flat


def from_json(name: str, dtype: np.dtype[Any], shape: tuple[int, ...], data: object) -> np.ndarray[Any, Any]:
    """An array from a JSON `data` (flat or nested), each element of the datatype's kind."""
    count = math.prod(shape)
    flat = _flatten(data, name, count)
    if len(flat) != count:
        raise invalid(f"input {name!r}: {len(flat)} data elements, but shape {list(shape)} holds {count}")
    kinds = _JSON_KINDS[dtype.kind]
    for value in flat:
        if not isinstance(value, kinds) or (dtype.kind != "b" and isinstance(value, bool)):
            raise invalid(f"input {name!r}: element {shown(value)} is not a {NUMPY_DTYPES[dtype.name]} value")
    try:
        with np.errstate(over="raise"):
            array = np.array(flat, dtype=dtype)
    except (OverflowError, FloatingPointError, ValueError) as exc:
        raise invalid(f"input {name!r}: data out of range for {NUMPY_DTYPES[dtype.name]}") from exc
    if dtype.kind in "iu" and not np.array_equal(array, np.array(flat, dtype=object)):
        raise invalid(f"input {name!r}: data out of range for {NUMPY_DTYPES[dtype.name]}")
    return array.reshape(shape)


def _parameters(raw: object, what: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad(f"{what} parameters must be an object")
    return raw


def sequence_of(parameters: Mapping[str, Any]) -> SequenceStep | None:
    """Triton's sequence_id/sequence_start/sequence_end as a stream of the daemon; None without a sequence_id."""
    raw = parameters.get("sequence_id")
    if raw is None or raw == 0 or raw == "":
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | str) or len(str(raw)) > MAX_NAME_LEN:
        raise bad(f"sequence_id must be an integer or a string, got {shown(raw)}")
    start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
    if not isinstance(start, bool) or not isinstance(end, bool):
        raise bad("sequence_start and sequence_end must be booleans")
    return SequenceStep(str(raw), start, end)


def timeout_of(parameters: Mapping[str, Any]) -> int | None:
    """Triton's `timeout` parameter (µs), or None."""
    raw = parameters.get("timeout")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise bad(f"timeout must be an integer of microseconds >= 0, got {shown(raw)}")
    return raw


def decode_json_request(body: bytes, header_length: int | None, max_bytes: int) -> OipRequest:
    """Decode an HTTP infer body: JSON alone, or a JSON header of `header_length` bytes and binary tensors after it."""
    if header_length is None:
        header_length = len(body)
    if not 0 <= header_length <= len(body):
        raise bad(f"Inference-Header-Content-Length {header_length} is not within the body's {len(body)} bytes")
    try:
        document = json.loads(body[:header_length])
    except (ValueError, RecursionError) as exc:
        raise bad(f"the request is not valid JSON: {shown(str(exc))}") from exc
    if not isinstance(document, dict):
        raise bad("the request must be a JSON object")
    parameters = _parameters(document.get("parameters"), "request")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not 0 < len(raw_inputs) <= MAX_TENSORS:
        raise bad(f"inputs must be a list of 1..{MAX_TENSORS} tensors")
    binary = memoryview(body)[header_length:]
    inputs: dict[str, np.ndarray[Any, Any]] = {}
    for raw in raw_inputs:
        if not isinstance(raw, dict):
            raise bad("each input must be an object")
        name, dtype, shape = tensor_header(raw, max_bytes)
        if name in inputs:
            raise invalid(f"input {name!r} is given twice")
        size = _parameters(raw.get("parameters"), f"input {name!r}").get("binary_data_size")
        if size is None:
            inputs[name] = from_json(name, dtype, shape, raw.get("data"))
            continue
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= len(binary):
            raise invalid(f"input {name!r}: binary_data_size {shown(size)} is not within the {len(binary)} bytes left")
        inputs[name] = from_raw(name, dtype, shape, binary[:size])
        binary = binary[size:]
    if len(binary):
        raise invalid(f"{len(binary)} bytes of binary data after the last input")
    request_id = document.get("id", "")
    if not isinstance(request_id, str) or len(request_id) > MAX_NAME_LEN:
        raise bad(f"id must be a string of at most {MAX_NAME_LEN} characters")
    binary_default = parameters.get("binary_data_output", False) is True
    return OipRequest(
        request_id,
        inputs,
        _requested_outputs(document.get("outputs"), binary_default),
        binary_default,
        timeout_of(parameters),
        sequence_of(parameters),
    )


def _requested_outputs(raw: object, binary_default: bool) -> dict[str, bool] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TENSORS:
        raise bad(f"outputs must be a list of at most {MAX_TENSORS}")
    requested: dict[str, bool] = {}
    for entry in raw:
        if not isinstance(entry, dict):
            raise bad("each requested output must be an object")
        name = _name(entry.get("name"), "a requested output")
        binary = _parameters(entry.get("parameters"), f"output {name!r}").get("binary_data", binary_default)
        requested[name] = binary is True
    return requested


def chosen_outputs(
    outputs: Mapping[str, np.ndarray[Any, Any]], requested: Mapping[str, bool] | None, binary_default: bool
) -> list[tuple[str, np.ndarray[Any, Any], bool]]:
    """The outputs to answer, in the model's order, each with whether it goes as binary data."""
    if requested is None:
        return [(name, array, binary_default) for name, array in outputs.items()]
    missing = sorted(set(requested) - set(outputs))
    if missing:
        raise invalid(f"the model has no output {missing[0]!r}; it has {sorted(outputs)}")
    return [(name, array, requested[name]) for name, array in outputs.items() if name in requested]


def encode_json_response(
    model: str, request_id: str, chosen: Sequence[tuple[str, np.ndarray[Any, Any], bool]]
) -> tuple[bytes, int | None]:
    """The HTTP reply body and, when an output goes as binary data, the length of its JSON header."""
    described: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array, binary in chosen:
        entry: dict[str, Any] = {"name": name, "datatype": NUMPY_DTYPES[array.dtype.name], "shape": list(array.shape)}
        if binary:
            blob = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = array.reshape(-1).tolist()
        described.append(entry)
    document: dict[str, Any] = {"model_name": model, "outputs": described}
    if request_id:
        document["id"] = request_id
    header = json.dumps(document, separators=(",", ":")).encode()
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
