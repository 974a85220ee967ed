"""A TorchScript model whose run time the request chooses: x[0, 0] rounds of a 256x256 matmul."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SLOW_INPUTS = [{"name": "x", "dtype": "float32", "shape": [1, 1]}]


class Burn(torch.nn.Module):
    """Spends CPU in proportion to its input, so tests can hold a worker busy without sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.eye(256) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rounds = int(x[0, 0].item())
        state = torch.ones(256, 256)
        for _ in range(rounds):
            state = torch.tanh(state @ self.weight)
        return state[:1, :1] + x


def write_slow_model(folder: Path) -> Path:
    """Script and save the model; returns its path."""
    path = folder / "burn.pt"
    torch.jit.script(Burn()).save(str(path))
    return path


def rounds(n: int) -> dict[str, np.ndarray]:
    """The input that asks for `n` rounds."""
    return {"x": np.array([[float(n)]], dtype=np.float32)}
