"""Runs a loaded module on wire tensors: input checks, inference mode, outputs as named arrays."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from infervisor.protocol.arrays import check_finite
from infervisor.protocol.constants import DTYPE_ITEMSIZE, MAX_RANK, MAX_TENSORS, ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.tensors import TensorDesc, TensorSpec
from infervisor.worker.synthetic import TORCH_DTYPES, probe_steps, probed_inputs, synthetic_inputs

# Frames are received into zmq-owned memory exposed read-only; the model only reads them, so
# torch's warning about non-writable buffers is noise on every request.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class FailedAtSize(RuntimeError):
    """The model failed on inputs the daemon ran it on itself (warm-up, the gate, the state check): the message
    names what they were for, each input's shape and its declared shape, then the model's own error."""


def failed_at(specs: Sequence[TensorSpec], inputs: Mapping[str, torch.Tensor], what: str, exc: Exception) -> str:
    """Why the model failed on `inputs` (run for `what`), naming each input's shape against its declared one."""
    shapes = ", ".join(
        f"`{spec.name}` {list(inputs[spec.name].shape)} (declared {spec.describe()})" for spec in specs
        if spec.name in inputs
    )  # fmt: skip
    text = f"the model failed on {what} at {shapes}: {type(exc).__name__}: {exc}"
    if any(d is None for spec in specs for d in spec.shape[1:]):
        text += (
            " (the daemon draws sizes across each declared range; if the model takes only some sizes of a dim, "
            "declare them: a narrower [min, max], or sizes in steps [min, max, step])"
        )
    return text


