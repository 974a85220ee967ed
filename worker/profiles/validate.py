"""Compares a profile's outputs on the golden inputs with the eager fp32 reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """How close to eager a profile must stay: cosine, and optionally max abs error and top-1 agreement."""

    min_cosine: float = 0.999
    max_abs_error: float | None = None
    top1: bool = False


@dataclass(frozen=True)
class Agreement:
    """Measured closeness of one profile to the reference."""

    cosine: float
    max_abs_error: float
    top1_agree: bool

    def failure(self, tolerance: Tolerance) -> str | None:
        """Why this misses the tolerance, or None when it meets it."""
        if not np.isfinite(self.max_abs_error):
            return "outputs are not finite or change shape"
        if self.cosine < tolerance.min_cosine:
            return f"cosine {self.cosine:.9f} < {tolerance.min_cosine}"
        if tolerance.max_abs_error is not None and self.max_abs_error > tolerance.max_abs_error:
            return f"max abs error {self.max_abs_error:.3g} > {tolerance.max_abs_error}"
        if tolerance.top1 and not self.top1_agree:
            return "top-1 differs from eager"
        return None


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
    if not np.isfinite(got).all():
        return Agreement(0.0, float("inf"), False)
    norms = np.linalg.norm(want, axis=1) * np.linalg.norm(got, axis=1)
    dots = np.einsum("ij,ij->i", want, got)
    exact = np.array([np.array_equal(w, g) for w, g in zip(want, got, strict=True)], dtype=np.float64)
    cosines = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), exact)
    top1 = all(
        bool((r.reshape(r.shape[0], -1).argmax(1) == c.reshape(c.shape[0], -1).argmax(1)).all())
        for r, c in zip(reference, candidate, strict=True)
        if r.ndim >= 1 and r.shape[0] > 0 and r.size > 0
    )
    return Agreement(float(cosines.min(initial=1.0)), float(np.max(np.abs(want - got), initial=0.0)), top1)
