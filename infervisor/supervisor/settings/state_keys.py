"""A model entry's `state` key: the state pairs of a stateful model, checked against its declared inputs.

Each pair names an input (batch-first, every other dim fixed) and the output that returns the next state,
with an optional initial value from a `.npy` file that must pass the strict modes.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from infervisor.common.strict_modes import UnsafePath, read_small_file
from infervisor.protocol.state import StateSpec
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.settings.config_keys import ReadContext

#: State pairs one model may declare.
MAX_STATE_PAIRS = 16
#: Largest initial-state file read when the config is read.
MAX_INITIAL_BYTES = 64 * 1024 * 1024
_PAIR_KEYS = {"input", "output", "dtype", "shape", "initial"}


def read_state(ctx: ReadContext, raw: Any, path: str) -> tuple[StateSpec, ...]:
    """`[{"input", "output", "dtype"?, "shape"?, "initial"?}, ...]` or null/[]: no state."""
    r = ctx.fields
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_STATE_PAIRS:
        r.fail(path, f"must be an array of at most {MAX_STATE_PAIRS} objects {{input, output, dtype, shape, initial}}")
        return ()
    inputs = {spec.name: spec for spec in ctx.earlier.get("inputs") or ()}
    outputs = ctx.earlier.get("outputs")
    pairs: list[StateSpec] = []
    for index, entry in enumerate(raw):
        pair = _read_pair(ctx, entry, f"{path}[{index}]", inputs, outputs)
        if pair is not None:
            pairs.append(pair)
    for kind in ("input", "output"):
        names = [getattr(pair, kind) for pair in pairs]
        if len(set(names)) != len(names):
            r.fail(path, f"names one {kind} in two pairs")
    return tuple(pairs)


def _read_pair(
    ctx: ReadContext, entry: Any, where: str, inputs: dict[str, TensorSpec], outputs: tuple[str, ...] | None
) -> StateSpec | None:
    r = ctx.fields
    if not isinstance(entry, dict):
        r.fail(where, "must be an object {input, output, dtype, shape, initial}")
        return None
    r.check_keys(entry, where, _PAIR_KEYS)
    name, output = entry.get("input"), entry.get("output")
    if not isinstance(name, str) or name not in inputs:
        r.fail(f"{where}.input", f"must name a declared input ({', '.join(inputs)}), got {name!r}")
        return None
    if not isinstance(output, str) or not output:
        r.fail(f"{where}.output", f"must be an output name, got {output!r}")
        return None
    if outputs is not None and output not in outputs:
        r.fail(f"{where}.output", f"is not one of the declared outputs ({', '.join(outputs)})")
        return None
    spec = inputs[name]
    fixed = spec.shape[1:]
    if not spec.shape or spec.shape[0] is not None or any(d is None for d in fixed):
        r.fail(f"{where}.input", f"input {name!r} must be [null, ...fixed dims] (batch first, one stream's state "
               f"fixed), got {spec.describe()}")  # fmt: skip
        return None
    shape = tuple(int(d) for d in fixed if d is not None)
    if entry.get("dtype", spec.dtype) != spec.dtype:
        r.fail(f"{where}.dtype", f"is {entry.get('dtype')!r} but input {name!r} is {spec.dtype}")
    declared = entry.get("shape", list(shape))
    if declared != list(shape):
        r.fail(f"{where}.shape", f"is {declared!r} but input {name!r} holds one stream's state as {list(shape)}")
    initial = _read_initial(ctx, entry.get("initial"), f"{where}.initial", spec.dtype, shape)
    return StateSpec(input=name, output=output, dtype=spec.dtype, shape=shape, initial=initial)


def _read_initial(ctx: ReadContext, raw: Any, where: str, dtype: str, shape: tuple[int, ...]) -> str | None:
    """ "zeros"/null, or a `.npy` path (relative to config.json's folder) of exactly `dtype` and `shape`."""
    if raw is None or raw == "zeros":
        return None
    if not isinstance(raw, str) or not raw.endswith(".npy"):
        ctx.fields.fail(where, f'must be "zeros", null or a path to a .npy file, got {raw!r}')
        return None
    file = Path(raw) if Path(raw).is_absolute() else ctx.base / raw
    problem = initial_state_problem(file, dtype, shape)
    if problem is not None:
        ctx.fields.fail(where, problem)
    return str(file)


def initial_state_problem(file: Path, dtype: str, shape: tuple[int, ...]) -> str | None:
    """Why `file` cannot be a stream's initial state (unsafe, unreadable, another dtype or shape), or None."""
    import numpy as np  # only when a state file is configured

    try:
        data = read_small_file(file, "initial state", limit=MAX_INITIAL_BYTES)
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except UnsafePath as exc:
        return str(exc)
    except (OSError, ValueError) as exc:
        return f"cannot read {file} as .npy: {exc}"
    if not isinstance(array, np.ndarray) or array.dtype.name != dtype or tuple(array.shape) != shape:
        got = f"{array.dtype.name}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
        return f"{file} holds {got}; the state is {dtype}{list(shape)}"
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return f"{file} holds values that are not finite"
    return None


def load_initial_state(spec: StateSpec) -> Any:
    """The initial state of one stream as a numpy array (zeros unless a file is declared; checked again here)."""
    import numpy as np

    if spec.initial is None:
        return np.zeros(spec.shape, dtype=spec.dtype)
    problem = initial_state_problem(Path(spec.initial), spec.dtype, spec.shape)
    if problem is not None:
        raise ValueError(problem)
    return np.load(io.BytesIO(read_small_file(Path(spec.initial), "initial state", limit=MAX_INITIAL_BYTES)))
