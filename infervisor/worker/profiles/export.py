"""Profiles built through torch.export: AOTInductor packages, PT2E-quantized to int8 first for the int8 ones.

The package is what gets cached, so a restarted worker loads a shared library in milliseconds
instead of exporting, quantizing and compiling again.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from infervisor.common.text import clip
from infervisor.protocol.tensors import DimRange, TensorSpec
from infervisor.worker.profiles.export_dims import dynamic_shapes, export_low, traceable_example
from infervisor.worker.profiles.timing import MIN_MARGIN, Contender, noise_of, run_rounds

Inputs = tuple[torch.Tensor, ...]
#: Each input of a program with the sizes each of its dims takes (loader.program_dims).
ProgramDims = list[tuple[str, list[DimRange | None]]]

#: Inductor settings for every package: freezing folds weights into constants (and lets the
#: int8 patterns fuse into oneDNN quantized kernels); without it compiled CPU code is no faster.
_INDUCTOR_CONFIGS = {"freezing": True}


class ExportError(Exception):
    """The model cannot go through torch.export / PT2E / AOTInductor; the message says what to change."""


class NoGain(ExportError):
    """Quantization found nothing to quantize: the profile would be the plain package under another name."""


def export(module: Any, example: Inputs, specs: Sequence[TensorSpec]) -> torch.export.ExportedProgram:
    """torch.export of the module with the spec's dynamic dims; ExportError when it covers less than declared, naming
    only a range to declare that a re-export was seen to cover (advice.py)."""
    try:
        return export_covering(module, example, specs)
    except (Uncovered, Narrower) as exc:
        from infervisor.worker.profiles.advice import checked_advice

        raise ExportError(f"{exc} ({checked_advice(module, example, tuple(specs), exc)})") from exc


def export_covering(module: Any, example: Inputs, specs: Sequence[TensorSpec]) -> torch.export.ExportedProgram:
    """torch.export of the module with the spec's dynamic dims; Uncovered when a guard breaks at a declared size."""
    try:
        with torch.no_grad():
            program = torch.export.export(
                module, traceable_example(example, specs), dynamic_shapes=dynamic_shapes(specs)
            )
    except Exception as exc:  # noqa: BLE001 - export fails in many ways on user models; each is a skip reason
        raise ExportError(clip(f"torch.export failed: {guard_words(f'{type(exc).__name__}: {exc}', specs)}")) from exc
    check_coverage(program, specs)
    return program


class Narrower(ExportError):
    """The program's range constraints are narrower than the config declares: each input's dims as it takes them."""

    def __init__(self, message: str, dims: list[tuple[str, list[tuple[int, int | None] | None]]]) -> None:
        super().__init__(message)
        self.dims = dims


class Uncovered(ExportError):
    """A guard of the exported program breaks at a declared size: where, and what part of the range it covers."""

    def __init__(self, message: str, position: int, index: int, covered: tuple[int, int] | None) -> None:
        super().__init__(message)
        self.position = position
        self.index = index
        #: The sizes from the range's start that the program covers (None: not even the start).
        self.covered = covered


#: How many sizes of one dim check_coverage tries when it looks for the part of a range a program covers.
_SCAN_SIZES = 2048


class _Size:
    """What a recorded guard reads of an input (`L['x'].size()[3]`): the sizes of one probed shape."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)

    def size(self) -> tuple[int, ...]:
        return self.shape

    def stride(self) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return tuple(reversed(strides))


def guard_words(text: str, specs: Sequence[TensorSpec]) -> str:
    """A raw guard (`L['x'].size()[3] <= 74`) as `x.shape[3] <= 74`, with what it means and what to do."""
    worded = re.sub(r"L\['([^']+)'\]\.size\(\)\[(\d+)\]", r"\1.shape[\2]", text)
    worded = re.sub(r"\b([A-Za-z_]\w*)\.size\(\)\[(\d+)\]", r"\1.shape[\2]", worded)
    if "Guard failed" in text or "Constraints violated" in text or "guard" in text.lower():
        declared = ", ".join(f"{s.name} {_shape_text(s)}" for s in specs)
        worded = (
            f"{clip(worded, 600)} (the compiled program only holds where that condition on the input sizes does, and "
            f"the config declares {declared}: declare only sizes where it holds, e.g. a fixed size or a narrower "
            "range, or take this profile out of the chain)"
        )
    return worded


def _shape_text(spec: TensorSpec) -> str:
    parts = []
    for dim in spec.config_shape():
        parts.append("[" + ", ".join("null" if part is None else str(part) for part in dim) + "]"
                     if isinstance(dim, list) else "null" if dim is None else str(dim))  # fmt: skip
    return "[" + ", ".join(parts) + "]"


def _holds(guards: Sequence[Any], names: Sequence[str], shapes: Sequence[Sequence[int]]) -> str | None:
    """The first recorded guard that these input shapes break (None: all hold, or none could be read).

    `names` are the program's own input names (the forward's arguments), which the guards read.
    """
    scope = {"L": {name: _Size(shape) for name, shape in zip(names, shapes, strict=True)}, "max": max, "min": min}
    for code, text in guards:
        try:
            if not eval(code, {"__builtins__": {}}, scope):  # noqa: S307 - torch's own guard text on our own export
                return str(text)
        except Exception:  # noqa: BLE001, S112 - a guard this cannot read says nothing either way
            continue
    return None


def _exported_shape(spec: TensorSpec) -> list[int]:
    """The spec's example shape as exported: batch 2, every other dynamic dim from export_low."""
    shape = list(spec.example_shape(2))
    for index, dim in enumerate(spec.shape):
        high = spec.dim_range(index)[1]
        if dim is None and index > 0 and (high is None or export_low(spec, index) <= high):
            shape[index] = max(shape[index], export_low(spec, index))
    return shape


