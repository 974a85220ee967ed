"""The batcher's decisions on a queue: which requests go together, which stay in line, and when a batch waits."""

from __future__ import annotations

import collections

from infervisor.supervisor.routing.batcher import decide, has_room, share_of_line, take
from infervisor.supervisor.routing.pending import PendingRequest
from infervisor.supervisor.settings.model_entry import BatchingConfig

WIDE = (("x", "float32", (16,)),)
NARROW = (("x", "float32", (8,)),)


def _queue(*shapes: tuple[tuple[str, str, tuple[int, ...]], ...], rows: int = 1) -> collections.deque[PendingRequest]:
    """Requests accepted 1 ms apart from t=0, one per shape key given, in line in that order."""
    return collections.deque(
        PendingRequest(i, (None, b"c"), i, "m", [], accepted_at=i / 1000, deadline=None, rows=rows, shape_key=key)
        for i, key in enumerate(shapes)
    )


def _policy(max_batch: int = 8, delay_us: int = 0, preferred: tuple[int, ...] = ()) -> BatchingConfig:
    return BatchingConfig(max_batch, delay_us, preferred)


def test_the_head_of_the_line_goes_together_up_to_the_maximum_and_the_rest_waits_in_order() -> None:
    """Ten joinable single-row requests and a maximum of 8: the oldest 8 go, the other 2 keep their order."""
    queue = _queue(*[WIDE] * 10)
    decision = take(queue, _policy(max_batch=8), now=1.0, worker_busy=True)
    assert [r.internal_id for r in decision.batch] == list(range(8)) and decision.wait_until is None
    assert [r.internal_id for r in queue] == [8, 9]


def test_requests_that_cannot_join_the_head_stay_in_line_in_their_order() -> None:
    """Other dims than the head's are skipped, not reordered: they lead the next batch."""
    queue = _queue(WIDE, NARROW, WIDE, NARROW, WIDE)
    decision = take(queue, _policy(), now=1.0, worker_busy=True)
    assert [r.internal_id for r in decision.batch] == [0, 2, 4]
    assert [r.internal_id for r in queue] == [1, 3]
    assert [r.internal_id for r in take(queue, _policy(), now=1.0, worker_busy=True).batch] == [1, 3] and not queue


def test_a_batch_is_cut_to_the_largest_preferred_size_it_reaches() -> None:
    """Six waiting with preferred sizes 2 and 4: four go (the largest reached), two stay for the next batch."""
    queue = _queue(*[WIDE] * 6)
    decision = take(queue, _policy(preferred=(2, 4)), now=1.0, worker_busy=True)
    assert len(decision.batch) == 4 and len(queue) == 2


def test_rows_count_against_the_maximum_not_requests() -> None:
    """Requests of 3 rows each and a maximum of 8 rows: two go together (6 rows), a third would make 9."""
    queue = _queue(WIDE, WIDE, WIDE, rows=3)
    assert len(take(queue, _policy(max_batch=8), now=1.0, worker_busy=True).batch) == 2 and len(queue) == 1


def test_short_of_a_full_batch_for_a_busy_worker_the_oldest_waits_its_delay_then_goes_with_what_is_there() -> None:
    """Two waiting, a maximum of 8, 2 ms of delay, a busy worker: they wait until the oldest's 2 ms are up, then go."""
    queue = _queue(WIDE, WIDE)
    waiting = take(queue, _policy(delay_us=2000), now=0.001, worker_busy=True)
    assert waiting.batch == [] and waiting.wait_until == 0.002 and len(queue) == 2
    # The loop polls in whole milliseconds: within half of one of its due time, a batch is due.
    assert len(take(queue, _policy(delay_us=2000), now=0.0016, worker_busy=True).batch) == 2 and not queue


def test_a_worker_with_nothing_in_hand_takes_what_waits_without_waiting_out_the_delay() -> None:
    """The same two and a 10 s delay, but the worker is idle: both go at once, an idle core beats a bigger batch."""
    queue = _queue(WIDE, WIDE)
    decision = take(queue, _policy(delay_us=10_000_000), now=0.001, worker_busy=False)
    assert [r.internal_id for r in decision.batch] == [0, 1] and decision.wait_until is None and not queue


def test_a_split_batchs_half_never_grows_back() -> None:
    """A request whose batch killed a worker carries a limit: it goes with at most that many, however many wait."""
    queue = _queue(*[WIDE] * 6)
    queue[0].batch_limit = 2
    assert [r.internal_id for r in take(queue, _policy(), now=1.0, worker_busy=True).batch] == [0, 1]


def test_a_share_caps_the_batch_and_a_batch_at_its_share_goes_without_waiting() -> None:
    """With a share of 3 (several idle workers), three go at once despite the delay; the rest wait for the next."""
    queue = _queue(*[WIDE] * 5)
    decision = take(queue, _policy(delay_us=10_000_000), now=0.01, share=3, worker_busy=True)
    assert [r.internal_id for r in decision.batch] == [0, 1, 2] and decision.wait_until is None
    assert [r.internal_id for r in queue] == [3, 4]


def test_a_model_without_batching_sends_its_oldest_request_alone() -> None:
    """No batching policy: the decision is a batch of one, the head of the line, and it never waits."""
    queue = _queue(WIDE, WIDE, WIDE)
    decision = decide(queue, None, now=1.0, share=lambda: None, worker_busy=True)
    assert [r.internal_id for r in decision.batch] == [0] and decision.wait_until is None and len(queue) == 2


def test_prefetch_counts_requests_without_batching_and_batches_with_it() -> None:
    """Prefetch 2: three requests in one batch leave room with batching, two lone ones do not without."""
    assert has_room(_policy(), prefetch=2, held=3, batches=1)
    assert not has_room(None, prefetch=2, held=2, batches=2)


def test_a_line_is_shared_among_idle_workers_and_a_long_one_cut_at_its_fair_share() -> None:
    """10 waiting, 3 idle: 4 each; one idle of two busy ones holding 1: 11 over 2 is 6; one worker: no cap."""
    assert share_of_line(10, idle=3, serving_held=[0, 0, 0]) == 4
    assert share_of_line(10, idle=1, serving_held=[1, 0]) == 6
    assert share_of_line(10, idle=1, serving_held=[0]) is None
