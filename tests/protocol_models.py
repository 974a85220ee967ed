"""Models for tests/test_protocol_agree.py: one whose output key is "", and two whose next start a flag file decides.

The flag files live in the folder named by $INFERVISOR_TEST_FLAGS (the daemon's environment reaches its workers):
`NAME.fail` makes the next load of model NAME raise, `NAME.slow` holds the load until the file is gone (at most 60 s).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

FLAGS_ENV = "INFERVISOR_TEST_FLAGS"
#: How long a held load waits for its `.slow` flag to go, at most.
HOLD_LIMIT_S = 60.0


class BlankKey(torch.nn.Module):
    """Returns its input under the dict key "", a name the wire refuses (docs/protocol.md section 5)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"": x * 2}


def blank_key() -> torch.nn.Module:
    """Factory for config: {"python": "tests.protocol_models:blank_key"}."""
    return BlankKey()


def _flagged(name: str) -> torch.nn.Module:
    folder = Path(os.environ[FLAGS_ENV])
    if (folder / f"{name}.fail").exists():
        raise RuntimeError(f"{name}: told to fail by its flag file")
    held_until = time.monotonic() + HOLD_LIMIT_S
    while (folder / f"{name}.slow").exists() and time.monotonic() < held_until:
        time.sleep(0.05)
    return torch.nn.Linear(16, 16)


def drain_model() -> torch.nn.Module:
    """Factory for config: {"python": "tests.protocol_models:drain_model"} (flags `drain.fail`, `drain.slow`)."""
    return _flagged("drain")


def surge_model() -> torch.nn.Module:
    """Factory for config: {"python": "tests.protocol_models:surge_model"} (flags `surge.fail`, `surge.slow`)."""
    return _flagged("surge")
