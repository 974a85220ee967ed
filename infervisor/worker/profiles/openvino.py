"""The OpenVINO profiles: the torch module converted to OpenVINO IR, run by OpenVINO's CPU plugin.

`openvino` (fp32), `openvino_bf16` (the same IR, inference precision bf16) and `openvino_int8`
(the IR quantized by NNCF on the calibration set). The module is converted directly
(`openvino.convert_model`, no ONNX file) with every declared dynamic dim kept dynamic over its
declared range, so one compiled model serves every batch and sequence length. The IR is kept in
`cache_dir` under the same kind of key as the AOTInductor packages, and OpenVINO's own compiled-blob
cache (`CACHE_DIR`) sits beside it, so a restart reads the IR and imports the blob instead of
converting and compiling. Registered with the other builders by infervisor/worker/profiles/build.py.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infervisor.common.json_logs import adopt_library_handlers
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.builders import (
    REJECTED_NOTE,
    BuildContext,
    Built,
    ProfileError,
    builds,
    calibration_set,
)
from infervisor.worker.profiles.cache import ArtifactCache, artifact_key, file_digest, write_durably
from infervisor.worker.profiles.calibration import Inputs

#: The skip reason when the runtime is missing: what operators read in profile_skipped.
NOT_INSTALLED = "openvino is not installed: pip install 'infervisor[openvino]'"
#: The profile whose IR the bf16 profile shares: bf16 is a compile-time precision, not another conversion.
_FP32_IR = "openvino"


class Precision(enum.Enum):
    """What an OpenVINO profile computes in."""

    FP32 = "f32"
    BF16 = "bf16"
    #: NNCF's int8 quantization of the IR; the layers it leaves in float stay fp32.
    INT8 = "int8"


def _runtime() -> Any:
    """The openvino package, or the skip reason when it cannot be imported."""
    try:
        import openvino
    except ImportError as exc:
        raise ProfileError(f"{NOT_INSTALLED} ({exc})") from exc
    return openvino


def _nncf() -> Any:
    try:
        import nncf
    except ImportError as exc:
        raise ProfileError(f"nncf is not installed (openvino_int8 quantizes with it): pip install "
                           f"'infervisor[openvino]' ({exc})") from exc  # fmt: skip
    return nncf


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def input_shapes(ov: Any, specs: tuple[TensorSpec, ...]) -> list[tuple[Any, Any]]:
    """Each input's (PartialShape, element type): a dynamic dim is a Dimension over its declared range."""

    def dimension(spec: TensorSpec, index: int) -> Any:
        low, high = spec.dim_range(index)
        if spec.shape[index] is not None:
            return ov.Dimension(low)
        return ov.Dimension(low, high if high is not None else -1)

    return [
        (ov.PartialShape([dimension(spec, i) for i in range(len(spec.shape))]), ov.Type(np.dtype(spec.dtype)))
        for spec in specs
    ]


class OpenVinoRunner:
    """A compiled OpenVINO model called like the torch module: tensors in, the module's output structure out."""

    def __init__(self, compiled: Any, keys: tuple[str, ...] | None, single: bool) -> None:
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        #: The module returned a dict with these keys (in order), a lone tensor (`single`), or a tuple.
        self.keys = keys
        self.single = single

    def __call__(self, *inputs: torch.Tensor) -> Any:
        # contiguous(): OpenVINO reads dense row-major buffers; a channels_last tensor is copied to NCHW here.
        arrays = [t.contiguous().numpy() for t in inputs]
        results = self.request.infer(arrays, share_inputs=True)
        tensors = [torch.from_numpy(np.asarray(results[i])) for i in range(len(self.compiled.outputs))]
        if self.keys is not None:
            return dict(zip(self.keys, tensors, strict=True))
        return tensors[0] if self.single else tuple(tensors)


def _output_structure(module: Any, example: Inputs) -> tuple[tuple[str, ...] | None, bool]:
    """How the module hands back its outputs (dict keys, or a lone tensor), so the runner answers alike."""
    with torch.inference_mode():
        result = module(*example)
    if isinstance(result, Mapping):
        return tuple(str(key) for key in result), False
    return None, isinstance(result, torch.Tensor)


def _convert(ov: Any, context: BuildContext) -> Any:
    """The module as an OpenVINO model, traced on the example with the declared input ranges."""
    with torch.inference_mode(False), torch.no_grad():
        return ov.convert_model(
            context.module, example_input=tuple(context.example), input=input_shapes(ov, context.specs)
        )


#: Bumped when the quantization recipe changes, so an IR quantized by an older recipe is not loaded as this one.
_INT8_RECIPE = "transformer-aware-2"


#: The ops an attention block converts to: a Softmax, or the fused op convert_model makes of torch's SDPA.
_ATTENTION_OPS = frozenset({"Softmax", "ScaledDotProductAttention"})


def is_transformer(ov_model: Any) -> bool:
    """Whether the graph has attention: NNCF's default recipe quantizes what breaks it."""
    return any(op.get_type_name() in _ATTENTION_OPS for op in ov_model.get_ops())


