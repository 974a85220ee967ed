"""Wire constants shared by clients, the broker and workers (the single source of truth)."""

from __future__ import annotations

import enum
import re
from typing import Final

#: Version carried in every header; a peer answers any other value with UNSUPPORTED_VERSION.
PROTOCOL_VERSION: Final = 1

#: Socket file names inside the runtime directory.
CLIENT_SOCKET_NAME: Final = "infer.sock"
CONTROL_SOCKET_NAME: Final = "control.sock"
#: The read-only control socket (status, ping, metrics), made only for config `socket_group` and open to it.
STATUS_SOCKET_NAME: Final = "status.sock"
#: The control commands status.sock answers: a control client sends these there when the daemon has one. The daemon's
#: table (supervisor/core/control_commands.py) marks the same ones read-only; tests/test_control_commands.py ties them.
STATUS_SOCKET_COMMANDS: Final = frozenset({"status", "ping", "metrics"})


class ClientMessageType(enum.StrEnum):
    """The `type` field of a client-facing header."""

    INFER = "infer"
    RESULT = "result"
    ERROR = "error"


#: The keys of a RESULT header's `timing` map, every one always present (docs/protocol.md, section 6).
TIMING_KEYS: Final = (
    "queue_ms",
    "dispatch_ms",
    "decode_ms",
    "model_ms",
    "encode_ms",
    "total_ms",
    "accepted_clock_ms",
)


class ErrorCode(enum.StrEnum):
    """Stable error codes; clients may switch on them, so values never change meaning."""

    BAD_REQUEST = "BAD_REQUEST"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_MODEL = "UNKNOWN_MODEL"
    INVALID_INPUT = "INVALID_INPUT"
    OVERLOADED = "OVERLOADED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    WORKER_LOST = "WORKER_LOST"
    INTERNAL = "INTERNAL"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNAVAILABLE = "UNAVAILABLE"
    TIMEOUT = "TIMEOUT"  # raised by the Python client only: no reply within its own timeout
    UNKNOWN_STREAM = "UNKNOWN_STREAM"  # no such stream on this connection: never started, ended, or expired
    STREAM_EXISTS = "STREAM_EXISTS"  # a start on a stream this connection already has open
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"  # the model's max_streams or max_state_bytes is reached
    STREAM_ENDED = "STREAM_ENDED"  # the daemon ended the stream: its model's state pairs changed in the config


class WorkerMessageType(enum.IntEnum):
    """Message kinds on the supervisor-worker socket (first element of the header array)."""

    READY = 1
    HEARTBEAT = 2
    REQUEST = 3
    REPLY = 4
    STATS = 5
    DRAIN = 6
    STOP = 7
    CANARY = 8
    CANARY_RESULT = 9
    PROFILE = 10
    PROFILE_RESULT = 11
    BATCH = 12
    PROGRESS = 13
    LOAD_ERROR = 14
    #: The live audit process (supervisor/lifecycle/audit_runner.py): a served answer to rerun on eager fp32, and
    #: its verdict.
    AUDIT = 20
    AUDIT_RESULT = 21


class StartPhase(enum.StrEnum):
    """What a starting worker is doing (the PROGRESS message); the supervisor's limits depend on it.

    BUILDING and WAITING count against the per-profile compile limit, every other phase against the
    start limit. The last four are the outcome of one profile of the chain, sent once it is decided.
    """

    LOADING = "loading"  # importing and loading the model, computing the eager reference
    BUILDING = "building"  # one profile: export, quantize, compile or load its cached package, first run
    WAITING = "waiting"  # for another process's build of the same package (the cache's per-key lock)
    CHECKING = "checking"  # the built profile against eager on the golden inputs
    TIMING = "timing"  # pick fastest: the profiles that passed, timed against each other
    WARMING = "warming up"  # the serving profile's warm-up iterations
    PASSED = "passed"  # the profile built and matches eager within the tolerance
    REJECTED = "rejected"  # it built but misses the tolerance
    FAILED = "failed"  # it could not be built, or crashed on the golden inputs
    REFUSED = "refused"  # not tried: the CPU lacks what it needs, or it crashed a process before


#: The phases a per-profile compile limit applies to (config compile_timeout_s).
COMPILE_PHASES: Final = frozenset({StartPhase.BUILDING, StartPhase.WAITING})
#: The phases that end one profile's turn.
OUTCOME_PHASES: Final = frozenset({StartPhase.PASSED, StartPhase.REJECTED, StartPhase.FAILED, StartPhase.REFUSED})


class WorkerExitCode(enum.IntEnum):
    """Exit statuses a worker uses so the supervisor can tell a bad model from a crash."""

    OK = 0
    BAD_LAUNCH = 3
    LOAD_FAILED = 4
    SUPERVISOR_LOST = 5


#: dtype name -> itemsize. Little-endian only; bool is one byte (0 or 1).
DTYPE_ITEMSIZE: Final[dict[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}

#: Most requests the broker joins into one batch (the worker link carries each one's headers and frames).
MAX_BATCH_REQUESTS: Final = 64

#: Hard ceilings of the header decoder; they bound memory whatever a peer sends.
MAX_HEADER_BYTES: Final = 64 * 1024
MAX_TENSORS: Final = 64
MAX_RANK: Final = 8
MAX_NAME_LEN: Final = 128
MAX_REQUEST_ID_LEN: Final = 64
#: A stream id: a string of 1..128 bytes once UTF-8 encoded, unique per client connection.
MAX_STREAM_ID_LEN: Final = 128
#: Steps of one stream waiting behind its step in flight; one more is answered OVERLOADED.
MAX_STREAM_BACKLOG: Final = 16
MAX_MESSAGE_LEN: Final = 4096
MAX_DEADLINE_MS: Final = 2**31 - 1
DEFAULT_MAX_FRAME_BYTES: Final = 256 * 1024 * 1024

#: Names of shared-memory objects an input may lie in: what `shm_open` takes, without its leading slash.
SHM_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
#: Where Linux keeps POSIX shared-memory objects (`shm_open("/NAME")` is the file `SHM_DIR/NAME`).
SHM_DIR: Final = "/dev/shm"
MAX_SHM_OFFSET: Final = 2**48
