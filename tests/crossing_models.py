"""A model whose profiles' speeds cross between widths: `jit`, traced at its smallest width, is far slower wide."""

from __future__ import annotations

import torch
from torch import nn

#: Widths 16..2048; traced at 16 (the declared example), served at 2048 in the test.
WIDE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, [16, 2048]]}]
#: Up to this width the running sum goes through a triangular matmul, past it through cumsum.
MATMUL_UP_TO = 64


class RunningSum(nn.Module):
    """Each row's running sum, two ways to the same answer: a width x width triangular matmul at small widths, cumsum
    at large ones. A trace at the smallest width records the matmul for every width (the branch is Python), so `jit`
    costs O(width^2) where eager costs O(width): about as fast at 16, thousands of times slower at 2048."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[1]
        if width <= MATMUL_UP_TO:
            return x @ torch.ones(width, width).triu()
        return torch.cumsum(x, dim=1)


def running_sum() -> nn.Module:
    """Factory for config: {"python": "tests.crossing_models:running_sum"}."""
    return RunningSum().eval()
