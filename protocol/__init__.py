"""infervisor wire protocol v1: constants, codecs and the Python client (needs no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol.constants import PROTOCOL_VERSION, ErrorCode
from protocol.errors import InferenceError, ProtocolError

if TYPE_CHECKING:
    from protocol.client import Client

__all__ = ["PROTOCOL_VERSION", "Client", "ErrorCode", "InferenceError", "ProtocolError"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package for its constants and codecs does not import the client's socket code.
    if name == "Client":
        from protocol.client import Client

        return Client
    raise AttributeError(name)