def _quantized(ov_model: Any, calibration: list[Inputs]) -> Any:
    """NNCF post-training int8; attention graphs with its TRANSFORMER recipe.

    The default recipe also quantizes the attention's activations and the residual adds: on the real
    all-MiniLM-L6-v2 that left a worst-sentence cosine of 0.63 against fp32. The TRANSFORMER recipe keeps
    those in float and smooths the activations of the MatMuls it quantizes (SmoothQuant).
    """
    nncf = _nncf()
    adopt_library_handlers()  # nncf's logger prints through a console handler of its own: made JSON like ours
    dataset = nncf.Dataset(calibration, lambda sample: [t.contiguous().numpy() for t in sample])
    kind = {"model_type": nncf.ModelType.TRANSFORMER} if is_transformer(ov_model) else {}
    # Its progress bars (rich, on sys.stdout) would land between the daemon's JSON log lines: drawn nowhere.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return nncf.quantize(ov_model, dataset, subset_size=len(calibration), **kind)


def _saved_ir(cache: ArtifactCache, profile: str, key: dict[str, Any], make: Any) -> tuple[Path, bool, str | None]:
    """The IR's .xml for `key`, made by `make()` and saved when not cached yet; True when it was cached, and why
    a cached IR was moved aside and made again (None when it was not).

    The .bin is moved into place before the .xml, and the .xml (what a reader looks for) last, by
    get_or_build: a reader never finds an .xml without its weights.
    """
    path = cache.root / f"{cache.stem_for(profile, key)}.xml"

    def save(into: Path) -> None:
        ov = _runtime()
        staged = into.with_suffix(".xml")
        for leftover in cache.root.glob(f"{path.stem}*.tmp.bin"):  # a killed build's weights
            leftover.unlink(missing_ok=True)
        try:
            # compress_to_fp16=False: the default halves the weights on disk, which is not fp32 any more.
            ov.save_model(make(), str(staged), compress_to_fp16=False)
            # The .xml's own digest is the cache's; the weights beside it get theirs here, checked at every load.
            write_durably(_weights_digest(path), file_digest(staged.with_suffix(".bin")))
            os.replace(staged.with_suffix(".bin"), path.with_suffix(".bin"))
            os.replace(staged, into)
        finally:
            staged.unlink(missing_ok=True)
            staged.with_suffix(".bin").unlink(missing_ok=True)

    hit = cache.get_or_build(path, key, save)
    if hit and not _weights_intact(path):
        why = "weights (.bin) differ from the sha256 stored when they were saved"
        cache.discard(path, why)
        return path, cache.get_or_build(path, key, save), why
    return path, hit, None


def _weights_digest(xml: Path) -> Path:
    return xml.with_suffix(".bin.sha256")


def _weights_intact(xml: Path) -> bool:
    """The IR's weights are what was saved: the .bin's sha256 is the one written beside it at build time."""
    try:
        return _weights_digest(xml).read_text().split()[0] == file_digest(xml.with_suffix(".bin"))
    except (OSError, IndexError):
        return False


def build_openvino(name: str, context: BuildContext, precision: Precision) -> Built:
    """Convert (and quantize) the module into IR, or read the cached IR, and compile it for this worker's threads."""
    if context.cache is None:
        raise ProfileError(f"{name} needs an artifact cache directory (config cache_dir)")
    ov = _runtime()
    cache = context.cache
    notes: list[str] = []
    options: dict[str, Any] = {"channels_last": context.channels_last, "openvino": _version("openvino")}
    make: Any = lambda: _convert(ov, context)  # noqa: E731 - called only on a cache miss
    ir_profile = _FP32_IR
    if precision is Precision.INT8:
        calibration, calibration_id = calibration_set(context, notes)
        options.update(calibration=calibration_id, nncf=_version("nncf"), recipe=_INT8_RECIPE)
        ir_profile = name
        make = lambda: _quantized(_convert(ov, context), calibration)  # noqa: E731
    key = artifact_key(context.digest, ir_profile, context.specs, options)
    xml, hit, rejected = _saved_ir(cache, ir_profile, key, make)
    if rejected is not None:
        notes.append(f"{REJECTED_NOTE}{xml.name} {rejected}: moved aside to {xml.name}.corrupt, rebuilt")
    notes.append(f"{'loaded cached' if hit else 'converted and cached'} OpenVINO IR {xml.name}")
    threads = torch.get_num_threads()
    properties = {
        # The worker's own threads, one stream: the same cores torch would use, no second pool beside them.
        "INFERENCE_NUM_THREADS": threads,
        "NUM_STREAMS": 1,
        "INFERENCE_PRECISION_HINT": "bf16" if precision is Precision.BF16 else "f32",
        # The supervisor already pinned the worker to its cores; OpenVINO's threads stay within that mask.
        "ENABLE_CPU_PINNING": False,
        "CACHE_DIR": str(cache.root / "openvino"),
    }
    compiled = ov.Core().compile_model(str(xml), "CPU", properties)
    keys, single = _output_structure(context.module, context.example)
    notes.append(f"compiled for CPU at {threads} thread(s), precision {precision.value}, compiled-blob cache on")
    return Built(OpenVinoRunner(compiled, keys, single), notes)


@builds("openvino")
def _openvino(context: BuildContext) -> Built:
    return build_openvino("openvino", context, Precision.FP32)


@builds("openvino_bf16")
def _openvino_bf16(context: BuildContext) -> Built:
    return build_openvino("openvino_bf16", context, Precision.BF16)


@builds("openvino_int8")
def _openvino_int8(context: BuildContext) -> Built:
    return build_openvino("openvino_int8", context, Precision.INT8)
