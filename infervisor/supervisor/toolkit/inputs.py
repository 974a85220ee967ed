"""Request inputs drawn as a model's declared spec (its status shape and `synthetic`) says, for the CLI and tools."""

from __future__ import annotations

from typing import Any

import numpy as np


def random_shape(shape: list[Any], batch: int) -> tuple[int, ...]:
    """A status shape (integers, null, [min, max]) made concrete: every open dim is `batch`, raised to its min.

    Never lowered to its max: a --batch over the bound reaches the daemon, which refuses it naming the bound.
    """
    return tuple(d if isinstance(d, int) else max(batch, d[0]) if isinstance(d, list) else batch for d in shape)


def random_inputs(spec: list[dict[str, Any]], batch: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """Arrays of a declared input spec, drawn as its `synthetic` says (else normal floats, ones for integers).

    Every open dim is `batch` raised to its min (random_shape): for a CLI request, not for measuring (inputs_at).
    """
    return inputs_at(spec, {item["name"]: random_shape(item["shape"], batch) for item in spec}, seed)


def inputs_at(
    spec: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]], seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """Arrays of a declared input spec at the given full shapes (the sizes measured at), drawn as random_inputs."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for item in spec:
        shape = tuple(shapes[item["name"]])
        dtype = np.dtype(item["dtype"])
        synthetic = item.get("synthetic") or {}
        distribution = synthetic.get("distribution")
        values: np.ndarray[Any, Any]
        if distribution == "normal":
            values = rng.normal(synthetic["mean"], synthetic["std"], shape)
        elif distribution == "uniform":
            values = rng.uniform(synthetic["low"], synthetic["high"], shape)
        elif distribution == "integers":
            values = rng.integers(synthetic["low"], synthetic["high"], shape)
        elif dtype.kind == "f":
            values = rng.standard_normal(shape)
        else:
            values = np.ones(shape)
        arrays[item["name"]] = values.astype(dtype)
    return arrays
