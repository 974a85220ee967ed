"""A stateful model's declared state: which input takes a stream's state and which output gives it back.

The model stays stateless (state in, state out); the daemon keeps each stream's state between its steps.
State tensors are batch-first like every input: one stream's state is `shape`, a batch of streams stacks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StateSpec:
    """One state pair of a model entry's `state` key."""

    #: The declared input the stream's state is fed to (its spec is `[null, *shape]` of `dtype`).
    input: str
    #: The model output that carries the next state.
    output: str
    dtype: str
    #: One stream's state, without the batch dim.
    shape: tuple[int, ...]
    #: Absolute path of a `.npy` holding the initial state (of `shape` and `dtype`); None: zeros.
    initial: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the LaunchSpec carries."""
        return {
            "input": self.input,
            "output": self.output,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "initial": self.initial,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StateSpec:
        """Read what to_dict wrote; raises KeyError/TypeError on anything else."""
        return cls(
            input=str(raw["input"]),
            output=str(raw["output"]),
            dtype=str(raw["dtype"]),
            shape=tuple(int(d) for d in raw["shape"]),
            initial=None if raw.get("initial") is None else str(raw["initial"]),
        )
