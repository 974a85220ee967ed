"""Builds one profile of a model: the named transformation that turns the loaded module into what serves.

eager (as loaded), jit (trace/script + freeze + optimize_for_inference), jit_onednn (frozen + oneDNN
fusion), compile (torch.compile, inductor, freezing), aoti (torch.export + AOTInductor package),
int8_static / int8_dynamic (PT2E with X86InductorQuantizer, then an AOTInductor package) and bf16
(autocast). Packages are cached on disk; see cache.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.launch import PROFILE_NAMES as PROFILES
from protocol.tensors import TensorSpec
from worker.profiles.cache import ArtifactCache, artifact_key, file_digest
from worker.profiles.calibration import Inputs, load_calibration, random_calibration
from worker.profiles.export import ExportError, ShapeDispatch, compile_package, export, load_package, quantize

#: Profiles whose build product is an AOTInductor package, cached between restarts.
PACKAGED = ("aoti", "int8_static", "int8_dynamic")


class ProfileError(Exception):
    """The profile cannot be built for this model; the message says why."""


@dataclass
class BuildContext:
    """What building a profile needs besides its name."""

    module: Any
    example: Inputs
    specs: tuple[TensorSpec, ...]
    #: sha256 of the model (weights and code); part of every cache key.
    digest: str
    channels_last: bool = False
    cache: ArtifactCache | None = None
    calibration: Path | None = None
    #: Only part of the fastest-pick decision's key: the profiles were checked on it.
    validation: Path | None = None


@dataclass
class Built:
    """A built profile: what serves, and what building it did (compiled, loaded from cache, ...)."""

    callable: Callable[..., Any]
    notes: list[str] = field(default_factory=list)


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


def _autocast_bf16(module: Any) -> Callable[..., Any]:
    """The module under CPU bf16 autocast (outputs go back to float32 on the wire)."""

    def run(*args: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(*args)

    return run


def _calibration_set(context: BuildContext, notes: list[str]) -> tuple[list[Inputs], str]:
    if context.calibration is None:
        notes.append("calibrated on seeded random inputs (no calibration set configured)")
        return random_calibration(context.example), "random"
    return load_calibration(context.calibration, context.specs), file_digest(context.calibration)


def _packaged(name: str, context: BuildContext) -> Built:
    """Export (and quantize) the module into AOTInductor packages, or load the cached ones.

    With a dynamic dim in the spec there are two packages: one compiled for exactly the example's
    shapes (batch 1) and one for any size. Measured here, int8 ResNet-50 at batch 1 took 11 ms from
    a static package and 106 ms from a dynamic one: the dynamic one is only the fallback.
    """
    notes: list[str] = []
    calibration: list[Inputs] = []
    calibration_id = ""
    if name == "int8_static":
        calibration, calibration_id = _calibration_set(context, notes)
    if context.cache is None:
        raise ProfileError(f"{name} needs an artifact cache directory (config cache_dir)")
    cache = context.cache
    static_specs = tuple(
        TensorSpec(s.name, s.dtype, tuple(t.shape), s.allow_non_finite)
        for s, t in zip(context.specs, context.example, strict=True)
    )

    def package(specs: tuple[TensorSpec, ...], shapes: str) -> Any:
        options = {"channels_last": context.channels_last, "calibration": calibration_id, "shapes": shapes}
        key = artifact_key(context.digest, name, specs, options)

        def build(path: Path) -> None:
            program = export(context.module, context.example, specs)
            if name == "aoti":
                compile_package(program, context.example, specs, path)
                return
            quantized = quantize(program, calibration or [context.example], dynamic=name == "int8_dynamic")
            compile_package(quantized, context.example, specs, path)

        path = cache.path_for(name, key)
        hit = cache.get_or_build(path, key, build)
        notes.append(f"{'loaded cached' if hit else 'compiled and cached'} package {path.name} ({shapes} shapes)")
        return load_package(path)

    static = package(static_specs, "static")
    if static_specs == context.specs:
        return Built(static, notes)
    dynamic = package(context.specs, "dynamic")
    return Built(ShapeDispatch(static, [tuple(t.shape) for t in context.example], dynamic, context.specs), notes)


def build_profile(name: str, context: BuildContext) -> Built:
    """What serves `name`; ProfileError when it cannot be built."""
    torch.jit.enable_onednn_fusion(name == "jit_onednn")
    if name not in PROFILES:
        raise ProfileError(f"profile {name!r} is not implemented; available: {', '.join(PROFILES)}")
    try:
        if name == "eager":
            return Built(context.module)
        if name == "bf16":
            return Built(_autocast_bf16(context.module))
        if name == "compile":
            # Compiled lazily: the selection's first golden run pays for it (inductor's on-disk
            # cache, kept under cache_dir, makes a restart's compile shorter but not free).
            return Built(torch.compile(context.module, backend="inductor", options={"freezing": True}))
        if name in PACKAGED:
            return _packaged(name, context)
        return Built(_frozen_script(context.module, context.example, optimize=name == "jit"))
    except ProfileError:
        raise
    except Exception as exc:  # noqa: BLE001 - building from a user model can fail in many ways; each is a skip reason
        detail = str(exc) if isinstance(exc, ExportError) else f"{type(exc).__name__}: {str(exc)[:300]}"
        raise ProfileError(f"{name} failed to build: {detail}") from exc
