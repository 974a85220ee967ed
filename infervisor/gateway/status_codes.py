"""The daemon's error codes as the protocol's status codes: one table for gRPC, HTTP follows gRPC's own mapping."""

from __future__ import annotations

from typing import Final

import grpc

from infervisor.protocol.constants import ErrorCode

#: Each ZeroMQ error code as a gRPC status; the message stays the ZeroMQ one (`CODE: message`).
GRPC_STATUS: Final[dict[ErrorCode, grpc.StatusCode]] = {
    ErrorCode.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNSUPPORTED_VERSION: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNKNOWN_MODEL: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    # Not UNAVAILABLE: a request that took its workers down max_retries times must not be retried blindly.
    ErrorCode.WORKER_LOST: grpc.StatusCode.INTERNAL,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNKNOWN_STREAM: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.STREAM_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.TOO_MANY_STREAMS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.STREAM_ENDED: grpc.StatusCode.FAILED_PRECONDITION,
}

#: gRPC's status codes as HTTP statuses (the mapping of google.rpc's code.proto, which grpc-gateway uses too).
_HTTP_OF_GRPC: Final[dict[grpc.StatusCode, int]] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status of a daemon error code."""
    return GRPC_STATUS[code]


def http_status(code: ErrorCode) -> int:
    """The HTTP status of a daemon error code."""
    return _HTTP_OF_GRPC[GRPC_STATUS[code]]
