"""Builds one profile of a model: eager, jit (trace/script + freeze + optimize_for_inference), jit_onednn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from protocol.launch import PROFILE_NAMES as PROFILES

Inputs = tuple[torch.Tensor, ...]


class ProfileError(Exception):
    """The profile cannot be built for this model; the message says why."""


def _frozen_script(module: Any, example: Inputs, optimize: bool) -> Any:
    """TorchScript, frozen (weights become constants, BN folded), optionally optimised for inference.

    optimize_for_inference rewrites convolutions into MKLDNN ops, which the oneDNN fusion pass then
    cannot take apart (it fails at run time), so jit_onednn stops at freeze.
    """
    with torch.inference_mode(False), torch.no_grad():
        if isinstance(module, torch.jit.ScriptModule):
            scripted = module
        else:
            scripted = torch.jit.trace(module, example, check_trace=False)  # type: ignore[no-untyped-call]
        frozen = torch.jit.freeze(scripted.eval())
        return torch.jit.optimize_for_inference(frozen) if optimize else frozen


def build_profile(name: str, module: Any, example: Inputs) -> Callable[..., Any]:
    """The callable that serves `name`; ProfileError when it cannot be built."""
    torch.jit.enable_onednn_fusion(name == "jit_onednn")
    if name == "eager":
        return module  # type: ignore[no-any-return]
    if name not in PROFILES:
        raise ProfileError(f"profile {name!r} is not implemented; available: {', '.join(PROFILES)}")
    try:
        return _frozen_script(module, example, optimize=name == "jit")  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - tracing a user model can fail in many ways; each is a skip reason
        raise ProfileError(f"{name} failed to build: {type(exc).__name__}: {str(exc)[:300]}") from exc
