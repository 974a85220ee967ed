"""Exceptions raised by the protocol layer."""

from __future__ import annotations

from protocol.constants import ErrorCode


class ProtocolError(Exception):
    """A frame or header that does not follow the spec; carries the code to answer with."""

    def __init__(self, code: ErrorCode, message: str, request_id: object = None) -> None:
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
