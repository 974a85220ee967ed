"""Refuses at load a model that keeps state between calls: one worker's module serves every client in turn.

Warm-up, the accuracy gate and canaries call the module before and between requests, and requests of all
clients share it, so a model that updates an internal state on each `forward` (a streaming detector's
hidden state, a call counter) answers each request after a history nobody chose. Two checks, both on
the loaded module before any profile is built: the same input must give the same outputs when repeated
and after other inputs have run, and no buffer or attribute (TorchScript attributes included) may change
between those calls. A value set on the first call only (a lazily filled cache) is not state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from infervisor.worker.loader import ModelLoadError
from infervisor.worker.runner import ModelRunner

#: Synthetic samples run between the two calls of the warm-up input (0 is the warm-up input's seed).
_OTHER_SEEDS = (1001, 1002)
#: Two eager runs of one input on one module differ by less than this (relative to the output's largest magnitude)
#: unless something carried over: CPU kernels are deterministic at a fixed shape and thread count.
_REPEAT_TOLERANCE = 1e-5

HOW_TO_SERVE = (
    "a worker runs warm-up and accuracy checks before the first request and serves every client from one "
    "module, so each answer would depend on calls nobody chose. To serve it, carry the state as an input and an "
    "output: forward(x, state) -> (y, new_state), batch-first so rows can batch, and keep each stream's state on "
    "the client (docs/configuration.md, 'Stateful models')"
)


def refuse_stateful(runner: ModelRunner) -> None:
    """ModelLoadError naming what changed when the loaded module's outputs or state depend on earlier calls."""
    module = runner.module
    golden = runner.example_inputs(batch=1, seed=0)
    # The model's first call: a failure here is no finding about state, so the reason names the call, not the check.
    first = _copied(runner.forward_at(golden, "its first call (the daemon's synthetic input, before warm-up)"))
    state_after_first = dict(_state(module))
    repeated = _copied(runner.forward(golden))
    for seed in _OTHER_SEEDS:
        runner.forward(runner.example_inputs(batch=1, seed=seed))
    last = _copied(runner.forward(golden))
    state_after_last = dict(_state(module))
    changed = sorted(
        name
        for name in state_after_first.keys() | state_after_last.keys()
        if state_after_first.get(name) != state_after_last.get(name)
    )
    drift = _difference(first, repeated, "when run again at once") or _difference(first, last, "after other inputs ran")
    if drift is None and not changed:
        return
    found = [drift] if drift else []
    if changed:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        shown = ", ".join(repr(name) for name in changed[:5]) + more
        found.append(f"forward changes {shown} on every call")
    raise ModelLoadError(f"the model keeps state between calls ({'; '.join(found)}): {HOW_TO_SERVE}")


def _copied(outputs: list[tuple[str, np.ndarray[Any, Any]]]) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """Outputs detached from the module: an output may be a view of a buffer that the next call overwrites."""
    return [(name, np.array(array, copy=True)) for name, array in outputs]


def _difference(
    want: list[tuple[str, np.ndarray[Any, Any]]], got: list[tuple[str, np.ndarray[Any, Any]]], when: str
) -> str | None:
    """What differs between two runs of the same input (None: the same within _REPEAT_TOLERANCE)."""
    for (name, a), (_, b) in zip(want, got, strict=True):
        if a.shape != b.shape:
            return f"the same input gave output {name!r} of shape {list(a.shape)}, then {list(b.shape)} {when}"
        if a.dtype.kind not in "fc":
            if not np.array_equal(a, b):
                return f"the same input gave a different output {name!r} {when}"
            continue
        reference = a.astype(np.float64)
        error = float(np.max(np.abs(reference - b.astype(np.float64)), initial=0.0))
        scale = max(1e-12, float(np.max(np.abs(reference), initial=0.0)))
        if not error <= _REPEAT_TOLERANCE * scale:  # NaN included
            return f"the same input gave output {name!r} {error:.3g} apart {when}"
    return None


def _state(module: Any) -> Iterator[tuple[str, str]]:
    """(name, digest) of every buffer and attribute a call could change; parameters are left out (weights)."""
    if isinstance(module, torch.jit.ScriptModule):
        # TorchScript attributes (`self.state = ...` in a scripted module) are not buffers; torch lists them here.
        iterators = getattr(torch._C, "_jit_debug_module_iterators", None)
        if iterators is not None:
            listed = iterators(module._c)
            weights = {name for name, _ in listed["named_parameters_r"]}
            for name, value in listed["named_attributes_r"]:
                if name not in weights and not isinstance(value, torch.ScriptObject):
                    yield name, _digest(value)
            return
    if isinstance(module, torch.nn.Module):
        yield from ((name, _digest(buffer)) for name, buffer in module.named_buffers())
        for prefix, child in module.named_modules():
            for name, value in vars(child).items():
                if isinstance(value, (torch.Tensor, int, float, str)) and not isinstance(value, torch.nn.Parameter):
                    yield (f"{prefix}.{name}" if prefix else name), _digest(value)


def _digest(value: object) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    try:
        flat = value.detach().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return f"{value.dtype}{list(value.shape)}{hashlib.blake2b(data, digest_size=16).hexdigest()}"
    except (RuntimeError, TypeError):  # sparse, quantized or meta tensors: their printed form stands for them
        return repr(value)
