"""Serve-time dispatch of packaged profiles: which compiled package runs an input, by its shapes.

A batch-only spec is served by static packages per batch bucket (BatchBuckets: a batch runs as the
cheapest plan of bucket runs, by measured costs); a spec with another dynamic dim by one package for
the example's exact shapes and a dynamic one for the rest (ShapeDispatch). A shape neither serves is
refused as ShapeNotServed, which the worker serves with eager (coverage.Covered).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.export_dims import export_low
from infervisor.worker.profiles.timing import MIN_MARGIN, Contender, noise_of, run_rounds

Inputs = tuple[torch.Tensor, ...]


class ShapeNotServed(Exception):
    """A compiled profile does not serve these input shapes: the daemon's own limit, never the model's error.

    The worker serves such a request, and that shape from then on, with eager (coverage.Covered); the
    gate does the same, so it is never a client's error nor a profile's crash.
    """


class ShapeDispatch:
    """The package compiled for exactly the example's shapes when the inputs have them, else the dynamic one.

    Only for specs with a dynamic dim besides the batch (a sequence length): a batch-only spec gets
    BatchBuckets. The dynamic package was exported from size 2 (export specialises a 1), so a batch of
    one row runs in it padded to two rows and cut back; a size of 1 in another dynamic dim (a single step
    in a dim in steps: below export_low) is served only at the example's shapes (ShapeNotServed otherwise).
    """

    def __init__(self, static: Any, static_shapes: list[tuple[int, ...]], dynamic: Any, specs: Sequence[TensorSpec]):
        self.static = static
        self.static_shapes = static_shapes
        self.dynamic = dynamic
        #: Each input's dynamic dims with the smallest size the dynamic package takes there.
        self.dynamic_dims = [[(i, 2 if i == 0 else export_low(s, i)) for i, d in enumerate(s.shape) if d is None]
                             for s in specs]  # fmt: skip

    def __call__(self, *inputs: torch.Tensor) -> Any:
        shapes = [tuple(t.shape) for t in inputs]
        if shapes == self.static_shapes:
            return self.static(*inputs)
        ones = {i for shape, dims in zip(shapes, self.dynamic_dims, strict=True) for i, low in dims if shape[i] < low}
        if ones - {0}:
            raise ShapeNotServed(
                f"this compiled profile serves a size below the dynamic program's (1, or a single step) in a dynamic "
                f"dim only at shapes {self.static_shapes}"
            )
        if not ones:
            return self.dynamic(*inputs)
        result = self.dynamic(*at_batch(tuple(inputs), 2))
        outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        if any(output.dim() == 0 or output.shape[0] != 2 for output in outputs):
            raise ShapeNotServed("this compiled profile serves one row only at the example's shapes")
        cut = tuple(output[:1] for output in outputs)
        return cut[0] if len(cut) == 1 else cut


#: The batch sizes a packaged profile is compiled for when the batch is the spec's only dynamic dim. A
#: static package is several times faster than a dynamic one (int8 ResNet-50: 11 against 106 ms at
#: batch 1), so every size is served by static packages: 1 for single requests, 8 for batches. Each
#: bucket is one compile (20-60 s on a core), so two keep the first start where one static and one
#: dynamic package had it; sizes in between are split or padded, whichever the measured costs say.
BATCH_BUCKETS = (1, 8)
#: Measuring what each bucket costs (once per package and thread count): interleaved rounds for this
#: long, at least and at most so many (a noisy box needs the rounds to tell a 20% gain from its noise).
_COST_S = 3.0
_COST_ROUNDS = (8, 40)


def batch_only(specs: Sequence[TensorSpec]) -> bool:
    """Whether every input's only dynamic dim is its first (the batch), so buckets can serve every size."""
    return all(s.shape and s.shape[0] is None and None not in s.shape[1:] for s in specs)


def batch_range(specs: Sequence[TensorSpec]) -> tuple[int, int | None]:
    """The batch sizes every input takes (the tightest of their bounds on dim 0; no upper bound: None)."""
    ranges = [s.dim_range(0) for s in specs]
    highs = [high for _, high in ranges if high is not None]
    return max(low for low, _ in ranges), min(highs) if highs else None


