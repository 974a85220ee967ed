"""A model that takes a minute to load, so a worker orphaned during start-up is still alive when a test looks."""

from __future__ import annotations

import time

import torch


def slow_to_load() -> torch.nn.Module:
    """Factory for config: {"python": "tests.startup_models:slow_to_load"}; sleeps 60 s, then a Linear 16 -> 16."""
    # Long enough that only the parent-death signal (or the parent check after it) can end the
    # worker inside a test's window: it reads its link, and so notices a dead supervisor, only after loading.
    time.sleep(60)
    return torch.nn.Linear(16, 16)
