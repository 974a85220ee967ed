"""How pick "fastest" times its candidates and decides: interleaved rounds, and a switch only beyond the noise.

Timing each candidate once, one after another, lets a burst of load on the box decide: on a shared
machine profiles within 10-20% of each other swapped places from one start to the next. So every
round runs each candidate once at every batch size the model will serve (A B C, then B C A, ...),
a candidate's speed is the geometric mean over those sizes of its median per-sample time, and its
ratio to the fastest is the ratio of those speeds: the very medians the build note prints, so a
candidate slower at every size never reads as faster. Each candidate is also compared with the
fastest round by round (load that slows a round slows everyone in it); the spread of those
per-round ratios says how well the ratio is known, and the chain's order (the operator's
preference) is overruled only beyond it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

#: A difference smaller than this is never worth overruling the chain's order (cache warmth, clocks).
MIN_MARGIN = 0.03
#: Each timed slot runs long enough that the timer and the call overhead do not decide (tiny models).
_SLOT_MS = 2.0
_MAX_CALLS = 500


@dataclass(frozen=True)
class Contender:
    """One candidate as the timing sees it: how to make it the one that runs, and one call per batch size."""

    name: str
    #: Installs the candidate (its module and process-wide flags); outside the timed part.
    install: Callable[[], None]
    #: One forward pass at each served batch size.
    run_at: Mapping[int, Callable[[], object]]


@dataclass(frozen=True)
class Rounds:
    """Per-sample milliseconds of every candidate at every batch size, one value per round."""

    batches: tuple[int, ...]
    per_sample_ms: dict[str, dict[int, list[float]]]

    @property
    def count(self) -> int:
        """How many complete rounds were run."""
        first = next(iter(self.per_sample_ms.values()))
        return len(first[self.batches[0]])

    def scores(self, name: str) -> list[float]:
        """The candidate's score per round: the geometric mean of its per-sample times over the batch sizes."""
        series = [self.per_sample_ms[name][b] for b in self.batches]
        return [math.exp(statistics.fmean(math.log(ms) for ms in values)) for values in zip(*series, strict=True)]

    def median_ms(self, name: str) -> dict[int, float]:
        """The candidate's median per-sample time at each batch size."""
        return {b: statistics.median(self.per_sample_ms[name][b]) for b in self.batches}

    def speed_ms(self, name: str) -> float:
        """The geometric mean over the batch sizes of the candidate's median per-sample times."""
        return math.exp(statistics.fmean(math.log(ms) for ms in self.median_ms(name).values()))


@dataclass(frozen=True)
class Decision:
    """What pick "fastest" serves and why, with the figures it decided on."""

    profile: str
    fastest: str
    rounds: int
    batches: tuple[int, ...]
    #: Median per-sample milliseconds by candidate and batch size.
    per_sample_ms: dict[str, dict[int, float]]
    #: Each candidate's speed over the fastest's (1.0 for the fastest itself, never below 1): the geometric mean over
    #: the batch sizes of its medians in `per_sample_ms`, over the same of the fastest's.
    ratios: dict[str, float]
    #: The spread of each later candidate's per-round ratios to the profile chosen before it (the notch, at least
    #: MIN_MARGIN): how much faster it had to be to win (0.0 for the first).
    noise: dict[str, float]
    reason: str


def run_rounds(
    contenders: Sequence[Contender],
    budget_s: float,
    min_rounds: int,
    max_rounds: int,
    guard: Callable[[str], AbstractContextManager[object]] = lambda name: nullcontext(),
) -> Rounds:
    """Interleaved rounds until the budget is spent (at least min_rounds, at most max_rounds).

    `guard(name)` is entered around each candidate's turn (the worker marks the profile there, so a
    native crash while timing is blamed on the one that was running).
    """
    batches = tuple(sorted(contenders[0].run_at))
    calls: dict[str, dict[int, int]] = {}
    for contender in contenders:
        with guard(contender.name):
            calls[contender.name] = {b: _calls_per_slot(contender, b) for b in batches}
    samples: dict[str, dict[int, list[float]]] = {c.name: {b: [] for b in batches} for c in contenders}
    stop = time.perf_counter() + budget_s
    done = 0
    while done < min_rounds or (done < max_rounds and time.perf_counter() < stop):
        # Rotated each round: a candidate is not always the one that runs right after another's allocations.
        order = [*contenders[done % len(contenders) :], *contenders[: done % len(contenders)]]
        for contender in order:
            with guard(contender.name):
                contender.install()
                for batch in batches:
                    run, count = contender.run_at[batch], calls[contender.name][batch]
                    started = time.perf_counter()
                    for _ in range(count):
                        run()
                    samples[contender.name][batch].append((time.perf_counter() - started) * 1000.0 / count / batch)
        done += 1
    return Rounds(batches, samples)


