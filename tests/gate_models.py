"""Models for the accuracy-gate tests, served through the `python` source (`tests.gate_models:NAME`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

#: A sample on which bf16 loses the answer: x0 - x1 cancels, and bf16 rounds 1.001 to 1.0.
ADVERSARIAL = np.array([[1.001, 1.0, 0.001, 0.0]], np.float32)


class BatchDependent(nn.Module):
    """out = [x0 - x1, x2], by a Linear at batch 1 and by exact element-wise ops at any other batch size.

    In fp32 both paths agree; under bf16 autocast only the Linear runs in bf16, so a batch-1 answer can
    be wrong while the same sample in a batch is right, as when a kernel's numerics differ by batch size.
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.linear(x)
        return torch.stack([x[:, 0] - x[:, 1], x[:, 2]], dim=1)


def batch_dependent() -> nn.Module:
    """The factory the config names."""
    return BatchDependent().eval()


def validation_samples(adversarial_at: int | None, count: int = 4) -> np.ndarray:
    """`count` ordinary samples (seeded normal), the adversarial one at `adversarial_at` (None: none)."""
    samples = np.random.default_rng(3).standard_normal((count, 4)).astype(np.float32)
    if adversarial_at is not None:
        samples[adversarial_at] = ADVERSARIAL[0]
    return samples
