"""Built-in models, built in code from a fixed seed so every process gets the same weights."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infervisor.worker.models.encoder import encoder
from infervisor.worker.models.resnet import resnet18, resnet50
from infervisor.worker.models.tiny import tiny

BUILTINS: dict[str, Callable[[], nn.Module]] = {
    "resnet50": resnet50,
    "resnet18": resnet18,
    "encoder": encoder,
    "tiny": tiny,
}

#: Output names of each built-in (the wire names of its result tensors).
BUILTIN_OUTPUTS: dict[str, tuple[str, ...]] = {
    "resnet50": ("logits",),
    "resnet18": ("logits",),
    "encoder": ("embedding",),
    "tiny": ("y",),
}

WEIGHT_SEED = 20261129


def build_builtin(name: str) -> nn.Module:
    """The named built-in in eval mode with its seeded weights; KeyError names the choices."""
    if name not in BUILTINS:
        raise KeyError(f"no built-in model {name!r}; built-ins are {sorted(BUILTINS)}")
    # fork_rng keeps the caller's global RNG untouched while weights come from our fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        model = BUILTINS[name]()
    return model.eval()
