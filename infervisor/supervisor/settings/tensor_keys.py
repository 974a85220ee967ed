"""A model entry's tensors in config.json: its inputs (name, dtype, shape, synthetic data), outputs and data files.

Each reader takes the config's `ReadContext` and reports a problem by the JSON path of the bad key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from infervisor.common.sample_groups import (
    PLAIN,
    SEPARATOR,
    SEQUENCE_PREFIX,
    GroupError,
    group_name,
    holds_samples,
    sample_groups,
    sequence_groups,
)
from infervisor.protocol.constants import DTYPE_ITEMSIZE, MAX_NAME_LEN, MAX_RANK
from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import SYNTHETIC_DISTRIBUTIONS, DimRange, Synthetic, TensorSpec
from infervisor.supervisor.settings.config_keys import ReadContext
from infervisor.supervisor.settings.fields import FieldReader, join_path

#: The range `integers` synthetic data may draw from, [low, high): what the dtype holds (int64: what a float
#: parameter carries exactly).
_INTEGER_RANGES = {
    "bool": (0, 2),
    "uint8": (0, 2**8),
    "int8": (-(2**7), 2**7),
    "int16": (-(2**15), 2**15),
    "int32": (-(2**31), 2**31),
    "int64": (-(2**53), 2**53),
}
_MAX_DIM = 2**31 - 1


def _is_int(value: Any) -> bool:
    return type(value) is int


#: What a dim of a shape may be, for the messages that refuse one.
_DIM_FORMS = (
    f"an integer 1..{_MAX_DIM}, null (any size), [min, max] with 1 <= min <= max (max null: no upper bound) or "
    "[min, max, step] (sizes min + a multiple of step up to max)"
)

#: One dim as read: its fixed size (None: dynamic), its range (None: any size) and the step of its sizes.
ReadDim = tuple[int | None, DimRange | None, int]


def _read_dim(r: FieldReader, dim: Any, where: str, index: int) -> ReadDim | None:
    """One dim of a shape: an integer, null (any size), [min, max] (max null: no upper bound) or [min, max, step];
    None when bad."""
    if dim is None:
        return None, None, 1
    if _is_int(dim) and 1 <= dim <= _MAX_DIM:
        return dim, None, 1
    if not (isinstance(dim, list) and len(dim) in (2, 3) and _is_int(dim[0]) and (dim[1] is None or _is_int(dim[1]))):
        r.fail(where, f"must be {_DIM_FORMS}, got {dim!r}")
        return None
    low, high = dim[0], dim[1]
    if not (1 <= low <= _MAX_DIM and (high is None or low <= high <= _MAX_DIM)):
        r.fail(where, f"must be {_DIM_FORMS}, got {dim!r}")
        return None
    step = dim[2] if len(dim) == 3 else 1
    if not _is_int(step) or not 1 <= step <= _MAX_DIM:
        r.fail(where, f"step must be an integer >= 1 (1: every size), got {step!r}")
        return None
    if low == high:
        return low, None, 1
    if step > 1 and index == 0:
        # Batches are formed from any number of requests; a stepped batch would refuse most of them.
        r.fail(where, "dim 0 is the batch, which takes every size: declare a step on another dim")
        return None
    if step > 1 and high is not None and (high - low) % step:
        below = low + (high - low) // step * step
        r.fail(where, f"max {high} is not {low} + a multiple of {step}: declare {below} or {below + step}")
        return None
    if step > 1:
        return None, (low, high), step
    return None, (None if (low, high) == (1, None) else (low, high)), 1


def _read_synthetic(r: FieldReader, raw: Any, where: str, dtype: str) -> Synthetic | None:
    """`{"distribution": NAME, ...parameters}`: normal (mean, std), uniform (low, high), integers (low, high)."""
    if raw is None:
        return None
    names = ", ".join(SYNTHETIC_DISTRIBUTIONS)
    if not isinstance(raw, dict) or raw.get("distribution") not in SYNTHETIC_DISTRIBUTIONS:
        r.fail(where, f"must be an object with a `distribution` of {names}, got {raw!r}")
        return None
    distribution = str(raw["distribution"])
    parameters = SYNTHETIC_DISTRIBUTIONS[distribution]
    r.check_keys(raw, where, {"distribution", *parameters})
    values: list[float] = []
    for key, default in parameters.items():
        value: Any = raw.get(key, default)
        integral = distribution == "integers"
        if not (_is_int(value) if integral else isinstance(value, (int, float)) and not isinstance(value, bool)):
            kind = "an integer" if integral else "a number"
            r.fail(join_path(where, key), f"must be {kind}{' (required)' if default is None else ''}, got {value!r}")
            return None
        if not math.isfinite(value):
            r.fail(join_path(where, key), f"must be finite, got {value!r}")
            return None
        values.append(float(value))
    first, second = values
    floating = dtype.startswith("float")
    low, high = _INTEGER_RANGES.get(dtype, (-math.inf, math.inf))
    if distribution in ("normal", "uniform") and not floating:
        r.fail(join_path(where, "distribution"), f"{distribution} draws floats; a {dtype} input takes `integers`")
    elif distribution == "normal" and second <= 0:
        r.fail(join_path(where, "std"), f"must be > 0, got {raw.get('std')!r}")
    elif distribution != "normal" and first >= second:
        r.fail(where, f"needs low < high, got low {raw.get('low', first)!r} and high {raw.get('high')!r}")
    elif distribution == "integers" and (first < low or second > high):
        r.fail(where, f"integers for a {dtype} input need {low} <= low < high <= {high}")
    else:
        return Synthetic(distribution, first, second)
    return None


def read_inputs(ctx: ReadContext, raw: Any, path: str) -> tuple[TensorSpec, ...]:
    r = ctx.fields
    if not isinstance(raw, list) or not raw:
        r.fail(path, "must be a non-empty array of {name, dtype, shape}")
        return ()
    specs: list[TensorSpec] = []
    for index, item in enumerate(raw):
        where = f"{path}[{index}]"
        if not isinstance(item, dict):
            r.fail(where, "must be an object")
            continue
        r.check_keys(item, where, {"name", "dtype", "shape", "allow_non_finite", "synthetic"})
        name, dtype, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            r.fail(f"{where}.name", "must be a non-empty string")
            continue
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            r.fail(f"{where}.dtype", f"must be one of {', '.join(sorted(DTYPE_ITEMSIZE))}, got {dtype!r}")
            continue
        if not isinstance(shape, list) or len(shape) > MAX_RANK:
            r.fail(f"{where}.shape", f"must be an array of at most {MAX_RANK} dims, got {shape!r}")
            continue
        dims = [_read_dim(r, dim, f"{where}.shape[{i}]", i) for i, dim in enumerate(shape)]
        if any(dim is None for dim in dims):
            continue
        if any(spec.name == name for spec in specs):
            r.fail(f"{where}.name", f"input {name!r} is declared twice")
            continue
        allow = r.boolean(item, "allow_non_finite", where, False)
        synthetic = _read_synthetic(r, item.get("synthetic"), f"{where}.synthetic", dtype)
        sizes = tuple(d[0] for d in dims if d is not None)
        bounds = tuple(d[1] for d in dims if d is not None)
        steps = tuple(d[2] for d in dims if d is not None)
        stepped = steps if any(step > 1 for step in steps) else ()
        specs.append(TensorSpec(name, dtype, sizes, allow, bounds if any(bounds) else (), synthetic, stepped))
    return tuple(specs)


def read_outputs(ctx: ReadContext, raw: Any, path: str) -> tuple[str, ...] | None:
    if raw is not None and (not isinstance(raw, list) or not all(isinstance(o, str) and o for o in raw)):
        ctx.fields.fail(path, "must be an array of output names or null")
        return None
    return tuple(raw) if raw else None


def read_data_file(ctx: ReadContext, raw: Any, path: str) -> str | None:
    """An .npz path (relative to config.json's folder) that must exist and fit the inputs, as an absolute path."""
    return _data_file(ctx, raw, path, sequences=False)


def read_validation_file(ctx: ReadContext, raw: Any, path: str) -> str | None:
    """A validation .npz: samples as a calibration file holds them, and for a stateful model sequences too
    (`seq:` keys, common/sample_groups.py), or sequences alone."""
    return _data_file(ctx, raw, path, sequences=True)


def _data_file(ctx: ReadContext, raw: Any, path: str, sequences: bool) -> str | None:
    value = ctx.fields.string_or_null(raw, path)
    if value is None:
        return None
    file = Path(value) if Path(value).is_absolute() else ctx.base / value
    if not file.is_file():
        ctx.fields.fail(path, f"no such file: {file}")
    else:
        state = ctx.earlier.get("state") or () if sequences else None
        _check_data_file(ctx.fields, str(file), ctx.earlier["inputs"], path, state)
    return str(file)


def _check_data_file(
    r: FieldReader, file: str, specs: tuple[TensorSpec, ...], where: str, state: tuple[StateSpec, ...] | None = None
) -> None:
    """A calibration/validation .npz holds one array per input and shape group (common/sample_groups.py), samples
    along dim 0, each sample fitting the spec; the arrays of a group share their sample count. A validation file
    (`state` not None) may hold sequences for a stateful model besides, or instead of, the samples."""
    import numpy as np  # only when a data file is configured: validating a config needs no numpy otherwise

    if any(s.shape and s.shape[0] not in (None, 1) for s in specs):
        r.fail(where, "needs inputs whose first dim is the batch (null or 1): samples are taken along it")
        return
    try:
        with np.load(file, allow_pickle=False) as archive:
            keys = list(archive.files)
            if state is not None and not holds_samples(keys):
                groups = {}
            else:
                groups = sample_groups(keys, [spec.name for spec in specs])
            arrays = {key: archive[key] for members in groups.values() for key in members.values()}
            if state is not None:
                _check_sequences(r, file, specs, where, state, archive)
    except GroupError as exc:
        r.fail(where, f"{file} {exc}")
        return
    except (OSError, ValueError) as exc:
        r.fail(where, f"cannot read {file} as .npz: {exc}")
        return
    for label, members in groups.items():
        group = "" if list(groups) == [PLAIN] else f"{group_name(label)}: "
        samples = set()
        for spec in specs:
            key = members[spec.name]
            array = arrays[key]
            fits = (
                array.ndim == len(spec.shape)
                and array.dtype.name == spec.dtype
                and all(spec.takes(i, got) for i, got in enumerate(array.shape[1:], start=1))
            )
            if not fits:
                r.fail(
                    where, f"{group}array {key!r} is {array.dtype.name}{list(array.shape)}; expected {spec.describe()}"
                )
            samples.add(array.shape[0] if array.ndim else 0)
        if len(samples) > 1 or 0 in samples:
            r.fail(where, f"{group}its arrays must share a non-empty first (sample) dimension")


def _check_sequences(
    r: FieldReader, file: str, specs: tuple[TensorSpec, ...], where: str, state: tuple[StateSpec, ...], archive: Any
) -> None:
    """Each set of sequences holds every input but the state as [steps, streams, *one sample's dims]; the state
    starts from its declared initial value, so a `seq:` key of a state input is refused rather than ignored."""
    keys = list(archive.files)
    held = [key for key in keys if key.startswith(SEQUENCE_PREFIX)]
    if not held:
        return
    if not state:
        r.fail(where, f"{file} holds sequences ({held[0]!r}) but the model declares no `state` to carry along them")
        return
    carried = {pair.input for pair in state}
    for key in held:
        if key[len(SEQUENCE_PREFIX) :].partition(SEPARATOR)[0] in carried:
            r.fail(where, f"{file}: {key!r} is a state input: every sequence starts from the declared initial state")
            return
    fed = [spec for spec in specs if spec.name not in carried]
    for label, members in sequence_groups(keys, [spec.name for spec in fed]).items():
        named = f"sequences{'' if label == PLAIN else f' ({group_name(label)})'}"
        leading = set()
        for spec in fed:
            array = archive[members[spec.name]]
            fits = (
                array.ndim == len(spec.shape) + 1
                and array.dtype.name == spec.dtype
                and all(spec.takes(i, got) for i, got in enumerate(array.shape[1:]))
            )
            if not fits:
                r.fail(where, f"{named}: array {members[spec.name]!r} is {array.dtype.name}{list(array.shape)}; "
                       f"expected [steps, streams, ...] of {spec.describe()}")  # fmt: skip
            leading.add(tuple(array.shape[:2]) if array.ndim >= 2 else (0,))
        if len(leading) > 1 or any(0 in dims for dims in leading):
            r.fail(where, f"{named}: its arrays must share non-empty [steps, streams] dims")
