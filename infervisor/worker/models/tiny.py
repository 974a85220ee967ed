"""A single Linear 16->16: the model whose latency is all overhead."""

from __future__ import annotations

from torch import nn


def tiny() -> nn.Module:
    """Linear 16 -> 16 for transport-overhead measurements."""
    return nn.Sequential(nn.Linear(16, 16))
