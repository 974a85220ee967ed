"""A model whose forward starts processes outside its session, loaded by workers through the `python` source kind.

Input `x` float32[N, 2]: x[0, 0] picks the behaviour, x[0, 1] is its argument. SPAWN starts two long sleepers,
each in a session of its own: one a child of the worker, one daemonised (its parent exits at once), and answers
their pids; SLEEP sleeps `argument` seconds; anything else echoes.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import torch

TREE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 2]}]
ECHO, SPAWN, SLEEP = 0, 110, 102
_SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# Starts a sleeper in a new session, prints its pid and exits: the sleeper is orphaned at once.
_DAEMONISE = (
    "import subprocess, sys; "
    f"p = subprocess.Popen({_SLEEPER!r}, start_new_session=True, stdin=subprocess.DEVNULL, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"
)


class Spawner(torch.nn.Module):
    """Echoes, sleeps, or starts processes that try to outlive it."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[subprocess.Popen[bytes]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        command, argument = int(x[0, 0]), float(x[0, 1])
        if command == SPAWN:
            child = subprocess.Popen(_SLEEPER, start_new_session=True, stdin=subprocess.DEVNULL)
            self.spawned.append(child)
            orphan = int(subprocess.run([sys.executable, "-c", _DAEMONISE], capture_output=True, check=True).stdout)
            return torch.tensor([[float(child.pid), float(orphan)]])
        if command == SLEEP:
            time.sleep(argument)
        return x[:1]


def spawner() -> torch.nn.Module:
    """Factory for config: {"python": "tests.tree_models:spawner"}."""
    return Spawner()


def command(kind: int, argument: float = 0.0) -> dict[str, np.ndarray]:
    """The request input for one behaviour."""
    return {"x": np.array([[kind, argument]], dtype=np.float32)}


class Untraceable(torch.nn.Module):
    """Echoes in eager; refuses to be traced with a reason that holds a "; " (the jit profile is skipped)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            raise RuntimeError("this model cannot be traced; serve it with eager, or script it first")
        return x * 1.0


def untraceable() -> torch.nn.Module:
    """Factory for config: {"python": "tests.tree_models:untraceable"}."""
    return Untraceable()
