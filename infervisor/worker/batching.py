"""Joining a batch's inputs along dim 0 and giving each request its own rows of the outputs back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError

Outputs = list[tuple[str, np.ndarray[Any, Any]]]


def join(members: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One input per name: the members' tensors concatenated along dim 0, in member order."""
    return {name: torch.cat([member[name] for member in members]) for name in members[0]}


def split(outputs: Outputs, rows: Sequence[int]) -> list[Outputs]:
    """Each member's rows of every output (views, no copy); ProtocolError when an output is not batch-major."""
    total = sum(rows)
    for name, array in outputs:
        if array.ndim == 0 or array.shape[0] != total:
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"output {name!r} has shape {list(array.shape)}, not one row per input row ({total}): "
                "this model cannot be batched",
            )
    bounds = np.cumsum([0, *rows])
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    return [[(name, array[start:end]) for name, array in outputs] for start, end in spans]
