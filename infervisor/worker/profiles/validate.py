"""Compares a profile's outputs on the golden inputs with the eager fp32 reference.

Three measures, so that every output and every element can fail: the cosine of each sample's row (all outputs
joined); on each output whose rows hold few values (common.accuracy.FEW_VALUES_PER_ROW), the largest difference
relative to the largest magnitude eager gives on that output (a cosine over one value per row only compares signs: a
probability off by 0.89 keeps it at 1.0); on each output with longer rows, the worst element over eager's largest
magnitude in its row (elements.py: one frame an octave off keeps a long row's cosine at 0.996).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infervisor.common.accuracy import (
    DEFAULT_MAX_REL_ERROR,
    FEW_VALUES_PER_ROW,
    channel_limit,
    cosine_text,
)
from infervisor.worker.profiles.elements import ElementError, element_error
from infervisor.worker.profiles.evidence import Evidence, spread
from infervisor.worker.profiles.parts import OutputRule, output_rules

#: Tolerance.max_channel_error's default: derived from min_cosine (common.accuracy.channel_limit).
FROM_COSINE = -1.0


@dataclass(frozen=True)
class Tolerance:
    """How close to eager a profile must stay: cosine, relative error on few-value outputs (None: not checked), each
    channel of a matrix-shaped output on its own scale (parts.py), per-output rules, an optional task-level check,
    and optionally max abs error and top-1 agreement."""

    min_cosine: float = 0.999
    max_abs_error: float | None = None
    top1: bool = False
    max_rel_error: float | None = DEFAULT_MAX_REL_ERROR
    #: Default (FROM_COSINE): common.accuracy.channel_limit(min_cosine); None: not checked.
    max_channel_error: float | None = FROM_COSINE
    #: The worst element of a long row over eager's largest magnitude in that row (elements.py); default as above.
    max_element_error: float | None = FROM_COSINE
    #: Output name -> its own limits and declared slices.
    outputs: Mapping[str, OutputRule] = field(default_factory=dict)
    #: `module:function` given eager's and the profile's outputs by name, returning (passed, reason).
    task_check: str | None = None
    #: The config's folder: searched for the task check's module after PYTHONPATH and site-packages.
    task_check_dir: str | None = None

    def __post_init__(self) -> None:
        for key in ("max_channel_error", "max_element_error"):
            if getattr(self, key) == FROM_COSINE:  # frozen: the derived default is set once, here
                object.__setattr__(self, key, channel_limit(self.min_cosine))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Tolerance:
        """From the LaunchSpec's JSON form (an older spec without the newer keys takes their defaults)."""
        values = dict(raw)
        values["outputs"] = output_rules(values.get("outputs") or {})
        return cls(**values)

    def judged_by_output_rule(self) -> Collection[str]:
        """Outputs given their own max_rel_error: the default on few-value outputs leaves them to it."""
        return [name for name, rule in self.outputs.items() if rule.max_rel_error is not None]


