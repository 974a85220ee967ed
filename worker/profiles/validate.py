"""Compares a profile's outputs on the golden inputs with the eager fp32 reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.accuracy import cosine_text


@dataclass(frozen=True)
class Tolerance:
    """How close to eager a profile must stay: cosine, and optionally max abs error and top-1 agreement."""

    min_cosine: float = 0.999
    max_abs_error: float | None = None
    top1: bool = False


@dataclass(frozen=True)
class Agreement:
    """Measured closeness of one profile to the reference on one golden input."""

    cosine: float
    max_abs_error: float
    top1_agree: bool
    #: The row of the batch with the lowest cosine, and the one with the largest absolute error.
    worst_row: int = 0
    error_row: int = 0
    #: Rows the cosine was taken over (1: the output was compared as one vector).
    rows: int = 1

    def failure(self, tolerance: Tolerance) -> str | None:
        """Why this misses the tolerance, or None when it meets it."""
        if not np.isfinite(self.max_abs_error):
            return "outputs are not finite or change shape"
        if self.cosine < tolerance.min_cosine:
            return f"cosine {cosine_text(self.cosine, tolerance.min_cosine)} < {tolerance.min_cosine}"
        if tolerance.max_abs_error is not None and self.max_abs_error > tolerance.max_abs_error:
            return f"max abs error {self.max_abs_error:.3g} > {tolerance.max_abs_error}"
        if tolerance.top1 and not self.top1_agree:
            return "top-1 differs from eager"
        return None


@dataclass(frozen=True)
class GoldenResult:
    """A profile against eager over every golden input: the worst row of all, and where each worst figure was."""

    cosine: float
    cosine_at: str
    max_abs_error: float
    error_at: str
    top1_agree: bool
    #: Where the argmax first differed ("" when it never did).
    top1_at: str
    #: What was checked, e.g. `8 validation samples, each alone and batched (8, 64)`.
    checked: str

    def failure(self, tolerance: Tolerance) -> str | None:
        """Why the worst row misses the tolerance (and where it is), or None when every row meets it."""
        if not np.isfinite(self.max_abs_error):
            return f"outputs are not finite or change shape on {self.error_at}, over {self.checked}"
        if self.cosine < tolerance.min_cosine:
            return (
                f"worst-row cosine {cosine_text(self.cosine, tolerance.min_cosine)} < {tolerance.min_cosine} on "
                f"{self.cosine_at}, over {self.checked}"
            )
        if tolerance.max_abs_error is not None and self.max_abs_error > tolerance.max_abs_error:
            return (
                f"max abs error {self.max_abs_error:.3g} > {tolerance.max_abs_error} on {self.error_at} "
                f"over {self.checked}"
            )
        if tolerance.top1 and not self.top1_agree:
            return f"top-1 differs from eager on {self.top1_at}, over {self.checked}"
        return None

    def summary(self, min_cosine: float | None = None) -> str:
        """The figures the gate passed on, with where the worst of each was."""
        return (
            f"worst-row cosine {cosine_text(self.cosine, min_cosine)} ({self.cosine_at}), max abs error "
            f"{self.max_abs_error:.3g} ({self.error_at}), over {self.checked}"
        )


def worst_of(results: Sequence[tuple[Agreement, Callable[[int], str]]], checked: str) -> GoldenResult:
    """Merge per-input agreements: the lowest row cosine, the largest error, top-1 everywhere.

    Each agreement comes with what names its row `r` (e.g. `validation sample 3 alone`).
    """
    cosine, cosine_at = 1.0, "no row"
    error, error_at = 0.0, "no row"
    top1_at = ""
    for agreement, where in results:
        # An output compared as one vector (one value per sample) has no row to name: the input is named.
        worst, largest = (agreement.worst_row, agreement.error_row) if agreement.rows > 1 else (-1, -1)
        if agreement.cosine < cosine or cosine_at == "no row":
            cosine, cosine_at = agreement.cosine, where(worst)
        if not agreement.max_abs_error <= error or error_at == "no row":  # NaN and inf too
            error, error_at = agreement.max_abs_error, where(largest)
        if not agreement.top1_agree and not top1_at:
            top1_at = where(-1)
    return GoldenResult(cosine, cosine_at, error, error_at, not top1_at, top1_at, checked)


def compare(reference: list[np.ndarray[Any, Any]], candidate: list[np.ndarray[Any, Any]]) -> Agreement:
    """The worst per-sample cosine, the largest absolute difference, and argmax agreement per row.

    Cosine is taken per sample (row of the batch, all outputs joined) and the minimum is kept: one
    flattened cosine over a batch would let seven good answers hide a bad eighth.
    """
    if len(reference) != len(candidate) or any(r.shape != c.shape for r, c in zip(reference, candidate, strict=False)):
        return Agreement(0.0, float("inf"), False)
    rows = {r.shape[0] for r in reference if r.ndim >= 1}
    per_row = len(rows) == 1 and all(r.ndim >= 1 for r in reference) and rows.pop() > 0
    count = reference[0].shape[0] if per_row else 1
    if per_row and sum(r.size for r in reference) == count:
        count = 1  # one value per sample: a per-row cosine would only compare signs, so the batch is one vector
    want = np.concatenate([r.astype(np.float64).reshape(count, -1) for r in reference], axis=1)
    got = np.concatenate([c.astype(np.float64).reshape(count, -1) for c in candidate], axis=1)
    finite = np.isfinite(got).all(axis=1)
    if not finite.all():
        row = int(np.argmin(finite))
        return Agreement(0.0, float("inf"), False, row, row, count)
    norms = np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1)
    dots = np.einsum("ij,ij->i", want, got)
    exact = np.array([np.array_equal(w, g) for w, g in zip(want, got, strict=True)], dtype=np.float64)
    # An identical row is 1 exactly (float64 rounding would print it as 0.99999999999999989), and no cosine
    # is let out of [-1, 1].
    cosines = np.where(exact > 0, 1.0, np.clip(dots / np.where(norms > 0, norms, 1.0), -1.0, 1.0) * (norms > 0))
    errors = np.max(np.abs(want - got), axis=1, initial=0.0)
    top1 = all(
        bool((r.reshape(r.shape[0], -1).argmax(1) == c.reshape(c.shape[0], -1).argmax(1)).all())
        for r, c in zip(reference, candidate, strict=True)
        if r.ndim >= 1 and r.shape[0] > 0 and r.size > 0
    )
    if not len(cosines):
        return Agreement(1.0, 0.0, top1, rows=0)
    worst, largest = int(np.argmin(cosines)), int(np.argmax(errors))
    return Agreement(float(cosines[worst]), float(errors[largest]), top1, worst, largest, count)
