"""Models with variable spatial sizes for the shape-coverage tests, served through `tests.shape_models:NAME`."""

from __future__ import annotations

import torch
from torch import nn


class FullyConvolutional(nn.Module):
    """3x3 convs, a ceil-mode 2x2 max-pool and a 1x1 head: the output's H, W follow the input's, rounded up."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.relu1 = nn.ReLU()
        self.pool = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.relu2 = nn.ReLU()
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.relu2(self.conv2(self.pool(self.relu1(self.conv1(x))))))


def fully_convolutional() -> nn.Module:
    """The factory the config names (seeded weights)."""
    torch.manual_seed(0)
    return FullyConvolutional().eval()


def convolutional_without_pooling() -> nn.Module:
    """3x3 convs and a 1x1 head, no pooling: every H, W answers the same shape through any profile (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 2, 1)).eval()


class LineRecognizer(nn.Module):
    """A text-line recogniser: convolutions down to a sequence over the width, a BiLSTM and a per-step head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.lstm = nn.LSTM(8 * 16, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.pool2(self.relu2(self.conv2(self.pool1(self.relu1(self.conv1(x))))))
        batch, channels, height, width = features.shape
        steps = features.permute(0, 3, 1, 2).reshape(batch, width, channels * height)
        out, _ = self.lstm(steps)
        return self.head(out).log_softmax(-1)


def line_recognizer() -> nn.Module:
    """The factory the config names (seeded weights)."""
    torch.manual_seed(0)
    return LineRecognizer().eval()
