"""The stateful model bench/streams.py serves (`bench.stream_models:gru`): a GRU step, state in and state out."""

from __future__ import annotations

import torch
from torch import nn

#: A voice-activity-sized recurrent step: 64 features a chunk, a 256-wide hidden state, two scores out.
FEATURES = 64
HIDDEN = 256


class GruStep(nn.Module):
    """One step of a GRU over a chunk's features, and a two-way score from its new state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.GRUCell(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.cell(x, h)
        return self.head(state), state


def gru() -> nn.Module:
    """The factory the config names (seeded weights)."""
    return GruStep().eval()
