"""Exceptions raised by the protocol layer."""

from __future__ import annotations

import reprlib

from infervisor.protocol.constants import MAX_MESSAGE_LEN, ErrorCode

_shown = reprlib.Repr()
_shown.maxlevel, _shown.maxstring, _shown.maxother, _shown.maxlist, _shown.maxdict = 3, 64, 64, 8, 8


def shown(value: object) -> str:
    """A short repr of an untrusted value for error messages: bounded in size and nesting depth."""
    return _shown.repr(value)


class ProtocolError(Exception):
    """A frame or header that does not follow the spec; carries the code to answer with."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | str | bytes | None = None) -> None:
        message = message[:MAX_MESSAGE_LEN]
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class InferenceError(Exception):
    """A request that ended in an error reply (or no reply); `.code` is an ErrorCode."""

    def __init__(self, code: ErrorCode | str, message: str, request_id: object = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code) if code in ErrorCode.__members__ else code
        self.message = message
        self.request_id = request_id
