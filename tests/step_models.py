"""Models that take some sizes only, for the dims-in-steps tests, served through `tests.step_models:NAME`."""

from __future__ import annotations

import torch
from torch import nn


class Blocks32(nn.Module):
    """A conv, then H and W cut into blocks of 32 (a reshape that fails off a multiple of 32, as a detector's
    stride-32 feature map does), pooled per block: the output is [N, 4, H / 32, W / 32]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        features = self.conv(x)
        blocks = features.reshape(batch, 4, height // 32, 32, width // 32, 32)
        return blocks.amax(dim=(3, 5))


def blocks32() -> nn.Module:
    """The factory the config names (seeded weights)."""
    torch.manual_seed(0)
    return Blocks32().eval()


class OddCrop(nn.Module):
    """A conv whose output loses its last row at odd heights: a trace at the (even) example bakes the branch in, so
    a converted program answers odd heights with eager's shape + 1 row."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        if x.shape[2] % 2:
            return out[:, :, :-1]
        return out


def odd_crop() -> nn.Module:
    """The factory the config names (seeded weights)."""
    torch.manual_seed(0)
    return OddCrop().eval()
