"""Stateful test models for the sequence gate (`tests.sequence_models:X`): state in, state out, nothing kept."""

from __future__ import annotations

import torch
from torch import nn

#: What the traced graph (the `jit` profile) of DriftsWhenTraced adds to the state at every step, along one fixed
#: direction: far inside the tolerance on one call, past it after a hundred-odd steps of feeding it back.
DRIFT = 6e-4
STATE_INPUTS = [
    {"name": "x", "dtype": "float32", "shape": [None, 8]},
    {"name": "h", "dtype": "float32", "shape": [None, 16]},
]
STATE = [{"input": "h", "output": "h_out", "dtype": "float32", "shape": [16]}]


class DriftsWhenTraced(nn.Module):
    """An integrator, h' = h + 0.05 tanh(W x), read out by a linear head; traced, it also adds DRIFT along a fixed
    unit vector, so its state walks away from eager's by DRIFT a step while eager's grows like the square root of
    the steps: cosine 0.99999 after one step, below 0.999 a hundred-odd steps on."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.features = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            self.features.bias.zero_()  # zero-mean steps: eager's state grows like the square root of the steps
        direction = torch.randn(16, generator=generator)
        self.register_buffer("direction", direction / direction.norm())

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = h + 0.05 * torch.tanh(self.features(x))
        if torch.jit.is_tracing():
            state = state + DRIFT * self.direction
        return self.head(state), state


def drifts_when_traced() -> nn.Module:
    """The factory the config names."""
    return DriftsWhenTraced().eval()


class SmallGru(nn.Module):
    """A GRU cell and a linear head: its traced graph computes what eager does, step after step."""

    def __init__(self, features: int = 8, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.GRUCell(features, hidden)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.cell(x, h)
        return self.head(state), state


def small_gru() -> nn.Module:
    """The factory the config names."""
    return SmallGru().eval()
