"""numpy <-> wire conversion: descriptors plus zero-copy buffers, and the NaN/Inf scan of received frames."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from infervisor.protocol.constants import DTYPE_ITEMSIZE, ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.tensors import TensorDesc, TensorSpec

#: Native-order dtypes and their wire names; `dtype.name` runs Python code in numpy 2 (~1.5 us a call).
_WIRE_NAMES: dict[np.dtype[Any], str] = {np.dtype(name): name for name in DTYPE_ITEMSIZE}
#: Wire name -> the little-endian dtype a received frame is read as.
_LITTLE_ENDIAN: dict[str, np.dtype[Any]] = {name: np.dtype(name).newbyteorder("<") for name in DTYPE_ITEMSIZE}


def wire_dtype(dtype: np.dtype[Any]) -> str | None:
    """The wire name of a numpy dtype in either byte order, or None when the wire cannot carry it."""
    name = _WIRE_NAMES.get(dtype)
    if name is None and dtype.name in DTYPE_ITEMSIZE:
        name = dtype.name  # the same type in the other byte order
    return name


def to_frame(name: str, array: np.ndarray[Any, Any]) -> tuple[TensorDesc, np.ndarray[Any, Any]]:
    """Descriptor and a C-contiguous little-endian array whose buffer is the frame (no copy when already so)."""
    dtype = array.dtype
    wire = wire_dtype(dtype)
    if wire is None:
        raise ProtocolError(ErrorCode.INVALID_INPUT, f"tensor {name!r} dtype {dtype} is not supported on the wire")
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        # ascontiguousarray turns a 0-d array into shape (1,); reshape keeps scalars scalars.
        array = np.ascontiguousarray(array).reshape(array.shape)
    return TensorDesc(name, wire, tuple(int(d) for d in array.shape)), array


def from_frame(desc: TensorDesc, buffer: Any) -> np.ndarray[Any, Any]:
    """A read-only array viewing the received frame (no copy)."""
    return np.frombuffer(buffer, dtype=_LITTLE_ENDIAN[desc.dtype]).reshape(desc.shape)


def check_finite(descs: Sequence[TensorDesc], buffers: Sequence[Any], specs: Sequence[TensorSpec]) -> list[str]:
    """Refuse NaN/Inf in the float frames the spec guards; returns the names it scanned.

    `descs` already matched the specs (check_against_spec) and their frames' lengths.
    """
    scanned: list[str] = []
    for desc, buffer in zip(descs, buffers, strict=True):
        if not desc.dtype.startswith("float"):
            continue
        spec = next(s for s in specs if s.name == desc.name)
        if spec.allow_non_finite:
            continue
        # isfinite+all is ~20x faster than torch's on a 600 KB image.
        if not bool(np.isfinite(np.frombuffer(buffer, _LITTLE_ENDIAN[desc.dtype])).all()):
            raise ProtocolError(ErrorCode.INVALID_INPUT, f"input {spec.name!r} contains NaN or Inf")
        scanned.append(desc.name)
    return scanned
