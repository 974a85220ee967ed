"""msgpack encoding with hard limits: the only place the wire is (un)packed."""

from __future__ import annotations

from typing import Any

import msgpack

from infervisor.protocol.constants import MAX_HEADER_BYTES, ErrorCode
from infervisor.protocol.errors import ProtocolError

# Limits are per object, so a hostile header cannot make the decoder allocate much more
# than its own length; ext types are refused (no hook), so nothing but plain data decodes.
_UNPACK_LIMITS: dict[str, Any] = {
    "max_str_len": MAX_HEADER_BYTES,
    "max_bin_len": MAX_HEADER_BYTES,
    "max_array_len": 4096,
    "max_map_len": 256,
    "max_ext_len": 0,
}


def _refuse_ext(code: int, data: bytes) -> object:
    # max_ext_len=0 still lets zero-length ext values through; nothing but plain data may decode.
    raise ValueError(f"msgpack ext type {code} is not allowed")


def pack(obj: object) -> bytes:
    """Serialise a header object to msgpack bytes."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes | memoryview) -> Any:
    """Deserialise one header, raising ProtocolError(BAD_REQUEST) on anything malformed."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"header is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext, **_UNPACK_LIMITS
        )
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"header is not valid msgpack: {exc}") from exc