class ModelRunner:
    """One model's forward pass with the checks and conversions the wire needs."""

    def __init__(
        self, module: Any, specs: Sequence[TensorSpec], output_names: Sequence[str] | None, channels_last: bool = False
    ) -> None:
        # NHWC lets oneDNN skip layout reorders around every convolution (seed 1's memory-layout layer).
        self.channels_last = channels_last
        if channels_last and isinstance(module, torch.nn.Module):
            module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # missing in stubs
        self.module = module
        self.specs = tuple(specs)
        self.output_names = tuple(output_names) if output_names else None
        #: What canaries rerun: inputs across the declared ranges, and the outputs warm-up gave for each.
        self.golden: list[tuple[dict[str, torch.Tensor], list[tuple[str, np.ndarray[Any, Any]]]]] = []
        self.next_canary = 0

    def example_inputs(self, batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
        """Synthetic inputs of the declared spec (dynamic dims = `batch`), used for warm-up, checks and canaries.

        Drawn as each input declares (infervisor/worker/synthetic.py); seed 0 is the warm-up and canary input.
        """
        return synthetic_inputs(self.specs, batch, seed)

    def inputs_from_frames(self, descs: Sequence[TensorDesc], buffers: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Tensors viewing the received frames (no copy), after refusing NaN/Inf where this worker's spec does.

        `descs` already matched the specs (check_against_spec), in any order. The worker's own spec
        decides, not the broker's: mid-rollout the broker may already hold a config that allows what
        this older worker's refuses.
        """
        check_finite(descs, buffers, self.specs)
        return {
            desc.name: torch.frombuffer(buffer, dtype=TORCH_DTYPES[desc.dtype]).reshape(desc.shape)
            for desc, buffer in zip(descs, buffers, strict=True)
        }

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """Run the model in inference mode and name its outputs."""
        args = [inputs[s.name] for s in self.specs]
        if self.channels_last:
            args = [a.contiguous(memory_format=torch.channels_last) if a.dim() == 4 else a for a in args]
        with torch.inference_mode():
            result = self.module(*args)
        return self._name_outputs(result)

    def forward_at(self, inputs: Mapping[str, torch.Tensor], what: str) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """forward on inputs the daemon chose itself (for `what`, e.g. `warm-up`); FailedAtSize naming their shapes
        when the model fails on them."""
        try:
            return self.forward(inputs)
        except Exception as exc:  # noqa: BLE001 - whatever the model raised, said with the sizes it was run at
            raise FailedAtSize(failed_at(self.specs, inputs, what, exc)) from exc

    def warm_up(self, iterations: int) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """Run the example inputs `iterations` times (first-call costs land here), then once each input across the
        declared ranges (synthetic.probe_shapes at batch 1): their outputs are what canaries compare with."""
        inputs = self.example_inputs()
        outputs = self.forward_at(inputs, "warm-up")
        for _ in range(iterations - 1):
            outputs = self.forward(inputs)
        self.golden = [(inputs, [(name, array.copy()) for name, array in outputs])]
        for turn in range(1, probe_steps(self.specs)):
            probe = probed_inputs(self.specs, 1, turn)
            outputs = self.forward_at(probe, "warm-up across the declared ranges")
            self.golden.append((probe, [(name, array.copy()) for name, array in outputs]))
        return outputs

    def canary(self) -> tuple[float, float]:
        """Re-run one golden input, the next across the declared ranges each time: (largest absolute difference
        from its warm-up outputs, their largest magnitude); a profile that fell back for good fails it."""
        if getattr(self.module, "gave_up", False):
            return float("inf"), 1.0
        inputs, golden = self.golden[self.next_canary % len(self.golden)]
        self.next_canary += 1
        error, scale = 0.0, 0.0
        for (_, want), (_, got) in zip(golden, self.forward(inputs), strict=True):
            if want.shape != got.shape:
                return float("inf"), 1.0
            reference = want.astype(np.float64)
            difference = np.abs(got.astype(np.float64) - reference)
            # NaN compares false with everything, so a max would hide it: any non-finite change is a failure.
            if not np.isfinite(difference).all():
                return float("inf"), 1.0
            error = max(error, float(np.max(difference, initial=0.0)))
            scale = max(scale, float(np.max(np.abs(reference), initial=0.0)))
        return error, scale

    def _name_outputs(self, result: Any) -> list[tuple[str, np.ndarray[Any, Any]]]:
        if isinstance(result, torch.Tensor):
            tensors: list[tuple[str | None, torch.Tensor]] = [(None, result)]
        elif isinstance(result, (tuple, list)):
            tensors = [(None, t) for t in result]
        elif isinstance(result, Mapping):
            tensors = [(str(k), v) for k, v in result.items()]
        else:
            raise TypeError(f"model returned {type(result).__name__}; expected a tensor, tuple, list or dict")
        names = self.output_names
        if len(tensors) > MAX_TENSORS:
            raise TypeError(f"model returned {len(tensors)} outputs; the wire carries at most {MAX_TENSORS}")
        if names is not None and len(names) != len(tensors):
            raise TypeError(f"model returned {len(tensors)} outputs but {len(names)} output names are configured")
        named: list[tuple[str, np.ndarray[Any, Any]]] = []
        for index, (key, tensor) in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"output {index} is a {type(tensor).__name__}, not a tensor")
            # A dict's own key is kept as it is, "" included: the descriptor checks refuse it (INTERNAL), as
            # docs/protocol.md section 5 says, rather than a made-up name the client never asked for.
            default = "output" if index == 0 else f"output_{index}"
            name = names[index] if names is not None else (key if key is not None else default)
            if tensor.dim() > MAX_RANK or any(name == other for other, _ in named):
                raise TypeError(f"output {name!r} has rank {tensor.dim()} (max {MAX_RANK}) or a duplicate name")
            named.append((name, wire_array(name, tensor.detach())))
        return named


#: Output dtypes the wire has no name for but whose every value a wider wire dtype holds exactly: the worker
#: sends them widened (docs/protocol.md section 5). Any other dtype off the wire's list is refused.
EXACT_WIDENING: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.float32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    **{
        getattr(torch, name): torch.float32
        for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
        if hasattr(torch, name)
    },
}

#: The torch dtypes the wire carries as they are.
_WIRE_TORCH_DTYPES = frozenset(TORCH_DTYPES[name] for name in DTYPE_ITEMSIZE)


def wire_array(name: str, tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """Output `name` as an array of a wire dtype, widened only where every value survives (EXACT_WIDENING).

    ProtocolError INTERNAL for any other dtype (complex, uint64, quantized, ...): converting it would lose
    values without a word, so the request gets an error naming the output and its dtype instead.
    """
    dtype = tensor.dtype
    if dtype not in _WIRE_TORCH_DTYPES:
        wider = EXACT_WIDENING.get(dtype)
        if wider is None:
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"output {name!r} has dtype {str(dtype).removeprefix('torch.')}, which the wire cannot carry "
                f"exactly (wire dtypes: {', '.join(DTYPE_ITEMSIZE)}); convert it in the model",
            )
        tensor = tensor.to(wider)
    return tensor.contiguous().numpy()


def timed_ms(start: float) -> float:
    """Milliseconds since a perf_counter reading."""
    return (time.perf_counter() - start) * 1000.0
