"""Models for the OpenVINO profile tests, loaded by workers through the `python` source kind."""

from __future__ import annotations

import torch

#: Input of both models: a batch of 16-float rows.
ROW_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 16]}]


class Unconvertible(torch.nn.Module):
    """A Linear after torch.special.bessel_j0, an op OpenVINO 2026.4 has no conversion rule for (eager runs it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.special.bessel_j0(x))


def unconvertible() -> torch.nn.Module:
    """The module above, in eval mode."""
    return Unconvertible().eval()