@dataclass(frozen=True)
class RelativeError:
    """The worst relative error over the outputs judged by it: its value, which output, and that output's row."""

    error: float = 0.0
    #: The output's name ("" when no output has few enough values per row to be judged by it).
    output: str = ""
    #: Values per row of that output, and the row with the largest difference.
    values: int = 0
    row: int = 0
    #: Every row's relative error on that output (the spread between samples is taken over these).
    per_row: tuple[float, ...] = ()

    def text(self) -> str:
        """`relative error 0.05 on output 'score' (1 value per row)`."""
        plural = "value" if self.values == 1 else "values"
        return f"relative error {self.error:.3g} on output {self.output!r} ({self.values} {plural} per row)"


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
    relative: RelativeError = RelativeError()
    #: Every row's cosine (the spread between samples is taken over these).
    cosines: tuple[float, ...] = ()
    #: What made the outputs incomparable (which output is not finite or has another shape), "" when none.
    problem: str = ""
    element: ElementError = ElementError()

    def failure(self, tolerance: Tolerance) -> str | None:
        """Why this misses the tolerance, or None when it meets it."""
        if not np.isfinite(self.max_abs_error):
            return self.problem or "outputs are not finite or change shape"
        if self.cosine < tolerance.min_cosine:
            return f"cosine {cosine_text(self.cosine, tolerance.min_cosine)} < {tolerance.min_cosine}"
        if _relative_fails(self.relative, tolerance):
            return f"{self.relative.text()} > {tolerance.max_rel_error}"
        if _element_fails(self.element, tolerance):
            return f"{self.element.text()} > {tolerance.max_element_error}, row {self.element.row}"
        if tolerance.max_abs_error is not None and self.max_abs_error > tolerance.max_abs_error:
            return f"max abs error {self.max_abs_error:.3g} > {tolerance.max_abs_error}"
        if tolerance.top1 and not self.top1_agree:
            return "top-1 differs from eager"
        return None

    def failing_row(self, tolerance: Tolerance) -> int:
        """The row the failure names: the worst element's or relative error's when that measure is what fails, else
        the row of the lowest cosine."""
        if self.cosine >= tolerance.min_cosine and not _relative_fails(self.relative, tolerance):
            return self.element.row if _element_fails(self.element, tolerance) else self.worst_row
        return self.relative.row if self.cosine >= tolerance.min_cosine else self.worst_row


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
    relative: RelativeError = RelativeError()
    relative_at: str = ""
    #: Samples the gate saw, and the spread (best minus worst) of the rows' cosines and relative errors over them.
    samples: int = 0
    cosine_spread: float = 0.0
    relative_spread: float = 0.0
    #: Which output was not finite or changed shape, and how, where the largest error is not finite ("" else).
    problem: str = ""
    element: ElementError = ElementError()
    element_at: str = ""

    def failure(self, tolerance: Tolerance) -> str | None:
        """Why the worst row misses the tolerance (and where it is), or None when every row meets it."""
        if not np.isfinite(self.max_abs_error):
            what = self.problem or "outputs are not finite or change shape"
            reshaped = _SHAPE_WORDS in what or _COUNT_WORDS in what
            return f"{what} on {self.error_at}, over {self.checked}{_SHAPE_STEP if reshaped else ''}"
        if self.cosine < tolerance.min_cosine:
            return (
                f"worst-row cosine {cosine_text(self.cosine, tolerance.min_cosine)} < {tolerance.min_cosine} on "
                f"{self.cosine_at}, over {self.checked}"
            )
        if _relative_fails(self.relative, tolerance):
            return (
                f"{self.relative.text()} > {tolerance.max_rel_error} on {self.relative_at} (its largest difference "
                f"from eager over eager's largest magnitude on it: a cosine over so few values cannot fail), "
                f"over {self.checked}"
            )
        if _element_fails(self.element, tolerance):
            return (
                f"{self.element.text()} > {tolerance.max_element_error} on {self.element_at} (one element far off "
                f"hides inside a long row's cosine), over {self.checked}"
            )
        if tolerance.max_abs_error is not None and self.max_abs_error > tolerance.max_abs_error:
            return (
                f"max abs error {self.max_abs_error:.3g} > {tolerance.max_abs_error} on {self.error_at} "
                f"over {self.checked}"
            )
        if tolerance.top1 and not self.top1_agree:
            return f"top-1 differs from eager on {self.top1_at}, over {self.checked}"
        return None

    def summary(self, min_cosine: float | None = None, tolerance: Tolerance | None = None) -> str:
        """The figures the gate passed on, with where the worst of each was, and (given the tolerance) its margin."""
        relative = f", {self.relative.text()} ({self.relative_at})" if self.relative.output else ""
        relative += f", worst element: {self.element.text()} ({self.element_at})" if self.element.output else ""
        text = (
            f"worst-row cosine {cosine_text(self.cosine, min_cosine)} ({self.cosine_at}){relative}, max abs error "
            f"{self.max_abs_error:.3g} ({self.error_at}), over {self.checked}"
        )
        return f"{text}; {self.evidence(tolerance).text()}" if tolerance is not None else text

    def evidence(self, tolerance: Tolerance) -> Evidence:
        """The margins to the tolerance, against the spread between the samples."""
        limit = tolerance.max_rel_error
        judged = bool(self.relative.output) and limit is not None
        return Evidence(
            self.samples,
            self.cosine - tolerance.min_cosine,
            self.cosine_spread,
            tolerance.min_cosine,
            (limit - self.relative.error) if judged and limit is not None else None,
            self.relative_spread,
            limit,
        )


