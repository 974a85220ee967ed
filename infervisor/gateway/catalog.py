"""What the gateway knows about the daemon: its state and each model's inputs, read from status every second.

Outputs are not in the config with their types and shapes; the gateway learns them from the answers it forwards
(name, datatype, shape of the last answer, the first dimension -1 when the model's first input dimension varies).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infervisor.gateway.tensors import NUMPY_DTYPES
from infervisor.protocol.control_client import ControlError, control_request

#: How often status is read (a model's readiness in the protocol lags the daemon's by at most this).
REFRESH_S = 1.0
_SERVING_DAEMON = ("ready", "degraded")
_SERVING_MODEL = ("serving", "degraded")


@dataclass
class ModelEntry:
    """One served model as the protocol describes it."""

    name: str
    ready: bool
    inputs: list[dict[str, Any]]
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _dims(shape: list[Any]) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def _input_metadata(raw: dict[str, Any]) -> dict[str, Any]:
    return {"name": raw["name"], "datatype": NUMPY_DTYPES.get(raw["dtype"], raw["dtype"]), "shape": _dims(raw["shape"])}


class Catalog:
    """The daemon's state and models as of the last status read."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.daemon_state = "starting"
        self.models: dict[str, ModelEntry] = {}

    @property
    def ready(self) -> bool:
        """The daemon serves some model (ready or degraded)."""
        return self.daemon_state in _SERVING_DAEMON

    def refresh(self, status: dict[str, Any]) -> None:
        """Take a status document's state and models."""
        self.daemon_state = str(status.get("state"))
        models: dict[str, ModelEntry] = {}
        for name, row in status.get("models", {}).items():
            entry = ModelEntry(name, row.get("health") in _SERVING_MODEL, [_input_metadata(i) for i in row["inputs"]])
            old = self.models.get(name)
            if old is not None and [i["name"] for i in old.inputs] == [i["name"] for i in entry.inputs]:
                entry.outputs = old.outputs
            models[name] = entry
        self.models = models

    def learn_outputs(self, model: str, outputs: dict[str, np.ndarray[Any, Any]]) -> None:
        """Note the outputs' names, datatypes and shapes from an answer of `model`."""
        entry = self.models.get(model)
        if entry is None:
            return
        first_varies = bool(entry.inputs) and bool(entry.inputs[0]["shape"]) and entry.inputs[0]["shape"][0] == -1
        entry.outputs = {
            name: {
                "name": name,
                "datatype": NUMPY_DTYPES.get(array.dtype.name, array.dtype.name),
                "shape": [-1 if (i == 0 and first_varies) else int(d) for i, d in enumerate(array.shape)],
            }
            for name, array in outputs.items()
        }

    def metadata(self, name: str) -> dict[str, Any]:
        """The protocol's model metadata of a known model."""
        entry = self.models[name]
        return {
            "name": name,
            "versions": ["1"],
            "platform": "infervisor",
            "inputs": entry.inputs,
            "outputs": list(entry.outputs.values()),
        }

    async def keep_fresh(self) -> None:
        """Forever: read status (in a thread: the control client blocks) and take it."""
        while True:
            try:
                status = await asyncio.to_thread(control_request, self.runtime_dir, {"cmd": "status"}, 5.0)
            except ControlError:
                self.daemon_state = "unreachable"
            else:
                self.refresh(status)
            await asyncio.sleep(REFRESH_S)
