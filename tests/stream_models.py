"""A tiny stateful model for tests/test_streams.py: the state is an explicit input and output (h in, h_next out).

Every operation is elementwise, so a row's answer is the same bits alone or batched with other streams' rows:
an answer equal to the step-by-step reference is exact, not within a tolerance.
"""

from __future__ import annotations

import time

import numpy as np
import torch

#: One step's input: one row of FEATURES values.
FEATURES = 8
#: One stream's state: STATE_ROWS × FEATURES (the config declares `h` as [null, STATE_ROWS, FEATURES]).
STATE_ROWS = 2
#: A row whose first value is SLEEP holds the forward pass for its second value in seconds (a step kept in flight).
SLEEP = 12345.0


class Leaky(torch.nn.Module):
    """h_next = tanh(0.5 h + x) per state row; y = 2 h_next summed over the state rows (depends on every past step)."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> dict[str, torch.Tensor]:
        held = x[x[:, 0] == SLEEP]
        if held.shape[0]:
            time.sleep(float(held[0, 1]))
        h_next = torch.tanh(0.5 * h + x.unsqueeze(1))
        return {"y": (2.0 * h_next).sum(dim=1), "h_next": h_next}


def leaky() -> torch.nn.Module:
    """Factory for config: {"python": "tests.stream_models:leaky"}."""
    return Leaky()


def reference(chunks: list[np.ndarray], state_rows: int = STATE_ROWS) -> tuple[list[np.ndarray], np.ndarray]:
    """Each step's `y` and the final state, computed step by step in this process from the zero state."""
    model = Leaky()
    h = torch.zeros((1, state_rows, FEATURES), dtype=torch.float32)
    answers = []
    with torch.no_grad():
        for chunk in chunks:
            out = model(torch.from_numpy(chunk), h)
            h = out["h_next"]
            answers.append(out["y"].numpy().copy())
    return answers, h.numpy()
