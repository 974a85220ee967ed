"""An accepted request as the broker holds it until its one final reply."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from infervisor.protocol.client_messages import RequestId
from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import TensorDesc, TensorSpec

#: Where a reply goes: the client-facing socket a request came in on, and the connection's routing id.
Peer = tuple[Any, bytes]
#: A stream is named by who opened it (routing/peer_credentials.py: peer_owner), the connection it came in on,
#: and the id the client chose: another uid or CURVE key reusing the routing id and the stream id names none.
StreamKey = tuple[str, Peer, str]


@dataclass(slots=True)
class PendingRequest:
    """An accepted request: it gets exactly one final reply, however many workers it outlives."""

    internal_id: int
    client: Peer
    request_id: RequestId
    model: str
    #: The client's header and tensor frames exactly as received: the worker gets them unchanged.
    frames: list[Any]
    accepted_at: float
    deadline: float | None
    losses: int = 0
    dispatched_at: float = 0.0
    #: Bytes this request holds of its client's budget (its frames and the shared-memory bytes it names).
    cost: int = 0
    #: Rows along dim 0 of its first input: how much work it is against the warm-up's batch of one.
    rows: int = 1
    #: While a rollout changes the model's inputs: the spec that admitted it (only its workers may take it).
    spec: tuple[TensorSpec, ...] | None = None
    #: With batching: what must match for two requests to be joined (input names, dtypes, dims after the first).
    shape_key: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    #: The dispatch it went out in: requests sent to a worker together share it.
    batch_id: int = 0
    #: After its batch killed a worker, the most requests it may be sent with (the batch was split in two).
    batch_limit: int | None = None
    #: With a shared-memory input: `[uid, gid, *groups]` of the client (the worker checks it may read the object).
    reader: list[int] | None = None
    #: A step of a stream (routing/streams.py): its state is committed when its result comes back.
    step: StreamStep | None = None
    #: The connection it came in on (routing/connections.py): its reply goes to that connection or nowhere.
    connection: tuple[Any, int, int] | None = None

    def expired(self, now: float) -> bool:
        """True once its deadline passed: it gets DEADLINE_EXCEEDED, never a late result."""
        return self.deadline is not None and now >= self.deadline


@dataclass(eq=False)
class OpenStream:
    """One open stream: its committed state and the steps it holds."""

    key: StreamKey
    model: str
    #: The state pairs it was started with; a config whose pairs differ ends it.
    pairs: tuple[StateSpec, ...]
    #: The last committed state, one raw little-endian buffer per pair (`[1, *shape]` of its dtype).
    state: list[bytes]
    nbytes: int
    last_active: float
    #: The step a worker runs now (or that waits in the model's queue), at most one.
    in_flight: PendingRequest | None = None
    #: Accepted steps (and a bare end) waiting behind it, in order.
    backlog: collections.deque[PendingRequest] = field(default_factory=collections.deque)
    #: Ended by the daemon: its step in flight is answered but commits nothing.
    closed: bool = False


@dataclass(slots=True)
class StreamStep:
    """What the broker needs of a stream step beyond an ordinary request."""

    stream: OpenStream
    #: The client's own inputs (the state inputs are added when the step is released).
    inputs: tuple[TensorDesc, ...]
    end: bool
    return_state: bool
