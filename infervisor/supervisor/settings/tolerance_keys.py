"""A model's `tolerance`: how close to eager a profile must stay, read into the JSON form the worker takes.

Besides the model-wide measures (cosine, relative error on few-value outputs, the worst element of a long row
(`max_element_error`), max abs error, top-1), each output is judged by parts on their own scale: channel by channel
where its rows are matrices, by groups of columns where they are flat (`max_channel_error`); `outputs` gives a named
output limits of its own and declared slices (a packed detection head's boxes and scores); `task_check` names the
operator's own check. The worker's side is infervisor/worker/profiles/parts.py, elements.py and task_check.py.
"""

from __future__ import annotations

import re
from typing import Any

from infervisor.common.accuracy import DEFAULT_MAX_CHANNEL_ERROR, DEFAULT_MAX_REL_ERROR, channel_limit
from infervisor.supervisor.settings.config_keys import ReadContext
from infervisor.supervisor.settings.fields import FieldReader
from infervisor.supervisor.settings.module_lookup import module_missing

_MODEL_KEYS = {"min_cosine", "max_rel_error", "max_abs_error", "top1", "max_channel_error", "max_element_error",
               "outputs", "task_check"}  # fmt: skip
_OUTPUT_KEYS = {"max_channel_error", "channel_axis", "max_rel_error", "max_abs_error", "slices"}
_SLICE_KEYS = {"axis", "range", "max_rel_error", "max_abs_error"}
_FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*")
#: The documented default when a model sets no tolerance.
DEFAULT_TOLERANCE = {
    "min_cosine": 0.999,
    "max_rel_error": DEFAULT_MAX_REL_ERROR,
    "max_channel_error": DEFAULT_MAX_CHANNEL_ERROR,
    "max_element_error": DEFAULT_MAX_CHANNEL_ERROR,
}


def read_tolerance(ctx: ReadContext, raw: Any, path: str) -> dict[str, Any]:
    """The tolerance in the worker's form (validate.Tolerance.from_dict); each problem names its JSON path."""
    r = ctx.fields
    if not isinstance(raw, dict):
        r.fail(path, f"must be an object with {', '.join(sorted(_MODEL_KEYS))}")
        return {}
    r.check_keys(raw, path, _MODEL_KEYS)
    cosine = r.number(raw, "min_cosine", path, 0.999, -1.0)
    if cosine > 1.0:
        r.fail(f"{path}.min_cosine", f"must be at most 1, got {cosine}")
    # Absent: derived from min_cosine (a cosine loosened for int8 loosens it alike); null: off.
    channel = _limit(r, raw, "max_channel_error", path, channel_limit(cosine))
    task_check = _task_check(ctx, raw.get("task_check"), f"{path}.task_check")
    return {
        "min_cosine": cosine,
        # Absent: the default applies; null: switched off (the cosine alone then judges few-value outputs too).
        "max_rel_error": _limit(r, raw, "max_rel_error", path, DEFAULT_MAX_REL_ERROR),
        "max_abs_error": r.optional_number(raw, "max_abs_error", path, 0.0),
        "top1": r.boolean(raw, "top1", path, False),
        "max_channel_error": channel,
        "max_element_error": _limit(r, raw, "max_element_error", path, channel_limit(cosine)),
        "outputs": _outputs(ctx, raw.get("outputs", {}), f"{path}.outputs", channel),
        "task_check": task_check,
        "task_check_dir": str(ctx.base) if task_check is not None else None,
    }


def _limit(r: FieldReader, raw: dict[str, Any], key: str, path: str, default: float | None) -> float | None:
    """Absent: `default`; null: not checked; else a number >= 0."""
    value = raw.get(key, default)
    return None if value is None else r.number(raw, key, path, default or 0.0, 0.0)


def _task_check(ctx: ReadContext, raw: Any, path: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not _FUNCTION.fullmatch(raw):
        ctx.fields.fail(path, f"must be 'package.module:function' or null, got {raw!r}")
        return None
    missing = module_missing(raw.partition(":")[0], ctx.base)
    if missing is not None:
        ctx.fields.fail(path, f"cannot import {raw!r}: {missing}")
    return raw


def _outputs(ctx: ReadContext, raw: Any, path: str, channel: float | None) -> dict[str, Any]:
    r = ctx.fields
    if not isinstance(raw, dict):
        r.fail(path, "must be an object: output name -> its limits and slices")
        return {}
    declared = ctx.earlier.get("outputs")
    rules: dict[str, Any] = {}
    for name, rule in raw.items():
        where = f"{path}.{name}"
        if declared and name not in declared:
            r.fail(where, f"no output {name!r}: the model's outputs are {', '.join(map(repr, declared))}")
        if not isinstance(rule, dict):
            r.fail(where, f"must be an object with {', '.join(sorted(_OUTPUT_KEYS))}")
            continue
        r.check_keys(rule, where, _OUTPUT_KEYS)
        axis = rule.get("channel_axis")
        if axis is not None and (type(axis) is not int or axis == 0):
            r.fail(f"{where}.channel_axis", f"must be a non-batch axis (not 0; -1 = the last), got {axis!r}")
            axis = None
        rules[name] = {
            "max_channel_error": _limit(r, rule, "max_channel_error", where, channel),
            "channel_axis": axis,
            "max_rel_error": r.optional_number(rule, "max_rel_error", where, 0.0),
            "max_abs_error": r.optional_number(rule, "max_abs_error", where, 0.0),
            "slices": _slices(r, rule.get("slices", {}), f"{where}.slices"),
        }
    return rules


def _slices(r: FieldReader, raw: Any, path: str) -> list[dict[str, Any]]:
    """`{"scores": [4, 84]}` (along the last axis, the default relative error) or `{"scores": {"axis": 1, "range":
    [4, 84], "max_rel_error": 0.02, "max_abs_error": 0.05}}`."""
    if not isinstance(raw, dict):
        r.fail(path, 'must be an object: label -> [start, stop] or {"axis", "range", "max_rel_error", "max_abs_error"}')
        return []
    slices: list[dict[str, Any]] = []
    for label, value in raw.items():
        where = f"{path}.{label}"
        spec = {"range": value} if isinstance(value, list) else value
        if not isinstance(spec, dict):
            r.fail(where, f"must be [start, stop] or an object with {', '.join(sorted(_SLICE_KEYS))}")
            continue
        r.check_keys(spec, where, _SLICE_KEYS)
        bounds = spec.get("range")
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(type(b) is int for b in bounds)
                and 0 <= bounds[0] < bounds[1]):  # fmt: skip
            r.fail(f"{where}.range", f"must be [start, stop] with 0 <= start < stop (stop excluded), got {bounds!r}")
            continue
        axis = spec.get("axis", -1)
        if type(axis) is not int or axis == 0:
            r.fail(f"{where}.axis", f"must be a non-batch axis (an integer, not 0; -1 = the last), got {axis!r}")
            continue
        absolute = r.optional_number(spec, "max_abs_error", where, 0.0)
        # A slice given only an absolute limit is judged by it alone.
        relative = _limit(r, spec, "max_rel_error", where, DEFAULT_MAX_REL_ERROR if absolute is None else None)
        if relative is None and absolute is None:
            r.fail(where, "judges nothing: give it max_rel_error or max_abs_error")
            continue
        slices.append({"label": label, "axis": axis, "start": bounds[0], "stop": bounds[1],
                       "max_rel_error": relative, "max_abs_error": absolute})  # fmt: skip
    return slices
