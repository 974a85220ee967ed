"""A keyword classifier over raw audio of any length (a small 1-D CNN), served through the `python` source."""

from __future__ import annotations

import torch
from torch import nn

#: Mono audio, 1,000 to 32,000 samples a request (62 ms to 2 s at 16 kHz).
AUDIO_INPUTS = [{"name": "audio", "dtype": "float32", "shape": [None, 1, [1000, 32000]]}]


def keyword_cnn() -> nn.Module:
    """Strided convolutions and max-pools over the samples, then a mean over time and 12 keyword logits: its cost
    grows with the length (x30 from 1,000 to 32,000 samples). Factory: {"python": "tests.audio_models:keyword_cnn"}."""
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Conv1d(1, 32, kernel_size=80, stride=4),
        nn.ReLU(),
        nn.MaxPool1d(4),
        nn.Conv1d(32, 32, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool1d(4),
        nn.Conv1d(32, 64, kernel_size=3),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(64, 12),
    ).eval()
