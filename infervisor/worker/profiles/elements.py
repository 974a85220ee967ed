"""The worst element of a long row against its row's scale: one value far off cannot hide inside a row's cosine.

A row cosine over a few hundred values moves little when one of them is wrong: a per-frame pitch 200 frames long with
one frame an octave off keeps 0.996. So each output whose rows hold more than FEW_VALUES_PER_ROW values (the fewer
are judged by the relative error, validate.py) is also judged element by element: each element's difference from
eager over eager's largest magnitude in that row of that output (`max_element_error`). The gate and the live audit
both take it (validate.compare).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from infervisor.common.accuracy import FEW_VALUES_PER_ROW

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class ElementError:
    """The worst element over the long-row outputs: its error, which output, row and element, and its figures."""

    error: float = 0.0
    #: The output's name ("" when no output has rows long enough to be judged by it).
    output: str = ""
    row: int = 0
    #: The element's position within its row (the output's shape without the batch dim), and the row's length.
    position: tuple[int, ...] = ()
    values: int = 0
    eager: float = 0.0
    got: float = 0.0
    #: Eager's largest magnitude in that row of that output (0: the row is all zeros, the error is absolute).
    scale: float = 0.0
    #: Every row's worst element error over all judged outputs (the audit counts the rows past the limit).
    per_row: tuple[float, ...] = ()

    def text(self) -> str:
        """`element error 0.52 on output 'f0', element [137] of 200 per row: eager 220.1, profile 440.3 (eager's
        largest magnitude in the row 452)`."""
        scale = f"eager's largest magnitude in the row {self.scale:.4g}" if self.scale > 0 else "a row of zeros"
        return (
            f"element error {self.error:.3g} on output {self.output!r}, element {list(self.position)} of "
            f"{self.values} per row: eager {self.eager:.4g}, profile {self.got:.4g} ({scale})"
        )


def element_error(
    reference: Sequence[Array], candidate: Sequence[Array], names: Sequence[str], own_rules: Collection[str] = ()
) -> ElementError:
    """The worst element of the outputs with more than FEW_VALUES_PER_ROW values per row, except those with a
    relative error of their own (`own_rules`, judged by parts.py); the shapes must match and be finite."""
    worst = ElementError()
    per_row: Array | None = None
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        if want.ndim < 1 or want.shape[0] == 0 or want.size // want.shape[0] <= FEW_VALUES_PER_ROW:
            continue
        name = names[index] if index < len(names) else f"output {index}"
        if name in own_rules:
            continue
        rows = want.shape[0]
        wanted = want.astype(np.float64).reshape(rows, -1)
        difference = np.abs(wanted - got.astype(np.float64).reshape(rows, -1))
        scale = np.abs(wanted).max(axis=1)
        errors = difference / np.where(scale > 0, scale, 1.0)[:, None]
        row_errors = errors.max(axis=1)
        other_rows = per_row is None or per_row.shape != row_errors.shape
        per_row = row_errors if per_row is None or other_rows else np.maximum(per_row, row_errors)
        flat = int(np.argmax(np.where(np.isnan(errors), np.inf, errors)))
        row, column = divmod(flat, errors.shape[1])
        error = float(errors[row, column])
        if not worst.output or not error <= worst.error:  # NaN counts as the worst
            position = tuple(int(i) for i in np.unravel_index(column, want.shape[1:]))
            worst = ElementError(error, name, row, position, errors.shape[1], float(wanted[row, column]),
                                 float(got.reshape(rows, -1)[row, column]), float(scale[row]))  # fmt: skip
    if worst.output and per_row is not None:
        worst = replace(worst, per_row=tuple(float(e) for e in per_row))
    return worst