def _probe(spec: TensorSpec, index: int, size: int) -> list[int]:
    """The spec's example shape as exported with dim `index` at `size`."""
    shape = _exported_shape(spec)
    shape[index] = size
    return shape


def _served_apart(found: list[tuple[str, list[DimRange | None]]], specs: Sequence[TensorSpec]) -> ProgramDims:
    """The program's dims with a range starting at export_low read as starting at the declared minimum: the sizes
    below are served apart from the program (ShapeDispatch)."""
    dims: ProgramDims = []
    for position, (name, taken) in enumerate(found):
        spec = specs[position] if position < len(specs) else None
        read: list[DimRange | None] = []
        for index, bound in enumerate(taken):
            dynamic = spec is not None and index < len(spec.shape) and spec.shape[index] is None
            if bound is not None and dynamic and spec is not None and bound[0] == export_low(spec, index):
                bound = (min(bound[0], spec.dim_range(index)[0]), bound[1])
            elif bound is not None and bound[0] == 2:
                bound = (1, bound[1])
            read.append(bound)
        dims.append((name, read))
    return dims


def check_coverage(program: torch.export.ExportedProgram, specs: Sequence[TensorSpec]) -> None:
    """ExportError when the program covers less of a dynamic dim than the config declares, naming the range to declare.

    Two things say what a program covers: its range constraints, and the guards export recorded (an
    AOTInductor package checks neither at run time, so a size outside them is served wrong, not refused).
    Each dynamic dim is scanned over its declared range, the other dims at their example sizes.
    """
    from infervisor.worker.loader import ModelLoadError, check_program_dims, program_dims

    # A size of 1 (or of one step) is served apart from the program (ShapeDispatch), which was exported from 2.
    found = program_dims(program)
    dims = _served_apart(found, specs)
    names = [name for name, _ in found]
    try:
        check_program_dims(dims, specs)
    except ModelLoadError as exc:
        raise Narrower(f"torch.export covers less than the config declares: {exc}", dims) from exc
    codes = [str(code) for code in getattr(program, "_guards_code", None) or []]
    guards: list[tuple[Any, str]] = []
    for code in codes:
        try:
            guards.append((compile(code, "<guard>", "eval"), guard_words(code, ())))
        except SyntaxError:
            continue
    if not guards:
        return
    for position, spec in enumerate(specs):
        for index, dim in enumerate(spec.shape):
            low, high = spec.dim_range(index)
            step = spec.dim_step(index)
            start = export_low(spec, index)
            if dim is not None or index == 0 or (high is not None and high < start):
                continue
            end = start + _SCAN_SIZES * step if high is None else min(high, start + _SCAN_SIZES * step)

            def broken(size: int, index: int = index, position: int = position) -> str | None:
                shapes = [_probe(s, index, size) if i == position else list(s.example_shape(2))
                          for i, s in enumerate(specs)]  # fmt: skip
                return _holds(guards, names, shapes)

            sizes = range(start, end + 1, step)  # a dim in steps is never asked for a size off them
            first = next(((size, why) for size in sizes if (why := broken(size)) is not None), None)
            if first is None:
                continue
            size, why = first
            covered = f"[{start}, {size - step}]" if size > start else "no size"
            declared = f"[{low}, {'null' if high is None else high}{'' if step == 1 else f', {step}'}]"
            raise Uncovered(
                f"torch.export's program for inputs[{position}] {spec.name!r} dim {index} holds only where {why}, "
                f"which a size of {size} breaks: it covers {covered} of the declared {declared}",
                position,
                index,
                (start, size - step) if size > start else None,
            )


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


class ShapeNotServed(Exception):
    """A compiled profile does not serve these input shapes: the daemon's own limit, never the model's error.

    The worker serves such a request, and that shape from then on, with eager (coverage.Covered); the
    gate does the same, so it is never a client's error nor a profile's crash.
    """


