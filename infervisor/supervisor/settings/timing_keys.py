"""A model's `typical_shape`: the input size that is served, which pick "fastest" times its candidates at.

Read here, used by the worker (infervisor/worker/profiles/timing_size.py). Every input is named with a full shape
(batch included) that its declared spec accepts: a size the model would refuse cannot be the one it serves.
"""

from __future__ import annotations

from typing import Any

from infervisor.protocol.tensors import TensorDesc, TensorSpec
from infervisor.supervisor.settings.config_keys import ReadContext


def read_typical_shape(ctx: ReadContext, raw: Any, path: str) -> dict[str, list[int]] | None:
    """`{"image": [1, 3, 480, 640]}` -> the same, checked against `inputs`; null -> None."""
    r = ctx.fields
    if raw is None:
        return None
    specs: tuple[TensorSpec, ...] = ctx.earlier.get("inputs") or ()
    if not isinstance(raw, dict):
        r.fail(path, 'must be an object: input name -> its full shape (batch first), e.g. {"image": [1, 3, 480, 640]}')
        return None
    names = [spec.name for spec in specs]
    r.check_keys(raw, path, set(names))
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        where = f"{path}.{spec.name}"
        shape = raw.get(spec.name)
        if not (isinstance(shape, list) and all(type(d) is int and d > 0 for d in shape)):
            r.fail(where, f"must be the input's full shape as positive integers (every input is named), got {shape!r}")
            continue
        problem = spec.mismatch(TensorDesc(spec.name, spec.dtype, tuple(shape)))
        if problem is not None:
            r.fail(where, f"a size the model does not take: {problem}")
            continue
        shapes[spec.name] = shape
    batches = {shape[0] for shape in shapes.values()}
    if len(batches) > 1:
        r.fail(path, f"the inputs' first dims (the batch) differ: {sorted(batches)}")
    return shapes if len(shapes) == len(specs) and len(batches) == 1 else None
