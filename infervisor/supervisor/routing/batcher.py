"""Dynamic batching: which queued requests of a model go to a worker together, and when.

Requests are joined along dimension 0 only when everything else about their inputs matches (names,
dtypes, the other dims, and the spec that admitted them); each keeps its own id, deadline, retries
and reply. A batch is taken from the head of the model's queue, oldest first, up to
`max_batch_size` rows; with `preferred_batch_sizes` it is cut to the largest preferred size it
reaches. A worker with nothing in hand takes what waits at once: a core left idle costs more than a
batch made bigger. Only a batch headed for a worker that is already running one (with `prefetch`
above 1) waits, when it is short of a full (or preferred) batch, until its oldest request has waited
`max_queue_delay_us` for companions. A batch takes at most its share of the line (`share_of_line`:
the line divided among idle workers, or a long line's fair share among all of them) and goes at
once when it reaches it. A model without batching sends its oldest request alone: a batch of one.

`decide` is the one decision the broker asks for; `has_room` says which worker may take more.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import NamedTuple

from infervisor.protocol.constants import MAX_BATCH_REQUESTS
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.model_entry import BatchingConfig

#: The supervisor's loop waits in whole milliseconds: a batch due within half of one goes now, so a delay
#: is kept to about ±0.5 ms (rounding each wait up to a whole millisecond made 1000 us last about 1.5 ms).
_DUE_EARLY_S = 0.0005


def has_room(policy: BatchingConfig | None, prefetch: int, held: int, batches: int) -> bool:
    """True when a worker holding `held` requests in `batches` dispatches may take another.

    `prefetch` counts requests in hand; with batching it counts batches: one running and the next
    joined while it runs.
    """
    return (batches if policy is not None else held) < prefetch


def share_of_line(waiting: int, idle: int, serving_held: Sequence[int]) -> int | None:
    """The most requests the next batch may take, so that a line is spread over the model's workers (None: all).

    With several workers idle (`idle`), each takes the line divided among them. With one, a line
    longer than its fair share (the model's requests, waiting and held by its serving workers,
    divided among those workers) is cut there: otherwise under load the first worker to free up
    takes the whole line, and from then on one worker runs a huge batch while the others serve the
    few requests that come back meanwhile, one by one (a convoy: encoder int8, 2 workers, 32
    clients, batches of 30 beside batches of 1, p99 1.3 s).
    """
    if idle > 1:
        return -(-waiting // idle)
    if len(serving_held) < 2:
        return None
    fair = -(-(waiting + sum(serving_held)) // len(serving_held))
    return fair if fair < waiting else None


def decide(
    queue: collections.deque[PendingRequest],
    policy: BatchingConfig | None,
    now: float,
    share: Callable[[], int | None],
    *,
    worker_busy: bool,
) -> Decision:
    """What goes to the picked worker now (removed from `queue`), or until when the head waits for companions.

    `share` is asked only with batching (it walks the model's workers).
    """
    if policy is None:
        return Decision([queue.popleft()])
    return take(queue, policy, now, share(), worker_busy=worker_busy)


def may_wait(policy: BatchingConfig, worker_busy: bool) -> bool:
    """True when a batch short of full may wait for companions: only one for a busy worker, and only with a delay."""
    return worker_busy and policy.max_queue_delay_us > 0


def is_due(wait_until: float, now: float) -> bool:
    """True once a waiting batch may go: its due time is reached, or less than _DUE_EARLY_S away."""
    return now >= wait_until - _DUE_EARLY_S


class Decision(NamedTuple):
    """What to do with the head of a queue now: send these requests, or wait until `wait_until`."""

    batch: list[PendingRequest]
    wait_until: float | None = None


def joinable(a: PendingRequest, b: PendingRequest) -> bool:
    """True when two requests' inputs may be joined along dim 0 (same names, dtypes, other dims and spec)."""
    return a.spec is b.spec and a.shape_key == b.shape_key


def take(
    queue: collections.deque[PendingRequest],
    policy: BatchingConfig,
    now: float,
    share: int | None = None,
    *,
    worker_busy: bool,
) -> Decision:
    """The batch to send from the head of `queue` (removed from it), or until when the head may still wait.

    Requests that cannot join the head stay in line, in order, for a later batch. `share` caps the
    requests taken: a batch that reaches it is full, and goes at once. Only a batch for a busy
    worker (`worker_busy`: it already holds one) may wait for companions.
    """
    head = queue[0]
    # A batch that killed its worker was split: its halves never grow back (the broker bisects them).
    limit = min(head.batch_limit or MAX_BATCH_REQUESTS, MAX_BATCH_REQUESTS, share or MAX_BATCH_REQUESTS)
    members: list[int] = []
    rows = 0
    for index, request in enumerate(queue):
        if len(members) >= limit or rows >= policy.max_batch_size:
            break
        if index and not joinable(head, request):
            continue
        if members and rows + request.rows > policy.max_batch_size:
            break
        members.append(index)
        rows += request.rows
    full = rows >= policy.max_batch_size or len(members) >= limit
    at_preferred = rows in policy.preferred_batch_sizes
    deadline = head.accepted_at + policy.max_queue_delay_us / 1e6
    if not full and not at_preferred and may_wait(policy, worker_busy) and not is_due(deadline, now):
        return Decision([], deadline)
    chosen = _cut(members, [queue[i].rows for i in members], policy.preferred_batch_sizes)
    if chosen[-1] == len(chosen) - 1:  # the usual case: the batch is the head of the line
        return Decision([queue.popleft() for _ in chosen])
    batch = [queue[i] for i in chosen]
    taken = set(chosen)
    kept = [r for i, r in enumerate(queue) if i not in taken]
    queue.clear()
    queue.extend(kept)
    return Decision(batch)


def _cut(members: list[int], rows: list[int], preferred: Sequence[int]) -> list[int]:
    """The longest prefix of the members whose rows add up to the largest preferred size reached, else all."""
    target = max((p for p in preferred if p <= sum(rows)), default=0)
    total = 0
    for count, size in enumerate(rows, start=1):
        total += size
        if total == target:
            return members[:count]
    return members