class ShapeDispatch:
    """The package compiled for exactly the example's shapes when the inputs have them, else the dynamic one.

    Only for specs with a dynamic dim besides the batch (a sequence length): a batch-only spec gets
    BatchBuckets. The dynamic package was exported from size 2 (export specialises a 1), so a batch of
    one row runs in it padded to two rows and cut back; a size of 1 in another dynamic dim (a single step
    in a dim in steps: below export_low) is served only at the example's shapes (ShapeNotServed otherwise).
    """

    def __init__(self, static: Any, static_shapes: list[tuple[int, ...]], dynamic: Any, specs: Sequence[TensorSpec]):
        self.static = static
        self.static_shapes = static_shapes
        self.dynamic = dynamic
        #: Each input's dynamic dims with the smallest size the dynamic package takes there.
        self.dynamic_dims = [[(i, 2 if i == 0 else export_low(s, i)) for i, d in enumerate(s.shape) if d is None]
                             for s in specs]  # fmt: skip

    def __call__(self, *inputs: torch.Tensor) -> Any:
        shapes = [tuple(t.shape) for t in inputs]
        if shapes == self.static_shapes:
            return self.static(*inputs)
        ones = {i for shape, dims in zip(shapes, self.dynamic_dims, strict=True) for i, low in dims if shape[i] < low}
        if ones - {0}:
            raise ShapeNotServed(
                f"this compiled profile serves a size below the dynamic program's (1, or a single step) in a dynamic "
                f"dim only at shapes {self.static_shapes}"
            )
        if not ones:
            return self.dynamic(*inputs)
        result = self.dynamic(*at_batch(tuple(inputs), 2))
        outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        if any(output.dim() == 0 or output.shape[0] != 2 for output in outputs):
            raise ShapeNotServed("this compiled profile serves one row only at the example's shapes")
        cut = tuple(output[:1] for output in outputs)
        return cut[0] if len(cut) == 1 else cut


#: The batch sizes a packaged profile is compiled for when the batch is the spec's only dynamic dim. A
#: static package is several times faster than a dynamic one (int8 ResNet-50: 11 against 106 ms at
#: batch 1), so every size is served by static packages: 1 for single requests, 8 for batches. Each
#: bucket is one compile (20-60 s on a core), so two keep the first start where one static and one
#: dynamic package had it; sizes in between are split or padded, whichever the measured costs say.
BATCH_BUCKETS = (1, 8)
#: Measuring what each bucket costs (once per package and thread count): interleaved rounds for this
#: long, at least and at most so many (a noisy box needs the rounds to tell a 20% gain from its noise).
_COST_S = 3.0
_COST_ROUNDS = (8, 40)


def batch_only(specs: Sequence[TensorSpec]) -> bool:
    """Whether every input's only dynamic dim is its first (the batch), so buckets can serve every size."""
    return all(s.shape and s.shape[0] is None and None not in s.shape[1:] for s in specs)


def batch_range(specs: Sequence[TensorSpec]) -> tuple[int, int | None]:
    """The batch sizes every input takes (the tightest of their bounds on dim 0; no upper bound: None)."""
    ranges = [s.dim_range(0) for s in specs]
    highs = [high for _, high in ranges if high is not None]
    return max(low for low, _ in ranges), min(highs) if highs else None


