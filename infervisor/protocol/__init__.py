"""infervisor wire protocol v1: constants, codecs, the Python client and the control client (needs no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infervisor.protocol.constants import PROTOCOL_VERSION, ErrorCode
from infervisor.protocol.errors import InferenceError, ProtocolError

if TYPE_CHECKING:
    from infervisor.protocol.client import Client
    from infervisor.protocol.shared_memory import SharedRegion, SharedTensor

__all__ = [
    "PROTOCOL_VERSION",
    "Client",
    "ErrorCode",
    "InferenceError",
    "ProtocolError",
    "SharedRegion",
    "SharedTensor",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package for its constants and codecs does not import the client's socket code.
    if name == "Client":
        from infervisor.protocol.client import Client

        return Client
    if name in ("SharedRegion", "SharedTensor"):
        from infervisor.protocol import shared_memory

        return getattr(shared_memory, name)
    raise AttributeError(name)
