"""pick "fastest" (interleaved rounds, a switch only beyond the noise) and the batch buckets of packaged profiles."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infervisor.common.cpuinfo import read_caps
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.models import build_builtin
from infervisor.worker.profiles.dispatch import BatchBuckets, ShapeNotServed, at_batch, batch_only, buckets_for
from infervisor.worker.profiles.pick_record import timed_batches
from infervisor.worker.profiles.select import select_profile
from infervisor.worker.profiles.timing import MIN_MARGIN, Contender, Rounds, decide, describe, noise_of, run_rounds
from infervisor.worker.profiles.validate import Tolerance
from infervisor.worker.runner import ModelRunner
from infervisor.worker.start import build_context


def _rounds(per_sample_ms: dict[str, list[float]], batches: tuple[int, ...] = (1,)) -> Rounds:
    """Rounds with the same series at every batch size."""
    return Rounds(batches, {name: dict.fromkeys(batches, series) for name, series in per_sample_ms.items()})


def test_a_later_profile_serves_only_when_faster_than_the_noise() -> None:
    """1% faster every round: the chain's first serves; 20% faster: the later one does; the reason says which."""
    steady = [10.0, 10.2, 9.9, 10.1, 10.0, 10.3, 9.8, 10.0]
    close = decide(["a", "b"], _rounds({"a": steady, "b": [x * 0.99 for x in steady]}))
    assert (close.profile, close.fastest) == ("a", "b")
    assert close.noise["b"] == MIN_MARGIN and "b did not beat a beyond the spread" in close.reason
    far = decide(["a", "b"], _rounds({"a": steady, "b": [x * 0.8 for x in steady]}))
    assert far.profile == "b" and far.ratios["a"] == pytest.approx(1.25)
    assert "b beat a head to head (x0.800" in far.reason


def test_noisy_rounds_keep_the_chains_order_where_steady_ones_would_not() -> None:
    """The same 10% median gain: kept when the per-round ratios agree, overruled when they scatter."""
    base = [10.0] * 9
    steady = decide(["a", "b"], _rounds({"a": base, "b": [9.0, 9.1, 8.9, 9.0, 9.05, 8.95, 9.0, 9.1, 8.9]}))
    assert steady.profile == "b"
    scattered = [5.0, 13.0, 9.0, 6.0, 14.0, 9.0, 4.0, 12.0, 9.0]
    noisy = decide(["a", "b"], _rounds({"a": base, "b": scattered}))
    assert noisy.ratios["a"] == pytest.approx(10.0 / 9.0) and noisy.noise["b"] > 0.11
    assert noisy.profile == "a"


def test_the_earliest_profile_within_the_noise_of_the_fastest_serves() -> None:
    """a is 30% slower than c, b 1% slower: b serves (earlier than c, as fast within the noise)."""
    base = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8]
    decision = decide(
        ["a", "b", "c"], _rounds({"a": [x * 1.3 for x in base], "b": [x * 1.01 for x in base], "c": base})
    )
    assert (decision.profile, decision.fastest) == ("b", "c")


def test_a_noisy_slower_profile_never_wins_over_a_faster_earlier_one() -> None:
    """a steady, b three times slower but scattered (within its wide noise of the fastest), c faster than a: c serves,
    and b, which the former rule served as "first in the chain within the noise", is never named."""
    base = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1]
    scattered = [5.0, 60.0, 30.0, 8.0, 55.0, 30.0, 6.0, 50.0]
    decision = decide(["a", "b", "c"], _rounds({"a": [x * 1.5 for x in base], "b": scattered, "c": base}))
    assert decision.profile == "c" and decision.fastest == "c"
    assert "b did not beat a" in decision.reason and "c beat a head to head" in decision.reason
    steady_first = decide(["a", "b"], _rounds({"a": base, "b": scattered}))
    assert steady_first.profile == "a" and "first in the chain" in steady_first.reason


def test_the_score_weighs_every_served_batch_size() -> None:
    """Equal at batch 1, twice as fast per sample at batch 8: the batched gain decides (geometric mean)."""
    one = [10.0, 10.1, 9.9, 10.0, 10.0, 10.1]
    rounds = Rounds((1, 8), {"a": {1: one, 8: one}, "b": {1: one, 8: [x / 2 for x in one]}})
    decision = decide(["a", "b"], rounds)
    assert decision.profile == "b" and decision.ratios["a"] == pytest.approx(2**0.5)
    assert decision.per_sample_ms["b"] == {1: pytest.approx(10.0), 8: pytest.approx(5.0)}