def buckets_for(specs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """BATCH_BUCKETS moved into the batch's declared bounds: the sizes the packages are compiled for.

    A bucket past the bounds would compile a size no request has (and an ExportedProgram source
    would refuse it); the smallest bucket then serves the smallest batch the model takes.
    """
    low, high = batch_range(specs)
    return tuple(sorted({max(low, bucket if high is None else min(bucket, high)) for bucket in BATCH_BUCKETS}))


def at_batch(inputs: Inputs, batch: int) -> Inputs:
    """The inputs padded (with copies of their first row) or cut to `batch` rows, in the memory format they had."""
    resized: list[torch.Tensor] = []
    for tensor in inputs:
        rows = tensor.shape[0]
        if rows < batch:
            # Copies of a real row, not zeros: an all-zero attention mask would make a softmax NaN.
            padded = torch.cat([tensor, tensor[:1].expand(batch - rows, *tensor.shape[1:])])
            resized.append(_like(padded, tensor))
        else:
            resized.append(_like(tensor[:batch], tensor))
    return tuple(resized)


def _like(tensor: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """`tensor` in `model`'s memory format: a package is compiled for the strides it was exported with."""
    if model.dim() == 4 and model.is_contiguous(memory_format=torch.channels_last):
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor.contiguous()


class BatchBuckets:
    """Static packages per batch bucket: a batch runs as a plan of bucket runs, the last one padded if need be.

    The plan is the cheapest by the measured cost of each bucket: with buckets 1 and 8, a batch of 3
    runs as three batch-1 calls when that is cheaper than one padded batch-8 call, and a batch of 19
    as two batch-8 calls and a remainder. So no size is slower per sample than single requests,
    which the measured costs guarantee even where a bigger batch is less efficient (tiny models).
    Outputs must carry the batch in their first dim: each is sliced back to the rows asked for.
    """

    def __init__(self, packages: Mapping[int, Callable[..., Any]], costs_ms: Mapping[int, float]) -> None:
        if not packages or sorted(packages) != sorted(costs_ms):
            raise ValueError(f"buckets {sorted(packages)} need a cost each, got {sorted(costs_ms)}")
        self.packages = dict(packages)
        self.costs_ms = dict(costs_ms)
        self.plans: dict[int, tuple[int, ...]] = {}

    @staticmethod
    def measure(packages: Mapping[int, Callable[..., Any]], example: Inputs) -> dict[int, float]:
        """Milliseconds per call of each bucket, on the example grown to its size, as the plan should count them.

        Timed in interleaved rounds (timing.py) and counted as the smallest bucket's median time the
        median per-round ratio, raised by its noise (at least MIN_MARGIN) for the bigger buckets: a
        batch is only run as one when it is cheaper per row by more than the box's noise can explain.
        """
        grown = {size: at_batch(example, size) for size in packages}

        def call(size: int) -> Callable[[], object]:
            run, inputs = packages[size], grown[size]
            return lambda: run(*inputs)

        contenders = [Contender(str(size), lambda: None, {1: call(size)}) for size in packages]
        with torch.inference_mode():
            rounds = run_rounds(contenders, _COST_S, *_COST_ROUNDS)
        single = rounds.per_sample_ms[str(min(packages))][1]
        costs: dict[int, float] = {}
        for size in packages:
            ratios = [mine / one for mine, one in zip(rounds.per_sample_ms[str(size)][1], single, strict=True)]
            ratio = statistics.median(ratios)
            # The noise relative to the ratio: a batch of 8 costing 5.2 +- 0.3 calls is 5.2 x 1.06.
            margin = 0.0 if size == 1 else max(MIN_MARGIN, noise_of([r / ratio for r in ratios]))
            costs[size] = statistics.median(single) * ratio * (1.0 + margin)
        return costs

    def plan(self, rows: int) -> tuple[int, ...]:
        """The buckets to run, in order, for a batch of `rows` (the last may be padded)."""
        cached = self.plans.get(rows)
        if cached is not None:
            return cached
        largest = max(self.packages)
        per_row = min(self.packages, key=lambda size: self.costs_ms[size] / size)
        # Beyond two of the largest bucket the best plan repeats: whole runs of the cheapest bucket per row.
        head = max(0, (rows - 2 * largest + per_row - 1) // per_row) if rows > 2 * largest else 0
        tail = rows - head * per_row
        cost = [0.0] * (tail + 1)
        choice = [0] * (tail + 1)
        for n in range(1, tail + 1):
            cost[n], choice[n] = min((self.costs_ms[s] + cost[max(0, n - s)], s) for s in self.packages)
        steps: list[int] = [per_row] * head
        n = tail
        while n > 0:
            steps.append(choice[n])
            n = max(0, n - choice[n])
        plan = tuple(sorted(steps, reverse=True))  # whole big runs first; only the last run is ever padded
        if len(self.plans) < 256:  # request sizes are few; a client sending every size cannot grow this
            self.plans[rows] = plan
        return plan

    def __call__(self, *inputs: torch.Tensor) -> Any:
        rows = {t.shape[0] for t in inputs}
        if len(rows) != 1 or 0 in rows:
            raise ValueError(f"inputs must share a non-empty batch (first) dim; they have {sorted(rows)}")
        (total,) = rows
        plan = self.plan(total)
        if len(plan) == 1 and plan[0] == total:
            return self.packages[total](*inputs)
        pieces: list[tuple[torch.Tensor, ...]] = []
        offset = 0
        for size in plan:
            take = min(size, total - offset)
            if take == 0:  # a tie in the costs left a run with nothing to do
                break
            chunk = tuple(t[offset : offset + take] for t in inputs)
            result = self.packages[size](*(at_batch(chunk, size) if take < size else chunk))
            outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
            for output in outputs:
                if output.dim() == 0 or output.shape[0] != size:
                    raise ShapeNotServed(
                        f"an output of shape {list(output.shape)} does not carry the batch ({size}) in its first dim"
                    )
            pieces.append(tuple(output[:take] for output in outputs))
            offset += take
        joined = tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))
        return joined[0] if len(joined) == 1 else joined
