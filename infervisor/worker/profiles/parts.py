"""The gate on parts of an output: each channel on its own scale, declared slices, and per-output limits.

A cosine over a packed row (box coordinates in the hundreds beside class scores in 0..1) is decided by the
coordinates: scores moved by 0.15 keep it at 0.99997. So every output whose rows are matrices or more is also
judged channel by channel (a slice along its channel axis: the smallest non-batch axis unless declared), each
channel's largest difference from eager over eager's largest magnitude on that channel (`max_channel_error`).
A flat row `[batch, values]` is judged by groups of columns on their own scale (column_groups): the columns whose
largest magnitudes over every sample the gate ran stand SCALE_GAP apart (box coordinates in pixels beside scores in
0..1) are judged apart, each group by its largest difference over its largest magnitude. Not column by column: a
logit that happens to be near zero on every sample has no scale of its own, and bf16 moved such a logit of the
built-in resnet50 by half of it.
An operator who knows the layout declares slices (`"scores": {"axis": 1, "range": [4, 84]}`) with limits of
their own, and limits for a whole output whatever its size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from infervisor.common.accuracy import CHANNEL_FLOOR, DEFAULT_MAX_REL_ERROR

Array = np.ndarray[Any, Any]

#: Columns of a flat row whose largest magnitudes differ by this factor or more are judged as separate groups: a
#: cosine over the row cannot see the smaller group (pixels against probabilities differ by 300 to 600).
SCALE_GAP = 100.0


@dataclass(frozen=True)
class SliceRule:
    """A declared part of an output: indices [start, stop) along `axis`, judged by its own limits."""

    label: str
    axis: int
    start: int
    stop: int
    #: Largest difference over eager's largest magnitude within the slice (None: not checked).
    max_rel_error: float | None = DEFAULT_MAX_REL_ERROR
    max_abs_error: float | None = None

    def text(self) -> str:
        """`slice 'scores' (axis 1, 4:84)`."""
        return f"slice {self.label!r} (axis {self.axis}, {self.start}:{self.stop})"


@dataclass(frozen=True)
class OutputRule:
    """Limits of one named output: its channel measure (resolved from the model's when not set) and its slices."""

    max_channel_error: float | None
    #: None: the smallest non-batch axis of at least 2 entries (on outputs of 3 dims or more).
    channel_axis: int | None = None
    #: Over the whole output, whatever its values per row.
    max_rel_error: float | None = None
    max_abs_error: float | None = None
    slices: tuple[SliceRule, ...] = ()


def output_rules(raw: Mapping[str, Any]) -> dict[str, OutputRule]:
    """The rules from their JSON form (tolerance_keys.read_tolerance writes it; asdict of these reads back)."""
    rules: dict[str, OutputRule] = {}
    for name, rule in raw.items():
        slices = rule.get("slices", ())
        declared = slices.values() if isinstance(slices, Mapping) else slices
        rules[name] = OutputRule(
            rule.get("max_channel_error"),
            rule.get("channel_axis"),
            rule.get("max_rel_error"),
            rule.get("max_abs_error"),
            tuple(SliceRule(**s) for s in declared),
        )
    return rules


@dataclass(frozen=True)
class PartError:
    """The worst figure of one measure on one part of an output in one golden case, and the limit it is held to."""

    measure: str
    error: float
    limit: float
    output: str
    #: e.g. `channel 37 along axis 1`, `slice 'scores' (axis 1, 4:84) at index 41`.
    part: str
    row: int
    eager: float
    got: float
    #: Eager's largest magnitude the error is relative to (None for an absolute error).
    scale: float | None = None

    @property
    def fails(self) -> bool:
        """Above its limit (NaN too)."""
        return not self.error <= self.limit

    @property
    def excess(self) -> float:
        """How far past its limit, as a ratio (the worst is the one named)."""
        if not np.isfinite(self.error):
            return float("inf")
        return self.error / self.limit if self.limit > 0 else (float("inf") if self.error > 0 else 0.0)

    def text(self, where: str) -> str:
        """`channel error 0.17 > 0.1 on output 'pred', channel 5 along axis 1, validation sample 3 alone: eager 0.81,
        profile 0.96 (eager's largest magnitude on it 0.88)`."""
        scale = f" (eager's largest magnitude on it {self.scale:.4g})" if self.scale is not None else ""
        sign = ">" if self.fails else "<="
        return (
            f"{self.measure} {self.error:.3g} {sign} {self.limit} on output {self.output!r}, {self.part}, {where}: "
            f"eager {self.eager:.4g}, profile {self.got:.4g}{scale}"
        )


class RuleError(ValueError):
    """A declared rule that does not fit the outputs (an output the model does not return, a slice past its axis)."""


def column_scales(references: Sequence[Sequence[Array]], names: Sequence[str]) -> dict[tuple[str, int], Array]:
    """Eager's largest magnitude on each column of each flat-row output (`[batch, values]`) over every golden case,
    keyed by the output's name and its column count (an open dim makes cases of several widths)."""
    scales: dict[tuple[str, int], Array] = {}
    for outputs in references:
        for name, want in zip(names, outputs, strict=False):
            if want.ndim == 2 and want.shape[0] > 0:
                largest = np.abs(want.astype(np.float64)).max(axis=0)
                key = (name, want.shape[1])
                scales[key] = np.fmax(scales[key], largest) if key in scales else largest
    return scales


def judge_parts(
    reference: Sequence[Array],
    candidate: Sequence[Array],
    names: Sequence[str],
    rules: Mapping[str, OutputRule],
    max_channel_error: float | None,
    scales: Mapping[tuple[str, int], Array] | None = None,
) -> list[PartError]:
    """The worst figure of every measure that applies to each output of one golden case (passing or not); `scales`
    (column_scales over every case) give a flat-row output's columns their scale, else this case's rows do.

    Raises RuleError when a rule names an output the model does not return or a slice that does not fit it.
    """
    missing = [name for name in rules if name not in names]
    if missing:
        raise RuleError(f"tolerance.outputs names {missing[0]!r}, which the model does not return (its outputs: "
                        f"{', '.join(map(repr, names))})")  # fmt: skip
    found: list[PartError] = []
    for name, want, got in zip(names, reference, candidate, strict=True):
        if want.shape != got.shape or want.ndim < 1:
            continue  # the generic measures already refused a shape change
        rule = rules.get(name)
        limit = rule.max_channel_error if rule is not None else max_channel_error
        axis = _channel_axis(want.shape, rule.channel_axis if rule is not None else None, name)
        wanted, gotten = want.astype(np.float64), got.astype(np.float64)
        pooled = (scales or {}).get((name, want.shape[1])) if want.ndim == 2 else None
        if limit is not None and axis is not None:
            found.append(_channel_error(name, wanted, gotten, axis, limit, pooled))
        elif limit is not None and want.ndim == 2 and want.size > 0 and (rule is None or rule.channel_axis is None):
            found.append(_group_error(name, wanted, gotten, limit, pooled))
        if rule is None:
            continue
        whole = SliceRule("", 1, 0, 0, rule.max_rel_error, rule.max_abs_error)
        found += _span_errors(name, wanted, gotten, whole, "the whole output", None)
        for declared in rule.slices:
            found += _span_errors(name, wanted, gotten, declared, declared.text(), _slice_axis(declared, want, name))
    return found


def _channel_axis(shape: tuple[int, ...], declared: int | None, name: str) -> int | None:
    if declared is not None:
        axis = declared % len(shape) if -len(shape) <= declared < len(shape) else 0
        if axis == 0:
            raise RuleError(f"tolerance.outputs.{name}.channel_axis {declared} is not a non-batch axis of its "
                            f"{len(shape)}-dim output")  # fmt: skip
        return axis
    if len(shape) < 3:
        return None  # a flat row's columns are judged in groups of one scale (column_groups)
    sizes = [(size, axis) for axis, size in enumerate(shape[1:], 1) if size >= 2]
    return min(sizes)[1] if sizes else None


def column_groups(scale: Array) -> list[Array]:
    """The column indices of a flat row split where their sorted scales jump by SCALE_GAP or more, each group in
    column order. Scales are floored at CHANNEL_FLOOR of the largest: a logit near zero on every sample is no group of
    its own (a split then needs a column at a tenth of the largest or more above the floor's group)."""
    floored = np.maximum(scale, CHANNEL_FLOOR * float(scale.max(initial=0.0)))
    order = np.argsort(floored, kind="stable")
    ordered = floored[order]
    cuts = [i + 1 for i in range(len(ordered) - 1) if ordered[i] > 0 and ordered[i + 1] >= SCALE_GAP * ordered[i]]
    return [np.sort(group) for group in np.split(order, cuts)]


def _columns_text(columns: Array, total: int) -> str:
    """`columns 4-15 of 16`, or `columns 0-126, 128-383 of 384` when they are not contiguous."""
    if len(columns) == total:
        return f"all {total} columns"
    runs: list[list[int]] = []
    for column in (int(c) for c in columns):
        if runs and column == runs[-1][1] + 1:
            runs[-1][1] = column
        else:
            runs.append([column, column])
    listed = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
    return f"{'column' if len(columns) == 1 else 'columns'} {listed} of {total} (a group on its own scale)"


def _group_error(name: str, want: Array, got: Array, limit: float, pooled: Array | None) -> PartError:
    """The group of columns (column_groups over `pooled`, else this case's scales) with the largest difference over
    the group's largest magnitude (at least CHANNEL_FLOOR of the output's), and the element where it is."""
    scale = np.fmax(pooled, np.abs(want).max(axis=0)) if pooled is not None else np.abs(want).max(axis=0)
    difference = np.abs(want - got)
    floor = CHANNEL_FLOOR * float(scale.max(initial=0.0))
    worst = PartError("channel error", 0.0, limit, name, "no column", 0, 0.0, 0.0)
    for columns in column_groups(scale):
        part = difference[:, columns]
        row, column = np.unravel_index(int(np.argmax(np.where(np.isnan(part), np.inf, part))), part.shape)
        # Floored as a channel is: a group of dead columns (MiniLM has three at 1e-33..1e-8) is not judged on noise.
        largest, magnitude = float(part[row, column]), max(float(scale[columns].max()), floor)
        error = largest / magnitude if magnitude > 0 else largest
        index = int(columns[column])
        found = PartError(
            "channel error", error, limit, name, f"{_columns_text(columns, want.shape[1])}, column {index}",
            int(row), float(want[row, index]), float(got[row, index]), magnitude if magnitude > 0 else None,
        )  # fmt: skip
        if found.excess > worst.excess or worst.part == "no column":
            worst = found
    return worst


def _slice_axis(rule: SliceRule, want: Array, name: str) -> int:
    axis = rule.axis % want.ndim if -want.ndim <= rule.axis < want.ndim else 0
    if axis == 0 or rule.stop > want.shape[axis]:
        raise RuleError(f"tolerance.outputs.{name}: {rule.text()} does not fit its output of shape "
                        f"{list(want.shape)} (the batch is axis 0)")  # fmt: skip
    return axis


def _channel_error(name: str, want: Array, got: Array, axis: int, limit: float, pooled: Array | None) -> PartError:
    """The channel with the largest difference over its own largest magnitude (`pooled` when given, else this case's;
    floored at CHANNEL_FLOOR of the output's), and the element where it is."""
    difference = np.moveaxis(np.abs(want - got), axis, 0)
    magnitude = np.moveaxis(np.abs(want), axis, 0)
    channels = difference.shape[0]
    largest = difference.reshape(channels, -1).max(axis=1)
    own = magnitude.reshape(channels, -1).max(axis=1) if pooled is None else np.fmax(pooled, magnitude.max(axis=1))
    floor = CHANNEL_FLOOR * float(own.max(initial=0.0))
    scale = np.maximum(own, floor)
    errors = np.where(scale > 0, largest / np.where(scale > 0, scale, 1.0), largest)
    channel = int(np.argmax(np.where(np.isnan(errors), np.inf, errors)))
    position = np.unravel_index(int(np.argmax(difference[channel])), difference.shape[1:])
    eager = float(np.moveaxis(want, axis, 0)[channel][position])
    profile = float(np.moveaxis(got, axis, 0)[channel][position])
    return PartError(
        "channel error", float(errors[channel]), limit, name, f"channel {channel} along axis {axis}",
        int(position[0]), eager, profile, float(scale[channel]) if scale[channel] > 0 else None,
    )  # fmt: skip


def _span_errors(name: str, want: Array, got: Array, rule: SliceRule, part: str, axis: int | None) -> list[PartError]:
    """The relative and absolute error of a slice (axis None: the whole output), where the limits are set."""
    if rule.max_rel_error is None and rule.max_abs_error is None:
        return []
    if axis is not None:
        want = np.take(want, range(rule.start, rule.stop), axis=axis)
        got = np.take(got, range(rule.start, rule.stop), axis=axis)
    difference = np.abs(want - got)
    flat = int(np.argmax(np.where(np.isnan(difference), np.inf, difference))) if difference.size else 0
    position = np.unravel_index(flat, difference.shape) if difference.size else (0,)
    largest = float(difference[position]) if difference.size else 0.0
    at = f"{part} at index {rule.start + int(position[axis])}" if axis is not None else part
    eager, profile = (float(want[position]), float(got[position])) if difference.size else (0.0, 0.0)
    found: list[PartError] = []
    if rule.max_rel_error is not None:
        scale = float(np.abs(want).max(initial=0.0))
        error = largest / scale if scale > 0 else largest
        found.append(PartError("relative error", error, rule.max_rel_error, name, at, int(position[0]), eager,
                               profile, scale if scale > 0 else None))  # fmt: skip
    if rule.max_abs_error is not None:
        found.append(PartError("max abs error", largest, rule.max_abs_error, name, at, int(position[0]), eager,
                               profile))  # fmt: skip
    return found


class _Case(Protocol):
    def where(self, row: int) -> str: ...


def parts_verdict(
    cases: Sequence[_Case],
    references: Sequence[Sequence[Array]],
    candidates: Sequence[Sequence[Array]],
    names: Sequence[str],
    rules: Mapping[str, OutputRule],
    max_channel_error: float | None,
) -> tuple[str | None, str]:
    """(why the parts of the outputs fail, or None; the worst figure of a part that passed, for the summary)."""
    failing: tuple[PartError, str] | None = None
    passing: tuple[PartError, str] | None = None
    scales = column_scales(references, names)
    try:
        for case, want, got in zip(cases, references, candidates, strict=True):
            for error in judge_parts(want, got, names, rules, max_channel_error, scales):
                worst = failing if error.fails else passing
                if worst is None or error.excess > worst[0].excess:
                    if error.fails:
                        failing = (error, case.where(error.row))
                    else:
                        passing = (error, case.where(error.row))
    except RuleError as exc:
        return str(exc), ""
    if failing is not None:
        return failing[0].text(failing[1]), ""
    return None, (f"worst part: {passing[0].text(passing[1])}" if passing is not None else "")