def test_noise_needs_rounds_and_shrinks_with_them() -> None:
    """Under four rounds nothing is known; the notch shrinks as sqrt(n) for the same scatter."""
    assert noise_of([1.0, 1.1, 0.9]) == float("inf")
    assert noise_of([0.9, 1.1] * 2) > noise_of([0.9, 1.1] * 8) > 0


def test_rounds_interleave_and_rotate_every_candidate_at_every_batch() -> None:
    """Each round runs each candidate once per batch size, after installing it, starting one further along."""
    calls: list[str] = []

    def contender(name: str) -> Contender:
        def call(batch: int) -> Callable[[], object]:
            return lambda: calls.append(f"{name}{batch}")

        return Contender(name, lambda: calls.append(f"install {name}"), {b: call(b) for b in (1, 8)})

    rounds = run_rounds([contender("a"), contender("b"), contender("c")], budget_s=0.0, min_rounds=3, max_rounds=3)
    assert rounds.count == 3 and set(rounds.per_sample_ms) == {"a", "b", "c"}
    timed = [c for c in calls if not c.startswith("install")]
    installs = [c.split()[1] for c in calls if c.startswith("install")]
    # The warm-ups install each candidate once per batch size, then each round installs it once.
    assert installs[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # Two warm calls per candidate and size, then slots of repeated calls: one slot per candidate and size.
    slots = [name for name, _ in itertools.groupby(timed[12:])]
    assert slots == [f"{n}{b}" for order in ("abc", "bca", "cab") for n in order for b in (1, 8)]


def _tiny_runner() -> ModelRunner:
    return ModelRunner(build_builtin("tiny"), (TensorSpec("x", "float32", (None, 16)),), ("y",))


def test_pick_fastest_records_the_rounds_noise_and_reason_and_reuses_them(tmp_path: Path) -> None:
    """pick=fastest times eager and jit at batch 1 and 8, writes the figures into notes and the decision file."""
    runner = _tiny_runner()
    launch = LaunchSpec(
        "t", "tiny", -1, ModelSource("builtin", "tiny"), runner.specs, ("y",), (0,), 1,
        profiles=("eager", "jit"), pick="fastest", cache_dir=str(tmp_path),
    )  # fmt: skip
    first = select_profile(runner, ("eager", "jit"), Tolerance(), read_caps(), build_context(launch, runner), "fastest")
    summary = first.notes[-1]
    threads = torch.get_num_threads()
    assert summary.startswith("fastest pick over ") and f"at batch 1 and 8, {threads} thread(s)" in summary, summary
    (other,) = {"eager", "jit"} - {first.profile}
    assert first.skipped == [s for s in first.skipped if s.startswith(f"{other}: passed (cosine ")] and first.skipped
    (decision_file,) = tmp_path.glob("pick-*.json")
    record = json.loads(decision_file.read_text())
    assert record["profile"] == first.profile and record["rounds"] >= 6 and record["batches"] == [1, 8]
    assert set(record["per_sample_ms"]) == {"eager", "jit"} and set(record["noise"]) == {"eager", "jit"}
    again_runner = _tiny_runner()
    again = select_profile(
        again_runner, ("eager", "jit"), Tolerance(), read_caps(), build_context(launch, again_runner), "fastest"
    )
    assert again.profile == first.profile and again.notes[-1] == f"{summary} (decided earlier, {decision_file.name})"


def test_timed_batches_are_the_buckets_and_the_batching_sizes_inside_the_bounds() -> None:
    """A dynamic batch is timed at 1, 8 and the broker's sizes; bounds move the buckets; other dims: 1 only."""
    free = (TensorSpec("x", "float32", (None, 16)),)
    assert timed_batches(free) == (1, 8) and timed_batches(free, (4, 32)) == (1, 4, 8, 32)
    bounded = (TensorSpec("x", "float32", (None, 16), bounds=((2, 6), None)),)
    assert buckets_for(bounded) == (2, 6) and timed_batches(bounded, (4, 8)) == (2, 4, 6)
    assert timed_batches((TensorSpec("x", "float32", (1, 16)),)) == (1,)
    assert timed_batches((TensorSpec("ids", "int64", (None, None)),), (8,)) == (1,)
    assert not batch_only((TensorSpec("x", "float32", (None, 16)), TensorSpec("m", "float32", (4, 16))))


class _Package:
    """Stands in for a compiled static package: refuses any batch but its own, and records its calls."""

    def __init__(self, size: int, calls: list[int]) -> None:
        self.size, self.calls = size, calls
        self.module = build_builtin("tiny")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.size or not x.is_contiguous():
            raise ValueError(f"package for batch {self.size} got {list(x.shape)}")
        self.calls.append(self.size)
        out: torch.Tensor = self.module(x)
        return out


def test_buckets_serve_every_size_like_eager_splitting_or_padding_by_cost() -> None:
    """Batch 8 cheap (3 calls' worth): 1-3 rows run as singles, 4-8 padded to one 8, 19 as 8+8 and 3 singles."""
    calls: list[int] = []
    buckets = BatchBuckets({1: _Package(1, calls), 8: _Package(8, calls)}, {1: 1.0, 8: 3.0})
    assert [buckets.plan(n) for n in (1, 3, 4, 8)] == [(1,), (1, 1, 1), (8,), (8,)]
    assert buckets.plan(19) == (8, 8, 1, 1, 1)
    eager = build_builtin("tiny")
    x = torch.randn(19, 16, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 7, 8, 9, 19):
            calls.clear()
            torch.testing.assert_close(buckets(x[:rows]), eager(x[:rows]))
            assert calls == list(buckets.plan(rows)), rows


def test_buckets_never_batch_when_a_batch_costs_more_per_row() -> None:
    """Batch 8 dearer than eight singles (a tiny model): every size runs as batch-1 calls."""
    buckets = BatchBuckets({1: _Package(1, []), 8: _Package(8, [])}, {1: 1.0, 8: 9.0})
    assert buckets.plan(8) == (1,) * 8 and buckets.plan(20) == (1,) * 20


def test_a_bounded_batch_is_served_from_buckets_inside_its_bounds() -> None:
    """Buckets 2 and 6 (a batch bounded to 2..6): 2 as is, 3 padded to 6 or run as 2+2 by cost, 6 as is."""
    calls: list[int] = []
    buckets = BatchBuckets({2: _Package(2, calls), 6: _Package(6, calls)}, {2: 1.0, 6: 1.5})
    assert [buckets.plan(n) for n in (2, 3, 5, 6)] == [(2,), (6,), (6,), (6,)]
    eager = build_builtin("tiny")
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        for rows in (2, 3, 5, 6):
            torch.testing.assert_close(buckets(x[:rows]), eager(x[:rows]))
    assert BatchBuckets({2: _Package(2, []), 6: _Package(6, [])}, {2: 1.0, 6: 4.0}).plan(4) == (2, 2)


def test_buckets_refuse_inputs_of_different_batches_and_outputs_without_a_batch() -> None:
    """Two inputs with 2 and 3 rows are an error, and an output whose first dim is not the batch a shape the
    package does not serve (the worker answers it with eager): neither is garbage."""
    two = BatchBuckets({1: lambda a, b: a + b, 8: lambda a, b: a + b}, {1: 1.0, 8: 2.0})
    with pytest.raises(ValueError, match="share a non-empty batch"):
        two(torch.zeros(2, 4), torch.zeros(3, 4))
    summed = BatchBuckets({1: lambda a: a.sum(), 8: lambda a: a.sum()}, {1: 1.0, 8: 2.0})
    with pytest.raises(ShapeNotServed, match="does not carry the batch"):
        summed(torch.zeros(5, 4))


def test_padding_copies_a_real_row_and_keeps_channels_last() -> None:
    """at_batch pads with the first row (never zeros) and keeps an NHWC input NHWC."""
    image = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    padded = at_batch((image,), 5)[0]
    assert padded.shape[0] == 5 and padded.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(padded[2:], image[:1].expand(3, 3, 4, 4))
    mask = torch.ones(1, 6, dtype=torch.int64)
    assert at_batch((mask,), 8)[0].sum().item() == 48


def test_the_pick_note_figures_agree_with_its_medians() -> None:
    """A candidate slower at every batch size reads as slower (ratio above 1) even when most per-round ratios favour
    it; the one its medians say is fastest is x1.000 and no candidate is below it."""
    # b loses rounds 1-2 by far and wins rounds 3-5 narrowly: its per-round median ratio is below 1, its medians higher.
    a = [1.0, 1.0, 1.0, 10.0, 10.0]
    b = [2.0, 2.0, 0.9, 9.0, 9.0]
    decision = decide(["a", "b"], Rounds((1, 8), {"a": {1: a, 8: a}, "b": {1: b, 8: b}}))
    assert all(decision.per_sample_ms["b"][n] > decision.per_sample_ms["a"][n] for n in (1, 8))
    assert decision.fastest == "a" and decision.ratios["a"] == 1.0
    assert decision.ratios["b"] == pytest.approx(2.0) and min(decision.ratios.values()) == 1.0
    note = describe(decision, 1)
    assert "a 1/1 ms (x1.000); b 2/2 ms (x2.000)" in note