def _relative_fails(relative: RelativeError, tolerance: Tolerance) -> bool:
    limit = tolerance.max_rel_error
    return bool(relative.output) and limit is not None and not relative.error <= limit


def _element_fails(element: ElementError, tolerance: Tolerance) -> bool:
    limit = tolerance.max_element_error
    return bool(element.output) and limit is not None and not element.error <= limit


def worst_of(results: Sequence[tuple[Agreement, Callable[[int], str]]], checked: str, samples: int = 0) -> GoldenResult:
    """Merge per-input agreements: the lowest row cosine, the largest error, top-1 everywhere, and the spread of
    the rows' figures (`samples`: how many samples the agreements cover).

    Each agreement comes with what names its row `r` (e.g. `validation sample 3 alone`).
    """
    cosine, cosine_at = 1.0, "no row"
    error, error_at, problem = 0.0, "no row", ""
    top1_at = ""
    relative, relative_at = RelativeError(), ""
    element, element_at = ElementError(), ""
    for agreement, where in results:
        # An output compared as one vector (one value per sample) has no row to name: the input is named.
        worst, largest = (agreement.worst_row, agreement.error_row) if agreement.rows > 1 else (-1, -1)
        if agreement.cosine < cosine or cosine_at == "no row":
            cosine, cosine_at = agreement.cosine, where(worst)
        if not agreement.max_abs_error <= error or error_at == "no row":  # NaN and inf too
            error, error_at, problem = agreement.max_abs_error, where(largest), agreement.problem
        if not agreement.top1_agree and not top1_at:
            top1_at = where(-1)
        if agreement.relative.output and (not relative.output or not agreement.relative.error <= relative.error):
            relative = agreement.relative
            relative_at = where(relative.row)
        if agreement.element.output and (not element.output or not agreement.element.error <= element.error):
            element, element_at = agreement.element, where(agreement.element.row)
    cosines = [c for agreement, _ in results for c in agreement.cosines]
    relatives = [e for agreement, _ in results if agreement.relative.output for e in agreement.relative.per_row]
    return GoldenResult(
        cosine, cosine_at, error, error_at, not top1_at, top1_at, checked, relative, relative_at,
        samples, spread(cosines), spread(relatives), problem, element, element_at,
    )  # fmt: skip


def compare(
    reference: list[np.ndarray[Any, Any]],
    candidate: list[np.ndarray[Any, Any]],
    names: Sequence[str] = (),
    own_rules: Collection[str] = (),
) -> Agreement:
    """The worst per-sample cosine, the largest absolute difference, argmax agreement per row, and the worst
    relative error over the outputs with few values per row (`names` name the outputs; default `output i`), except
    those with a relative error of their own (`own_rules`, judged by parts.py).

    Cosine is taken per sample (row of the batch, all outputs joined) and the minimum is kept: one
    flattened cosine over a batch would let seven good answers hide a bad eighth.
    """
    if len(reference) != len(candidate) or any(r.shape != c.shape for r, c in zip(reference, candidate, strict=False)):
        return Agreement(0.0, float("inf"), False, problem=_shape_problem(reference, candidate, names))
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
        problem = _finite_problem(reference, candidate, names)
        return Agreement(0.0, float("inf"), False, row, row, count, problem=problem)
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
    relative = _relative_error(reference, candidate, names, own_rules)
    element = element_error(reference, candidate, names, own_rules)
    if not len(cosines):
        return Agreement(1.0, 0.0, top1, rows=0, relative=relative, element=element)
    worst, largest = int(np.argmin(cosines)), int(np.argmax(errors))
    row_cosines = tuple(float(c) for c in cosines)
    return Agreement(
        float(cosines[worst]), float(errors[largest]), top1, worst, largest, count, relative, row_cosines, "", element
    )


