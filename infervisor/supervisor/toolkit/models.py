"""The models `bench` and `optimize` measure: a built-in, or any model of a config file, as a launch spec and entry.

Torch-free: the measuring itself runs in `python -m infervisor.worker.bench` children, which take the launch
spec as JSON, and in a daemon started on a config made from the entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infervisor.common.builtin_models import BUILTIN_MODELS
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.supervisor.settings.config import Config
from infervisor.supervisor.settings.model_entry import ModelConfig

#: Input specs of the built-ins (dynamic batch), as a config would declare them.
BUILTIN_INPUTS: dict[str, list[dict[str, Any]]] = {
    "resnet50": [{"name": "image", "dtype": "float32", "shape": [None, 3, 224, 224]}],
    "resnet18": [{"name": "image", "dtype": "float32", "shape": [None, 3, 224, 224]}],
    "encoder": [
        {"name": "input_ids", "dtype": "int64", "shape": [None, 128]},
        {"name": "attention_mask", "dtype": "int64", "shape": [None, 128]},
    ],
    "tiny": [{"name": "x", "dtype": "float32", "shape": [None, 16]}],
}


class UnknownModel(Exception):
    """A name that is neither a built-in nor a model of the config; the message lists both."""


@dataclass(frozen=True)
class Measured:
    """One model to measure: its config (None for a plain built-in), and its entry for a daemon to serve it."""

    name: str
    model: ModelConfig | None
    #: A config.json model entry with absolute paths, ready for a temporary daemon's config.
    entry: dict[str, Any]
    #: The folder its config's python modules are found in (None: a built-in, nothing to find).
    source_dir: Path | None = None

    def launch(self, threads: int, cache_dir: Path) -> LaunchSpec | None:
        """The launch spec of a configured model for a measuring child (a built-in needs none: --model)."""
        return launch_of(self.model, threads, cache_dir) if self.model is not None else None


def source_entry(source: ModelSource) -> dict[str, str]:
    """The config's `source` object of a parsed source (files as absolute paths)."""
    if source.kind in ("builtin", "python"):
        return {source.kind: str(source.name)}
    return {source.kind: str(source.path)}


def launch_of(
    model: ModelConfig, threads: int, cache_dir: Path, calibration: str | None = None, validation: str | None = None
) -> LaunchSpec:
    """The launch spec a worker of `model` would get, at `threads`, for a measuring child."""
    return LaunchSpec(
        "measure", model.name, -1, model.source, model.inputs, model.outputs, (), threads,
        channels_last=model.channels_last, cache_dir=str(cache_dir),
        calibration=calibration or model.calibration, validation=validation or model.validation,
        tolerance=dict(model.tolerance), profiles=model.profiles, pick=model.pick,
        # What the gate and the timing read besides: the state pairs (the sequence walk) and the size timed at.
        typical_shape=model.typical_shape, state=model.state, sequence_steps=model.sequence_steps,
    )  # fmt: skip


def entry_of(model: ModelConfig, raw: dict[str, Any]) -> dict[str, Any]:
    """The model's entry as written in its config, with its source and data sets made absolute."""
    entry = {**raw, "source": source_entry(model.source)}
    for key in ("calibration", "validation"):
        value = getattr(model, key)
        if value is not None:
            entry[key] = value
        else:
            entry.pop(key, None)
    return entry


def resolve(name: str, config: Config | None, config_path: Path | None, prefer_config: bool) -> Measured:
    """`name` as a model of the config (first when prefer_config) or as a built-in; UnknownModel otherwise."""
    in_config = config is not None and name in config.models
    if in_config and config is not None and config_path is not None and (prefer_config or name not in BUILTIN_MODELS):
        model = config.models[name]
        raw = json.loads(config_path.read_text())["models"][name]
        return Measured(name, model, entry_of(model, raw), config_path.parent.resolve())
    if name in BUILTIN_MODELS:
        return Measured(name, None, {"source": {"builtin": name}, "inputs": BUILTIN_INPUTS[name]})
    configured = sorted(config.models) if config is not None else []
    where = f"; {config_path} has {', '.join(configured) or 'no models'}" if config_path is not None else ""
    raise UnknownModel(f"no model {name!r}: built-ins are {', '.join(BUILTIN_MODELS)}{where}")