def buckets_for(specs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """BATCH_BUCKETS moved into the batch's declared bounds: the sizes the packages are compiled for.

    A bucket past the bounds would compile a size no request has (and an ExportedProgram source
    would refuse it); the smallest bucket then serves the smallest batch the model takes.
    """
    low, high = batch_range(specs)
    return tuple(sorted({max(low, bucket if high is None else min(bucket, high)) for bucket in BATCH_BUCKETS}))


def at_batch(inputs: Inputs, batch: int) -> Inputs:
    """The inputs padded (with copies of their first row) or cut to `batch` rows, in the memory format they had."""
    resized: list[torch.Tensor] = []
    for tensor in inputs:
        rows = tensor.shape[0]
        if rows < batch:
            # Copies of a real row, not zeros: an all-zero attention mask would make a softmax NaN.
            padded = torch.cat([tensor, tensor[:1].expand(batch - rows, *tensor.shape[1:])])
            resized.append(_like(padded, tensor))
        else:
            resized.append(_like(tensor[:batch], tensor))
    return tuple(resized)


def _like(tensor: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """`tensor` in `model`'s memory format: a package is compiled for the strides it was exported with."""
    if model.dim() == 4 and model.is_contiguous(memory_format=torch.channels_last):
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor.contiguous()


class BatchBuckets:
    """Static packages per batch bucket: a batch runs as a plan of bucket runs, the last one padded if need be.

    The plan is the cheapest by the measured cost of each bucket: with buckets 1 and 8, a batch of 3
    runs as three batch-1 calls when that is cheaper than one padded batch-8 call, and a batch of 19
    as two batch-8 calls and a remainder. So no size is slower per sample than single requests,
    which the measured costs guarantee even where a bigger batch is less efficient (tiny models).
    Outputs must carry the batch in their first dim: each is sliced back to the rows asked for.
    """

    def __init__(self, packages: Mapping[int, Callable[..., Any]], costs_ms: Mapping[int, float]) -> None:
        if not packages or sorted(packages) != sorted(costs_ms):
            raise ValueError(f"buckets {sorted(packages)} need a cost each, got {sorted(costs_ms)}")
        self.packages = dict(packages)
        self.costs_ms = dict(costs_ms)
        self.plans: dict[int, tuple[int, ...]] = {}

    @staticmethod
    def measure(packages: Mapping[int, Callable[..., Any]], example: Inputs) -> dict[int, float]:
        """Milliseconds per call of each bucket, on the example grown to its size, as the plan should count them.

        Timed in interleaved rounds (timing.py) and counted as the smallest bucket's median time the
        median per-round ratio, raised by its noise (at least MIN_MARGIN) for the bigger buckets: a
        batch is only run as one when it is cheaper per row by more than the box's noise can explain.
        """
        grown = {size: at_batch(example, size) for size in packages}

        def call(size: int) -> Callable[[], object]:
            run, inputs = packages[size], grown[size]
            return lambda: run(*inputs)

        contenders = [Contender(str(size), lambda: None, {1: call(size)}) for size in packages]
        with torch.inference_mode():
            rounds = run_rounds(contenders, _COST_S, *_COST_ROUNDS)
        single = rounds.per_sample_ms[str(min(packages))][1]
        costs: dict[int, float] = {}
        for size in packages:
            ratios = [mine / one for mine, one in zip(rounds.per_sample_ms[str(size)][1], single, strict=True)]
            ratio = statistics.median(ratios)
            # The noise relative to the ratio: a batch of 8 costing 5.2 +- 0.3 calls is 5.2 x 1.06.
            margin = 0.0 if size == 1 else max(MIN_MARGIN, noise_of([r / ratio for r in ratios]))
            costs[size] = statistics.median(single) * ratio * (1.0 + margin)
        return costs

    def plan(self, rows: int) -> tuple[int, ...]:
        """The buckets to run, in order, for a batch of `rows` (the last may be padded)."""
        cached = self.plans.get(rows)
        if cached is not None:
            return cached
        largest = max(self.packages)
        per_row = min(self.packages, key=lambda size: self.costs_ms[size] / size)
        # Beyond two of the largest bucket the best plan repeats: whole runs of the cheapest bucket per row.
        head = max(0, (rows - 2 * largest + per_row - 1) // per_row) if rows > 2 * largest else 0
        tail = rows - head * per_row
        cost = [0.0] * (tail + 1)
        choice = [0] * (tail + 1)
        for n in range(1, tail + 1):
            cost[n], choice[n] = min((self.costs_ms[s] + cost[max(0, n - s)], s) for s in self.packages)
        steps: list[int] = [per_row] * head
        n = tail
        while n > 0:
            steps.append(choice[n])
            n = max(0, n - choice[n])
        plan = tuple(sorted(steps, reverse=True))  # whole big runs first; only the last run is ever padded
        if len(self.plans) < 256:  # request sizes are few; a client sending every size cannot grow this
            self.plans[rows] = plan
        return plan

    def __call__(self, *inputs: torch.Tensor) -> Any:
        rows = {t.shape[0] for t in inputs}
        if len(rows) != 1 or 0 in rows:
            raise ValueError(f"inputs must share a non-empty batch (first) dim; they have {sorted(rows)}")
        (total,) = rows
        plan = self.plan(total)
        if len(plan) == 1 and plan[0] == total:
            return self.packages[total](*inputs)
        pieces: list[tuple[torch.Tensor, ...]] = []
        offset = 0
        for size in plan:
            take = min(size, total - offset)
            if take == 0:  # a tie in the costs left a run with nothing to do
                break
            chunk = tuple(t[offset : offset + take] for t in inputs)
            result = self.packages[size](*(at_batch(chunk, size) if take < size else chunk))
            outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
            for output in outputs:
                if output.dim() == 0 or output.shape[0] != size:
                    raise ShapeNotServed(
                        f"an output of shape {list(output.shape)} does not carry the batch ({size}) in its first dim"
                    )
            pieces.append(tuple(output[:take] for output in outputs))
            offset += take
        joined = tuple(torch.cat(parts) for parts in zip(*pieces, strict=True))
        return joined[0] if len(joined) == 1 else joined


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
