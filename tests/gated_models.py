"""A model whose build waits for a file: the test decides when the background builder may finish, with no sleeps.

`gated()` is a small linear layer. While torch.jit traces it (the `jit` profile's build) its forward waits until
the file named by INFERVISOR_TEST_GATE exists; serving eager never waits. So a worker serves eager at once while
the builder stays on `jit` for as long as the test keeps the gate shut.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

GATE_ENV = "INFERVISOR_TEST_GATE"
GATED_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 8]}]
#: The longest a build waits for the gate: a test that never opens it does not leave a builder for ever.
_GATE_LIMIT_S = 600.0


class Gated(torch.nn.Module):
    """y = x W + b with seeded weights; tracing it waits for the gate file."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(38)
        self.linear = torch.nn.Linear(8, 4)
        self.gate = Path(os.environ.get(GATE_ENV, "/nonexistent-gate"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            deadline = time.monotonic() + _GATE_LIMIT_S
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.linear(x)


def gated() -> torch.nn.Module:
    """Factory for config: {"python": "tests.gated_models:gated"}."""
    return Gated().eval()


def expected(x: np.ndarray) -> np.ndarray:
    """What the model answers for `x`, computed here in the test's process."""
    with torch.inference_mode():
        return Gated().eval()(torch.from_numpy(x)).numpy()
