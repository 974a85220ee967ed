"""Models for the per-output gate and statefulness tests, served through the `python` source."""

from __future__ import annotations

import torch
from torch import nn

#: How far the traced (`jit`) graph of ScoreOffWhenTraced moves the score: 5% of it.
SCORE_FACTOR = 1.05
SCORE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 4]}]


class ScoreOffWhenTraced(nn.Module):
    """(embedding of 16 values, one probability per row); the traced graph gives the same embedding and the probability
    5% higher, as a profile whose numerics move a scalar head would. Neither a per-row cosine of the joined outputs
    nor one over the score alone can see it."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.embed = nn.Linear(4, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedding = torch.tanh(self.embed(x))
        score = torch.sigmoid(self.head(embedding))
        if torch.jit.is_tracing():
            score = score * SCORE_FACTOR
        return embedding, score


def score_off_when_traced() -> nn.Module:
    """Factory for config: {"python": "tests.measure_models:score_off_when_traced"}."""
    return ScoreOffWhenTraced().eval()


IMAGE_INPUTS = [{"name": "image", "dtype": "float32", "shape": [None, 3, 12, 12]}]


def conv_only() -> nn.Module:
    """A fully convolutional network (3x3 convs, a max-pool, a 1x1 head): nothing for dynamic int8 to quantize."""
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 2, 1),
    ).eval()


class CountsCalls(nn.Module):
    """Adds how often it was called to its input: the count lives in a buffer, as a streaming model's state would."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.calls


def counts_calls() -> nn.Module:
    """Factory for config: {"python": "tests.measure_models:counts_calls"}."""
    return CountsCalls().eval()


class ScriptedState(nn.Module):
    """A streaming cell as TorchScript ships it: the state is a plain attribute (no buffer) that forward replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.state = torch.zeros(1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = torch.tanh(self.state + x.mean(dim=0, keepdim=True))
        return x * self.state


class CarriedState(nn.Module):
    """The servable form of the same cell: the state comes in and goes out, one row per stream."""

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new_state = torch.tanh(state + x)
        return x * new_state, new_state


def carried_state() -> nn.Module:
    """Factory for config: {"python": "tests.measure_models:carried_state"}."""
    return CarriedState().eval()


STATE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 4]}]
CARRIED_INPUTS = [*STATE_INPUTS, {"name": "state", "dtype": "float32", "shape": [None, 4]}]
