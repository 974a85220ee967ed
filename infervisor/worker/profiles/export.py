"""Profiles built through torch.export: AOTInductor packages, PT2E-quantized to int8 first for the int8 ones.

The package is what gets cached, so a restarted worker loads a shared library in milliseconds
instead of exporting, quantizing and compiling again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infervisor.common.text import clip
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.advice import checked_advice
from infervisor.worker.profiles.covered_export import (
    ExportError,
    Inputs,
    Narrower,
    Uncovered,
    export_covering,
    guard_words,
)
from infervisor.worker.profiles.package_scratch import unpacked_in_scratch

#: Inductor settings for every package: freezing folds weights into constants (and lets the
#: int8 patterns fuse into oneDNN quantized kernels); without it compiled CPU code is no faster.
_INDUCTOR_CONFIGS = {"freezing": True}


class NoGain(ExportError):
    """Quantization found nothing to quantize: the profile would be the plain package under another name."""


def export(module: Any, example: Inputs, specs: Sequence[TensorSpec]) -> torch.export.ExportedProgram:
    """torch.export of the module with the spec's dynamic dims; ExportError when it covers less than declared, naming
    only a range to declare that a re-export was seen to cover (advice.py)."""
    try:
        return export_covering(module, example, specs)
    except (Uncovered, Narrower) as exc:
        raise ExportError(f"{exc} ({checked_advice(module, example, tuple(specs), exc)})") from exc


def quantize(
    program: torch.export.ExportedProgram,
    calibration: Sequence[Inputs],
    dynamic: bool,
    specs: Sequence[TensorSpec] = (),
    module: Any = None,
) -> torch.fx.GraphModule:
    """PT2E int8 with X86InductorQuantizer: static (activations calibrated) or dynamic (Linear layers only).

    Dynamic quantization is configured for aten.linear alone (nn.Linear and F.linear): the quantizer's global
    dynamic config also takes convolutions, which changed a conv-only network's outputs for no speed. NoGain
    when the graph has no Linear to quantize, naming the Linear layers `module` (the exported one) has if any.
    """
    try:
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    except ImportError as exc:
        raise ExportError(
            "torchao is not installed (pip install --no-deps 'torchao==0.18.*'; see docs/optimization.md)"
        ) from exc
    quantizer = x86.X86InductorQuantizer()
    config = x86.get_default_x86_inductor_quantization_config(is_dynamic=dynamic)
    if dynamic:
        quantizer.set_module_type_qconfig(torch.nn.Linear, config)
    else:
        quantizer.set_global(config)
    try:
        with torch.no_grad():
            prepared = prepare_pt2e(program.module(), quantizer)
            for inputs in calibration:
                prepared(*inputs)
            converted: torch.fx.GraphModule = convert_pt2e(prepared)
    except Exception as exc:  # noqa: BLE001 - quantizer annotation fails on some graph shapes; said plainly
        message = clip(guard_words(f"{type(exc).__name__}: {exc}", specs))
        if "more than one output node" in message:
            message += (
                " (a module is called at several places, e.g. one self.relu applied twice: give each call"
                " site its own module instance)"
            )
        raise ExportError(f"PT2E quantization failed: {message}") from exc
    if not any("quantize" in str(node.target) for node in converted.graph.nodes if node.op == "call_function"):
        raise NoGain(_no_gain_reason(dynamic, module))
    return converted


def export_quantized(
    module: Any, example: Inputs, specs: Sequence[TensorSpec], calibration: Sequence[Inputs], dynamic: bool
) -> torch.fx.GraphModule:
    """The module exported and PT2E-quantized, its parametrized weights (weight_norm) baked in first: the quantizer
    takes layers by type, and a ParametrizedLinear is not an nn.Linear (parametrized.py)."""
    from infervisor.worker.profiles.parametrized import baked

    plain = baked(module)
    return quantize(export(plain, example, specs), calibration, dynamic, specs, plain)


def _no_gain_reason(dynamic: bool, module: Any) -> str:
    """Why nothing was quantized, with the Linear layers the module does have (the quantizer took none of them)."""
    from infervisor.worker.profiles.parametrized import linear_layers

    linears = linear_layers(module)
    if not linears:
        what = "no Linear layer (int8_dynamic quantizes only those)" if dynamic else "no layer the quantizer takes"
        return f"no gain: the model has {what}, so nothing was quantized"
    more = f" and {len(linears) - 5} more" if len(linears) > 5 else ""
    shown = ", ".join(repr(name) for name in linears[:5]) + more
    return (
        f"no gain: the quantizer took none of the model's nn.Linear layers ({shown}): their weights are not plain "
        "parameters in the exported graph or their inputs are not float tensors, so nothing was quantized"
    )


def compile_package(
    program: torch.export.ExportedProgram | torch.fx.GraphModule,
    example: Inputs,
    specs: Sequence[TensorSpec],
    path: Path,
) -> None:
    """AOTInductor-compile a program (re-exporting a quantized graph first) into a package at `path`."""
    if not isinstance(program, torch.export.ExportedProgram):
        program = export(program, example, specs)
    try:
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(path), inductor_configs=dict(_INDUCTOR_CONFIGS)
            )
    except Exception as exc:  # noqa: BLE001 - a C++ compile or lowering failure is a skip reason
        worded = guard_words(f"{type(exc).__name__}: {exc}", specs)
        raise ExportError(clip(f"AOTInductor compile failed: {worded}")) from exc


class PackageRunner:
    """Runs a compiled package through torch's C++ loader: one output is a tensor, several a tuple."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __call__(self, *inputs: torch.Tensor) -> Any:
        outputs = self.loader.run(list(inputs))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def load_package(path: Path) -> Any:
    """The callable of a compiled package.

    torch._inductor.aoti_load_package imports inductor and dynamo (about 2 s here) only to wrap the
    C++ loader, which itself takes milliseconds: a restarted worker uses the loader directly.
    """
    try:
        with unpacked_in_scratch():
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except AttributeError:  # a torch without the C++ binding: the documented (slower to import) path
        with unpacked_in_scratch():
            return torch._inductor.aoti_load_package(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign package is a skip reason, not a crash
        raise ExportError(f"cannot load the AOTInductor package {path}: {type(exc).__name__}: {exc}") from exc
    return PackageRunner(loader)
