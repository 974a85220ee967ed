"""numpy <-> wire conversion: descriptors plus zero-copy buffers (clients and workers only)."""

from __future__ import annotations

from typing import Any

import numpy as np

from protocol.constants import DTYPE_ITEMSIZE, ErrorCode
from protocol.errors import ProtocolError
from protocol.tensors import TensorDesc


def to_frame(name: str, array: np.ndarray[Any, Any]) -> tuple[TensorDesc, np.ndarray[Any, Any]]:
    """Descriptor and a C-contiguous little-endian array whose buffer is the frame (no copy when already so)."""
    dtype = array.dtype
    if dtype.name not in DTYPE_ITEMSIZE:
        raise ProtocolError(ErrorCode.INVALID_INPUT, f"tensor {name!r} dtype {dtype} is not supported on the wire")
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"))
    # ascontiguousarray turns a 0-d array into shape (1,); reshape keeps scalars scalars.
    array = np.ascontiguousarray(array).reshape(array.shape)
    return TensorDesc(name, dtype.name, tuple(int(d) for d in array.shape)), array


def from_frame(desc: TensorDesc, buffer: Any) -> np.ndarray[Any, Any]:
    """A read-only array viewing the received frame (no copy)."""
    return np.frombuffer(buffer, dtype=np.dtype(desc.dtype).newbyteorder("<")).reshape(desc.shape)
