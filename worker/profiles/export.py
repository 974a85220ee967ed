"""Profiles built through torch.export: AOTInductor packages, PT2E-quantized to int8 first for the int8 ones.

The package is what gets cached, so a restarted worker loads a shared library in milliseconds
instead of exporting, quantizing and compiling again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from protocol.tensors import TensorSpec

Inputs = tuple[torch.Tensor, ...]

#: Inductor settings for every package: freezing folds weights into constants (and lets the
#: int8 patterns fuse into oneDNN quantized kernels); without it compiled CPU code is no faster.
_INDUCTOR_CONFIGS = {"freezing": True}


class ExportError(Exception):
    """The model cannot go through torch.export / PT2E / AOTInductor; the message says what to change."""


def traceable_example(example: Inputs, specs: Sequence[TensorSpec]) -> Inputs:
    """The example with every dynamic dim of size 1 doubled: export would specialise a 1 into a constant."""
    grown: list[torch.Tensor] = []
    for tensor, spec in zip(example, specs, strict=True):
        for index, dim in enumerate(spec.shape):
            if dim is None and tensor.shape[index] == 1:
                tensor = torch.cat([tensor, tensor], dim=index)
        grown.append(tensor)
    return tuple(grown)


def dynamic_shapes(specs: Sequence[TensorSpec]) -> tuple[dict[int, Any], ...]:
    """Export's dynamic_shapes for the spec.

    DYNAMIC, not AUTO: AUTO silently bakes a dim the model forces to one size into a constant, and a
    package does not check input shapes at run time (a wrong size reads out of bounds). DYNAMIC makes
    export refuse instead, which skips the profile with the reason. Related dims (input_ids and
    attention_mask sharing a batch) are still tied together by export.
    """
    return tuple({i: torch.export.Dim.DYNAMIC for i, d in enumerate(s.shape) if d is None} for s in specs)


def export(module: Any, example: Inputs, specs: Sequence[TensorSpec]) -> torch.export.ExportedProgram:
    """torch.export of the module with the spec's dynamic dims."""
    try:
        with torch.no_grad():
            return torch.export.export(module, traceable_example(example, specs), dynamic_shapes=dynamic_shapes(specs))
    except Exception as exc:  # noqa: BLE001 - export fails in many ways on user models; each is a skip reason
        raise ExportError(f"torch.export failed: {type(exc).__name__}: {str(exc)[:300]}") from exc


def quantize(
    program: torch.export.ExportedProgram, calibration: Sequence[Inputs], dynamic: bool
) -> torch.fx.GraphModule:
    """PT2E int8 with X86InductorQuantizer: static (activations calibrated) or dynamic (Linear layers)."""
    try:
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    except ImportError as exc:
        raise ExportError(
            "torchao is not installed (pip install --no-deps 'torchao==0.18.*'; see docs/optimization.md)"
        ) from exc
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config(is_dynamic=dynamic))
    try:
        with torch.no_grad():
            prepared = prepare_pt2e(program.module(), quantizer)
            for inputs in calibration:
                prepared(*inputs)
            return convert_pt2e(prepared)  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - quantizer annotation fails on some graph shapes; said plainly
        message = f"{type(exc).__name__}: {str(exc)[:300]}"
        if "more than one output node" in message:
            message += (
                " (a module is called at several places, e.g. one self.relu applied twice: give each call"
                " site its own module instance)"
            )
        raise ExportError(f"PT2E quantization failed: {message}") from exc


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
        raise ExportError(f"AOTInductor compile failed: {type(exc).__name__}: {str(exc)[:300]}") from exc


class PackageRunner:
    """Runs a compiled package through torch's C++ loader: one output is a tensor, several a tuple."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __call__(self, *inputs: torch.Tensor) -> Any:
        outputs = self.loader.run(list(inputs))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


class ShapeDispatch:
    """The package compiled for exactly the example's shapes when the inputs have them, else the dynamic one.

    The dynamic package was exported at size 2, so export gave its dynamic dims the range [2, inf):
    a size of 1 there is only served at the example's shapes, and is refused (not run) otherwise.
    """

    def __init__(self, static: Any, static_shapes: list[tuple[int, ...]], dynamic: Any, specs: Sequence[TensorSpec]):
        self.static = static
        self.static_shapes = static_shapes
        self.dynamic = dynamic
        self.dynamic_dims = [[i for i, d in enumerate(s.shape) if d is None] for s in specs]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        shapes = [tuple(t.shape) for t in inputs]
        if shapes == self.static_shapes:
            return self.static(*inputs)
        if any(shape[i] < 2 for shape, dims in zip(shapes, self.dynamic_dims, strict=True) for i in dims):
            raise ValueError(
                f"this compiled profile serves a size of 1 in a dynamic dim only at shapes {self.static_shapes}"
            )
        return self.dynamic(*inputs)


def load_package(path: Path) -> Any:
    """The callable of a compiled package.

    torch._inductor.aoti_load_package imports inductor and dynamo (about 2 s here) only to wrap the
    C++ loader, which itself takes milliseconds: a restarted worker uses the loader directly.
    """
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except AttributeError:  # a torch without the C++ binding: the documented (slower to import) path
        return torch._inductor.aoti_load_package(str(path))
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign package is a skip reason, not a crash
        raise ExportError(f"cannot load the AOTInductor package {path}: {type(exc).__name__}: {exc}") from exc
    return PackageRunner(loader)
