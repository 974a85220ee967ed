"""Builds one profile of a model: the named transformation that turns the loaded module into what serves.

Each profile declared in infervisor/common/profiles.py has exactly one builder here, registered with
`@builds(name)`: eager (as loaded), jit (trace/script + freeze + optimize_for_inference), jit_onednn
(frozen + oneDNN fusion), compile (torch.compile, inductor, freezing), aoti (torch.export +
AOTInductor package), int8_static / int8_dynamic (PT2E with X86InductorQuantizer, then an
AOTInductor package) and bf16 (autocast); the OpenVINO profiles register theirs from openvino.py
(imported at the end of this module). Packages are cached on disk; see cache.py.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from infervisor.common.profiles import PROFILE_NAMES
from infervisor.common.text import clip
from infervisor.protocol.tensors import TensorSpec

# The OpenVINO builders register themselves with @builds when their module is imported.
from infervisor.worker.profiles import openvino as _openvino_builders  # noqa: F401
from infervisor.worker.profiles.builders import (
    BUILDERS,
    REJECTED_NOTE,
    BuildContext,
    Built,
    ProfileError,
    builds,
    calibration_set,
)
from infervisor.worker.profiles.cache import (
    CachedBuildFailure,
    NoSpaceLeft,
    NotBuiltYet,
    UntrustedCache,
    artifact_key,
    no_space_left,
)
from infervisor.worker.profiles.calibration import Inputs
from infervisor.worker.profiles.covered_export import ExportError, Narrower, Uncovered
from infervisor.worker.profiles.dispatch import BatchBuckets, ShapeDispatch, at_batch, batch_only, buckets_for
from infervisor.worker.profiles.export import NoGain, compile_package, export, export_quantized, load_package
from infervisor.worker.profiles.flags import apply_global_flags
from infervisor.worker.profiles.next_step import OPEN_LENGTH_STEP, package_step, with_next_step


class _Quantization(enum.Enum):
    """How a packaged profile quantizes the exported program before compiling it."""

    NONE = "none"
    #: Activation ranges observed on a calibration set.
    STATIC = "static"
    #: Activations quantized per call.
    DYNAMIC = "dynamic"


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


def _packaged(name: str, context: BuildContext, quantization: _Quantization) -> Built:
    """Export (and quantize) the module into AOTInductor packages, or load the cached ones.

    A batch-only dynamic spec gets one static package per batch bucket (dispatch.BATCH_BUCKETS), each
    its own cache entry. A spec with another dynamic dim gets two: one for exactly the example's
    shapes and one for any size (int8 ResNet-50 took 11 ms at batch 1 from a static package, 106 ms
    from a dynamic one, so the dynamic one is only the fallback). A quantized profile is quantized
    once, on the spec's own export, and every package is compiled from that one graph: batch 1 and
    batch 8 answer a row with the same scales.
    """
    notes: list[str] = []
    calibration: list[Inputs] = []
    calibration_id = ""
    if quantization is _Quantization.STATIC:
        calibration, calibration_id = calibration_set(context, notes)
    if context.cache is None:
        raise ProfileError(f"{name} needs an artifact cache directory (config cache_dir)")
    cache = context.cache
    quantized: list[torch.fx.GraphModule] = []

    def program(example: Inputs, specs: tuple[TensorSpec, ...]) -> Any:
        if quantization is _Quantization.NONE:
            return export(context.module, example, specs)
        if not quantized:  # only when some package is not cached yet
            dynamic = quantization is _Quantization.DYNAMIC
            examples = calibration or [context.example]
            quantized.append(export_quantized(context.module, context.example, context.specs, examples, dynamic))
        return quantized[0]

    def package(example: Inputs, specs: tuple[TensorSpec, ...], shapes: str) -> tuple[Any, Path]:
        options = {
            "channels_last": context.channels_last,
            "calibration": calibration_id,
            "shapes": shapes,
            **package_options(context.specs),
        }
        if quantization is _Quantization.DYNAMIC:
            options["quantized"] = "linear"  # packages from before dynamic int8 left convolutions alone are not reused
        key = artifact_key(context.digest, name, specs, options)
        path = cache.path_for(name, key)
        try:
            fetched = cache.fetch(
                path, key, lambda into: compile_package(program(example, specs), example, specs, into), load_package
            )
        except ExportError as exc:
            shown = ", ".join(f"{s.name} {list(t.shape)}" for s, t in zip(specs, example, strict=True))
            declared = ", ".join(s.describe() for s in context.specs)
            if isinstance(exc, (Uncovered, Narrower)) or isinstance(exc.__cause__, (Uncovered, Narrower)):
                # The declared ranges themselves were refused, whichever package was being made (a quantized
                # profile exports once over them, before its static package).
                raise ExportError(f"{OPEN_LENGTH_STEP}; torch.export: {exc}") from exc
            raise ExportError(f"{exc} ({package_step(shapes, shown, declared)})") from exc
        if fetched.rejected is not None:
            notes.append(f"{REJECTED_NOTE}{path.name} {fetched.rejected}: moved aside to {path.name}.corrupt, rebuilt")
        done = "loaded cached" if fetched.hit else "compiled and cached"
        notes.append(f"{done} package {path.name} ({shapes} shapes)")
        return fetched.value, path

    if batch_only(context.specs):
        built: dict[int, Any] = {}
        path = Path()
        for size in buckets_for(context.specs):
            example = at_batch(context.example, size)
            built[size], path = package(example, _static_specs(context.specs, example), f"batch {size}")
        costs, remembered = _bucket_costs(path.with_suffix(".buckets.json"), built, context.example)
        buckets = BatchBuckets(built, costs)
        notes.append(_buckets_note(buckets, remembered))
        return Built(buckets, notes)
    static_specs = _static_specs(context.specs, context.example)
    static, _ = package(context.example, static_specs, "static")
    if static_specs == context.specs:
        return Built(static, notes)
    dynamic, _ = package(context.example, context.specs, "dynamic")
    return Built(ShapeDispatch(static, [tuple(t.shape) for t in context.example], dynamic, context.specs), notes)


#: Bumped when what a package covers of the declared shapes changes (covered_export.check_coverage).
_COVERAGE_FORMAT = 1


def package_options(specs: tuple[TensorSpec, ...]) -> dict[str, Any]:
    """What every package, build record and crash record of a profile is keyed on besides its own shapes: the
    declared inputs as the config writes them (bounds included). A static package compiled from the export of
    `[null, 1, 64, [64, 1024]]` is not one of `[1, 1, 64, [64, 1024]]`, though both have the same example."""
    return {"declared": [[s.name, s.dtype, s.config_shape()] for s in specs], "coverage": _COVERAGE_FORMAT}


def _static_specs(specs: tuple[TensorSpec, ...], example: Inputs) -> tuple[TensorSpec, ...]:
    return tuple(dataclasses.replace(s, shape=tuple(t.shape), bounds=()) for s, t in zip(specs, example, strict=True))


def _bucket_costs(path: Path, packages: dict[int, Any], example: Inputs) -> tuple[dict[int, float], bool]:
    """Each bucket's cost per call at this thread count: remembered beside its package, else measured and kept.

    Measured once per package and thread count, so a restart neither pays the timing nor decides
    on a noisier one.
    """
    threads = str(torch.get_num_threads())
    known: dict[str, Any] = {}
    try:
        loaded = json.loads(path.read_text())
        known = loaded if isinstance(loaded, dict) else {}
        costs = {int(size): float(ms) for size, ms in known[threads].items()}
        if sorted(costs) == sorted(packages):
            return costs, True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    costs = BatchBuckets.measure(packages, example)
    known[threads] = {str(size): round(ms, 5) for size, ms in costs.items()}
    try:
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(known))
        os.replace(temporary, path)
    except OSError:  # a read-only cache costs the next start another measurement, nothing else
        pass
    return costs, False


def _buckets_note(buckets: BatchBuckets, remembered: bool) -> str:
    costs = ", ".join(f"batch {size} {ms:.3g} ms" for size, ms in sorted(buckets.costs_ms.items()))
    plans = ", ".join(f"{rows} as {'+'.join(map(str, buckets.plan(rows)))}" for rows in (2, 4, 8, 12))
    return f"batch buckets ({costs} a call, {'remembered' if remembered else 'measured'}): runs {plans}"


@builds("eager")
def _eager(context: BuildContext) -> Built:
    return Built(context.module)


@builds("jit")
def _jit(context: BuildContext) -> Built:
    return Built(_frozen_script(context.module, context.example, optimize=True))


@builds("jit_onednn")
def _jit_onednn(context: BuildContext) -> Built:
    return Built(_frozen_script(context.module, context.example, optimize=False))


@builds("compile")
def _compile(context: BuildContext) -> Built:
    # Compiled lazily: the selection's first golden run pays for it (inductor's on-disk
    # cache, kept under cache_dir, makes a restart's compile shorter but not free).
    return Built(torch.compile(context.module, backend="inductor", options={"freezing": True}))


@builds("aoti")
def _aoti(context: BuildContext) -> Built:
    return _packaged("aoti", context, _Quantization.NONE)


@builds("int8_static")
def _int8_static(context: BuildContext) -> Built:
    return _packaged("int8_static", context, _Quantization.STATIC)


@builds("int8_dynamic")
def _int8_dynamic(context: BuildContext) -> Built:
    return _packaged("int8_dynamic", context, _Quantization.DYNAMIC)


@builds("bf16")
def _bf16(context: BuildContext) -> Built:
    return Built(_autocast_bf16(context.module))


def build_profile(name: str, context: BuildContext) -> Built:
    """What serves `name`, built with the profile's global flags switched; ProfileError when it cannot be built."""
    apply_global_flags(name)
    builder = BUILDERS.get(name)
    if builder is None:
        raise ProfileError(f"profile {name!r} is not implemented; available: {', '.join(PROFILE_NAMES)}")
    try:
        return builder(context)
    except (ProfileError, NotBuiltYet):
        raise
    except NoGain as exc:
        raise ProfileError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - building from a user model can fail in many ways; each is a skip reason
        cause, _, remembered = str(exc).partition(": ")
        if isinstance(exc, CachedBuildFailure) and cause == NoGain.__name__:
            raise ProfileError(remembered) from exc  # said as the first time, not as a build that failed
        if isinstance(exc, ExportError | NoSpaceLeft | UntrustedCache):
            detail = str(exc)
        elif no_space_left(exc):
            detail = clip(f"no space left on device ({type(exc).__name__}: {exc})")
        else:
            detail = clip(f"{type(exc).__name__}: {exc}")
        raise ProfileError(f"{name} failed to build: {with_next_step(name, detail)}") from exc
