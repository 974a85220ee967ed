"""What the gate's verdict rests on: how many samples, the margin of the worst row to the tolerance, and whether
that margin is thinner than the spread between the samples (then an unseen input can plausibly fall below it).

A pass by 0.00015 of cosine on 16 samples whose cosines spread by 0.0003 says little: the next input is as likely
to land below the tolerance as the worst sample was to land above it. Such a pass still serves (the tolerance is
the operator's), with a warning in status that says what to do: add validation data, or tighten the tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def spread(values: Sequence[float]) -> float:
    """How far apart the rows' figures are: the best minus the worst (0 with fewer than two).

    The range, not a standard deviation: the worst sample is what set the margin, and the question is whether an
    unseen input could land as far from the rest again.
    """
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) - min(finite) if len(finite) > 1 else 0.0


@dataclass(frozen=True)
class Evidence:
    """The margins of the worst row to the tolerance and the spread of the rows, per measure."""

    samples: int
    cosine_margin: float
    cosine_spread: float
    min_cosine: float
    #: None: no output was judged by its relative error.
    relative_margin: float | None = None
    relative_spread: float = 0.0
    max_rel_error: float | None = None

    def text(self) -> str:
        """`passed by 0.00015 of cosine (min_cosine 0.999) on 16 samples, rows spread 0.0003`."""
        parts = [f"passed by {self.cosine_margin:.2g} of cosine (min_cosine {self.min_cosine})"]
        if self.relative_margin is not None:
            parts.append(f"by {self.relative_margin:.2g} of relative error (max_rel_error {self.max_rel_error})")
        spreads = f"rows' cosines spread {self.cosine_spread:.2g}"
        if self.relative_margin is not None:
            spreads += f", relative errors {self.relative_spread:.2g}"
        return f"{' and '.join(parts)} on {self.samples} samples ({spreads})"

    def warning(self) -> str | None:
        """`passed by 0.00015 on 16 samples: add validation data or tighten (...)` when a margin is thinner than the
        spread between samples; None when every margin is wider."""
        thin: list[str] = []
        if self.cosine_margin < self.cosine_spread:
            thin.append(
                f"cosine passed by {self.cosine_margin:.2g} (min_cosine {self.min_cosine}) while the rows' cosines "
                f"spread {self.cosine_spread:.2g}"
            )
        if self.relative_margin is not None and self.relative_margin < self.relative_spread:
            thin.append(
                f"relative error passed by {self.relative_margin:.2g} (max_rel_error {self.max_rel_error}) while the "
                f"rows' errors spread {self.relative_spread:.2g}"
            )
        if not thin:
            return None
        margin = self.cosine_margin if self.cosine_margin < self.cosine_spread else self.relative_margin or 0.0
        return (
            f"passed by {margin:.2g} on {self.samples} samples: add validation data or tighten the tolerance "
            f"({'; '.join(thin)}: an input the gate did not see can fall below it)"
        )


def sample_count(cases: Sequence[object]) -> int:
    """Distinct samples behind the gate's cases: each sample once however many batches it joined, and each
    synthetic probe input (one per drawn shape) as one."""
    seen: set[tuple[str, int]] = set()
    probes = 0
    for case in cases:
        kind, rows = str(getattr(case, "kind", "")), tuple(getattr(case, "rows", ()))
        if kind == "synthetic input":
            probes += 1
        else:
            seen.update((kind, row) for row in rows)
    return len(seen) + probes