#: Words of a shape problem (_shape_problem), and the next step such a refusal gives.
_SHAPE_WORDS = "where eager's is"
_COUNT_WORDS = "outputs where eager gives"
_SHAPE_STEP = (
    " (the profile's program was traced or specialised at other sizes and answers this one with another shape: "
    "declare only the sizes it serves, a fixed size or sizes in steps [min, max, step], or take the profile out of "
    "`profiles`)"
)


def _name(names: Sequence[str], index: int) -> str:
    return repr(names[index]) if index < len(names) else f"{index}"


def _shape_problem(
    reference: list[np.ndarray[Any, Any]], candidate: list[np.ndarray[Any, Any]], names: Sequence[str]
) -> str:
    """Which output changed shape: `output 'boxes' has shape [1, 84, 300] where eager's is [1, 84, 2100]`."""
    if len(reference) != len(candidate):
        return f"the profile gives {len(candidate)} {_COUNT_WORDS} {len(reference)}"
    index = next(i for i, (r, c) in enumerate(zip(reference, candidate, strict=True)) if r.shape != c.shape)
    return (
        f"output {_name(names, index)} has shape {list(candidate[index].shape)} {_SHAPE_WORDS} "
        f"{list(reference[index].shape)}"
    )


def _finite_problem(
    reference: list[np.ndarray[Any, Any]], candidate: list[np.ndarray[Any, Any]], names: Sequence[str]
) -> str:
    """Which output is not finite: `output 'scores' is not finite: 12 of 8400 values NaN or infinite (eager's: 0)`."""
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        bad = int(got.size - np.count_nonzero(np.isfinite(got)))
        if bad:
            eager = int(want.size - np.count_nonzero(np.isfinite(want)))
            counts = f"{bad} of {got.size} values NaN or infinite (eager's: {eager})"
            return f"output {_name(names, index)} is not finite: {counts}"
    return "outputs are not finite"


def _relative_error(
    reference: list[np.ndarray[Any, Any]],
    candidate: list[np.ndarray[Any, Any]],
    names: Sequence[str],
    own_rules: Collection[str] = (),
) -> RelativeError:
    """The worst, over outputs with at most FEW_VALUES_PER_ROW values per row, of max |eager - profile| divided by
    max |eager| on that output (the absolute difference where eager gives only zeros).

    Scaled by the output's largest magnitude, not element by element: a probability of 1e-6 off by 1e-7 is no
    failure, while the same output 5% off everywhere is.
    """
    worst = RelativeError()
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        rows = want.shape[0] if want.ndim >= 1 and want.shape[0] > 0 else 1
        values = want.size // rows if want.ndim >= 1 else want.size
        name = names[index] if index < len(names) else f"output {index}"
        if not 0 < values <= FEW_VALUES_PER_ROW or name in own_rules:
            continue
        wanted = want.astype(np.float64).reshape(rows, -1)
        difference = np.abs(wanted - got.astype(np.float64).reshape(rows, -1)).max(axis=1)
        scale = float(np.abs(wanted).max())
        row = int(np.argmax(difference))
        error = float(difference[row]) / scale if scale > 0 else float(difference[row])
        if not worst.output or not error <= worst.error:  # NaN counts as the worst
            per_row = tuple(float(d) / scale if scale > 0 else float(d) for d in difference)
            worst = RelativeError(error, name, values, row, per_row)
    return worst
