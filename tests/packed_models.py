"""Models for the gate on parts of an output and for the pick timed at the served size, served through `python`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

#: How far the traced (`jit`) graph of ScoresOffWhenTraced moves every class score.
SCORE_SHIFT = 0.15
#: A packed head of 4 box coordinates (pixels, 0..320) and 4 class scores (0..1) per anchor, over 64 anchors.
PACKED_INPUTS = [{"name": "image", "dtype": "float32", "shape": [None, 3, 32, 32]}]
BOXES, CLASSES = 4, 4


class ScoresOffWhenTraced(nn.Module):
    """`pred` [batch, 4 + 4, 64]: boxes in pixels, then sigmoid scores; the traced graph adds SCORE_SHIFT to the scores
    alone, as bf16 moved a real detector's scores while its coordinates kept the row's cosine at 0.99997."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.stem = nn.Conv2d(3, 8, 3, stride=4, padding=1)
        self.head = nn.Conv2d(8, BOXES + CLASSES, 1)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        raw = self.head(torch.relu(self.stem(image))).flatten(2)  # [batch, 8, 64]
        boxes = torch.sigmoid(raw[:, :BOXES]) * 320.0
        scores = torch.sigmoid(raw[:, BOXES:])
        if torch.jit.is_tracing():
            scores = scores + SCORE_SHIFT
        return torch.cat([boxes, scores], dim=1)


def scores_off_when_traced() -> nn.Module:
    """Factory for config: {"python": "tests.packed_models:scores_off_when_traced"}."""
    return ScoresOffWhenTraced().eval()


def same_detections(eager: dict[str, Any], profile: dict[str, Any]) -> tuple[bool, str]:
    """A task check: the detections kept at score 0.5 (anchor, class) must be the same as eager's."""
    want, got = eager["pred"][:, BOXES:] > 0.5, profile["pred"][:, BOXES:] > 0.5
    if not np.array_equal(want, got):
        return False, f"{int(want.sum())} detections above 0.5 from eager, {int(got.sum())} from the profile"
    return True, f"{int(want.sum())} detections agree"


def raises(eager: dict[str, Any], profile: dict[str, Any]) -> tuple[bool, str]:
    """A task check that fails by raising."""
    raise KeyError("boxes")


#: Open image sizes from 16 to 40: the traced graph's cost grows with the square of the pixels, eager's does not.
SIZED_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 3, [16, 40], [16, 40]]}]


class SlowerWhenTracedAtLargeSizes(nn.Module):
    """The same answer either way (a 1x1 conv), plus work whose result is exactly 0: eager multiplies a fixed
    192x192 matrix (about 7 M multiply-adds whatever the size), the traced graph a pixels x pixels Gram matrix (0.2 M
    at 16x16, 7.7 M at 40x40, in a slower kernel). So the traced (`jit`) profile is far faster at the smallest size
    and far slower at the largest: which one a fastest pick serves depends on the size it times at, by ratios no noise
    can blur."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(9)
        self.mix = nn.Conv2d(3, 4, 1)
        self.register_buffer("fixed", torch.randn(192, 192, generator=generator) / 14.0)
        with torch.no_grad():
            for parameter in self.mix.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mix(x)
        if torch.jit.is_tracing():
            pixels = x.flatten(2)
            work = pixels.transpose(1, 2) @ pixels
        else:
            work = self.fixed @ self.fixed @ self.fixed
        return y + work.mean().clamp(0.0, 0.0)  # exactly 0: the answer never depends on which path ran


def slower_when_traced_at_large_sizes() -> nn.Module:
    """Factory for config: {"python": "tests.packed_models:slower_when_traced_at_large_sizes"}."""
    return SlowerWhenTracedAtLargeSizes().eval()
