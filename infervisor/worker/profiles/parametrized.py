"""Weights computed by parametrizations (weight_norm, spectral_norm, any `torch.nn.utils.parametrize`) baked into
plain tensors before a model is quantized.

The quantizer picks layers by module type: a Linear under `parametrizations.weight_norm` is a `ParametrizedLinear`,
and its weight is computed in the graph from `original0` and `original1`, so neither int8_dynamic nor int8_static
would see a Linear there. In eval mode a parametrized weight is the same tensor on every call, so baking it in
(on a copy: the eager module keeps its parametrizations) changes no output.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.utils import parametrize


def parametrized_layers(module: Any) -> list[str]:
    """Names of the submodules whose weights a parametrization or a weight_norm hook computes."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [name or "(root)" for name, child in module.named_modules() if _parametrized(child)]


def _parametrized(child: torch.nn.Module) -> bool:
    return parametrize.is_parametrized(child) or any(_is_weight_norm_hook(h) for h in child._forward_pre_hooks.values())


def _is_weight_norm_hook(hook: object) -> bool:
    return type(hook).__name__ == "WeightNorm"


def baked(module: Any) -> Any:
    """A copy of `module` with every parametrized weight replaced by its current value (the module itself when none
    is parametrized, or when it is not an nn.Module, e.g. TorchScript)."""
    if not parametrized_layers(module):
        return module
    # The deprecated weight_norm keeps its computed weight as a plain attribute outside the autograd leaves, which
    # deepcopy refuses: the copy gets a detached clone (recomputed from weight_g and weight_v when baked below).
    memo: dict[int, Any] = {}
    for child in module.modules():
        for hook in child._forward_pre_hooks.values():
            if _is_weight_norm_hook(hook):
                computed = getattr(child, getattr(hook, "name", "weight"), None)
                if isinstance(computed, torch.Tensor):
                    memo[id(computed)] = computed.detach().clone()
    plain = copy.deepcopy(module, memo)
    for child in list(plain.modules()):
        if parametrize.is_parametrized(child):
            _bake_parametrizations(child)
        for key, hook in list(child._forward_pre_hooks.items()):
            if _is_weight_norm_hook(hook):
                # The deprecated torch.nn.utils.weight_norm: a pre-hook recomputes `weight` from weight_g and weight_v.
                torch.nn.utils.remove_weight_norm(child, getattr(hook, "name", "weight"))
                child._forward_pre_hooks.pop(key, None)
    return plain.eval()


def _bake_parametrizations(child: torch.nn.Module) -> None:
    """The copy's parametrized tensors as plain parameters, its class back to the layer's own.

    Not parametrize.remove_parametrizations: it deletes the computed property from the injected class, which a
    deep copy shares with the original, so the eager module would lose its weight too.
    """
    with torch.no_grad():
        names: list[str] = list(getattr(child, "parametrizations", {}).keys())
        values = {name: getattr(child, name).detach().clone() for name in names}
    child.__class__ = child.__class__.__bases__[0]
    del child._modules["parametrizations"]
    for name, value in values.items():
        child._parameters[name] = torch.nn.Parameter(value, requires_grad=False)


def linear_layers(module: Any) -> list[str]:
    """Names of the nn.Linear submodules (parametrized ones included), for a skip reason that says what was there."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [name or "(root)" for name, child in module.named_modules() if isinstance(child, torch.nn.Linear)]