def _calls_per_slot(contender: Contender, batch: int) -> int:
    """Calls per timed slot (after two warm calls: the first of a shape may compile or allocate)."""
    contender.install()
    run = contender.run_at[batch]
    run()
    started = time.perf_counter()
    run()
    once_ms = (time.perf_counter() - started) * 1000.0
    return max(1, min(_MAX_CALLS, math.ceil(_SLOT_MS / max(once_ms, 1e-6))))


def noise_of(ratios: Sequence[float]) -> float:
    """How uncertain the median of per-round ratios is: the notch of a box plot, 1.57 IQR / sqrt(n).

    (McGill, Tukey and Larsen's notch: two medians whose notches do not overlap differ at about 95%.)
    """
    if len(ratios) < 4:
        return float("inf")
    quartiles = statistics.quantiles(ratios, n=4)
    return 1.57 * (quartiles[2] - quartiles[0]) / math.sqrt(len(ratios))


def decide(chain: Sequence[str], rounds: Rounds) -> Decision:
    """Walk the chain head to head: a later profile replaces the one chosen so far only when it is faster.

    The rule: candidates ran in the same rounds, turn about (run_rounds), so each round gives the later
    one's time over the earlier one's under the same load. The later one wins only when the median of
    those per-round ratios is below 1 by more than their spread (the notch, noise_of; at least
    MIN_MARGIN) and its median speed is faster too. So a noisy candidate never wins on a wide spread,
    and what serves is never one the figures show slower than the chain's earlier choice.
    """
    names = [n for n in chain if n in rounds.per_sample_ms]
    scores = {n: rounds.scores(n) for n in names}
    speeds = {n: rounds.speed_ms(n) for n in names}
    # The ratios are of the printed medians, so the fastest is the one they say is fastest (the chain breaks ties).
    fastest = min(names, key=lambda n: (speeds[n], names.index(n)))
    ratios = {name: speeds[name] / speeds[fastest] for name in names}
    noise: dict[str, float] = {}
    chosen = names[0]
    steps: list[str] = []
    for name in names[1:]:
        per_round = [mine / theirs for mine, theirs in zip(scores[name], scores[chosen], strict=True)]
        versus = statistics.median(per_round)
        spread = max(MIN_MARGIN, noise_of(per_round))
        noise[name] = spread
        if versus < 1.0 - spread and speeds[name] < speeds[chosen]:
            steps.append(f"{name} beat {chosen} head to head (x{versus:.3f}, spread ± {spread:.3f})")
            chosen = name
        else:
            steps.append(f"{name} did not beat {chosen} beyond the spread (x{versus:.3f}, spread ± {spread:.3f})")
    noise[names[0]] = 0.0
    first = "first in the chain" if chosen == names[0] else "the last to beat the chosen one"
    reason = f"{chosen} serves, {first}" + (f": {'; '.join(steps)}" if steps else "")
    if chosen != fastest:
        reason += f" ({fastest} was fastest by median, x{ratios[chosen]:.3f}, not beyond the spread)"
    return Decision(
        chosen,
        fastest,
        rounds.count,
        rounds.batches,
        {n: rounds.median_ms(n) for n in names},
        ratios,
        noise,
        reason,
    )


def describe(decision: Decision, threads: int, size: str = "") -> str:
    """One line for the worker's profile_build notes: each candidate's medians and its ratio to the fastest.

    The ratio is the geometric mean of the printed medians over the fastest's, so the figures support the decision.
    """
    sizes = " and ".join(str(b) for b in decision.batches)
    figures = "; ".join(
        f"{name} {'/'.join(f'{ms:.3g}' for ms in by_batch.values())} ms (x{decision.ratios[name]:.3f})"
        for name, by_batch in sorted(decision.per_sample_ms.items(), key=lambda item: decision.ratios[item[0]])
    )
    return (
        f"fastest pick over {decision.rounds} interleaved rounds at batch {sizes}, {threads} thread(s), "
        f"{f'inputs {size}, ' if size else ''}"
        f"per sample: {figures}; {decision.reason}"
    )
