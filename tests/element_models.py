"""Models whose traced (`jit`) graph is off in one element of a long row, or in the score columns of a flat packed
row: the cosine of the row cannot see either (the gate's element and column-group measures do)."""

from __future__ import annotations

import torch
from torch import nn

#: A per-frame pitch: 1000 frames of 8 features each, one f0 in Hz per frame.
FRAMES, FEATURES = 1000, 8
PITCH_INPUTS = [{"name": "frames", "dtype": "float32", "shape": [None, FRAMES, FEATURES]}]
#: The frame the traced graph answers an octave up.
OCTAVE_FRAME = 137
#: A flat packed head: 4 box coordinates in pixels (0..640) then 12 class scores (0..1) per image.
BOXES, CLASSES = 4, 12
PACKED_INPUTS = [{"name": "image", "dtype": "float32", "shape": [None, 3, 32, 32]}]
#: How far the traced graph of the packed head moves every class score.
SCORE_SHIFT = 0.15


def _seeded(module: nn.Module, seed: int, scale: float) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return module.eval()


class OctaveOffWhenTraced(nn.Module):
    """`f0` [batch, 1000] in Hz (80..380); the traced graph doubles frame OCTAVE_FRAME, as a pitch model's bf16
    answered frames an octave off while its row cosine stayed above 0.99."""

    def __init__(self) -> None:
        super().__init__()
        self.frame = nn.Linear(FEATURES, 1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        f0 = 80.0 + 300.0 * torch.sigmoid(self.frame(frames).squeeze(-1))
        if torch.jit.is_tracing():
            octave = torch.ones(FRAMES)
            octave[OCTAVE_FRAME] = 2.0
            f0 = f0 * octave
        return f0


def octave_off_when_traced() -> nn.Module:
    """Factory for config: {"python": "tests.element_models:octave_off_when_traced"}."""
    return _seeded(OctaveOffWhenTraced(), 7, 0.5)


class FlatScoresOffWhenTraced(nn.Module):
    """`pred` [batch, 16]: 4 box coordinates in pixels then 12 sigmoid scores; the traced graph adds SCORE_SHIFT to
    the scores alone (the row's cosine stays at 0.99999)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=4, padding=1)
        self.head = nn.Linear(8, BOXES + CLASSES)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        raw = self.head(torch.relu(self.stem(image)).mean(dim=(2, 3)))
        boxes = torch.sigmoid(raw[:, :BOXES]) * 640.0
        scores = torch.sigmoid(raw[:, BOXES:])
        if torch.jit.is_tracing():
            scores = scores + SCORE_SHIFT
        return torch.cat([boxes, scores], dim=1)


def flat_scores_off_when_traced() -> nn.Module:
    """Factory for config: {"python": "tests.element_models:flat_scores_off_when_traced"}."""
    return _seeded(FlatScoresOffWhenTraced(), 5, 0.3)


class OctaveOffWhenLoud(OctaveOffWhenTraced):
    """As OctaveOffWhenTraced, but the traced graph doubles frame OCTAVE_FRAME only where that frame's first feature
    is above 1: exact on a validation set without such frames, an octave off on traffic with them."""

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        f0 = 80.0 + 300.0 * torch.sigmoid(self.frame(frames).squeeze(-1))
        if torch.jit.is_tracing():
            loud = (frames[:, OCTAVE_FRAME, 0] > 1.0).to(f0.dtype)
            octave = torch.ones(FRAMES)
            octave[OCTAVE_FRAME] = 0.0
            f0 = f0 * (octave + torch.outer(loud + 1.0, 1.0 - octave))
        return f0


def octave_off_when_loud() -> nn.Module:
    """Factory for config: {"python": "tests.element_models:octave_off_when_loud"}."""
    return _seeded(OctaveOffWhenLoud(), 7, 0.5)
