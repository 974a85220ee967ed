"""What the default `max_channel_error` (0.1) lets through: the worst channel error of bf16 and int8 numerics on
dense outputs, measured without building the profiles (no compile: the figures of a loaded box in minutes).

    PYTHONPATH=. .venv/bin/python bench/channel_error.py

bf16 is CPU autocast (the `bf16` profile's numerics; it runs emulated where the CPU has no native bf16); int8 is
eager-mode quantization with fbgemm: dynamic on Linear layers (as `int8_dynamic`), static FX on convs calibrated on 8
inputs (per-channel weights and per-tensor activations, as `int8_static`'s x86 quantizer). Judged as the gate judges:
infervisor/worker/profiles/parts.py, channel axis = the smallest non-batch axis.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from infervisor.common.accuracy import DEFAULT_MAX_CHANNEL_ERROR
from infervisor.worker.profiles.parts import judge_parts


def _worst(want: Any, got: Any) -> str:
    (error,) = judge_parts([want], [got], ["out"], {}, DEFAULT_MAX_CHANNEL_ERROR)
    return f"{error.error:.4f} ({error.part}, eager {error.eager:.4g}, profile {error.got:.4g})"


def _bf16(model: Any, inputs: tuple[Any, ...]) -> Any:
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*inputs).float().numpy()


def _int8_static(model: Any, inputs: tuple[Any, ...], calibration: list[tuple[Any, ...]]) -> Any:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    prepared = prepare_fx(model, get_default_qconfig_mapping("fbgemm"), inputs)
    with torch.inference_mode():
        for sample in calibration:
            prepared(*sample)
        return convert_fx(prepared)(*inputs).numpy()


def _int8_dynamic(model: Any, inputs: tuple[Any, ...]) -> Any:
    quantized = torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
        model, {torch.nn.Linear}, dtype=torch.qint8
    )
    with torch.inference_mode():
        return quantized(*inputs).numpy()


def main() -> int:
    """One line per model and numerics."""
    torch.manual_seed(0)
    from bench.camera_box import detector
    from bench.gate import resnet18_features

    generator = torch.Generator().manual_seed(1)
    for name, factory, shape in (("detector", detector, (1, 3, 256, 320)),
                                 ("resnet18 features", resnet18_features, (1, 3, 224, 224))):  # fmt: skip
        model = factory()
        images = [(torch.rand(*shape, generator=generator),) for _ in range(9)]
        with torch.inference_mode():
            want = model(*images[0]).numpy()
        print(f"{name} {list(want.shape)} bf16: {_worst(want, _bf16(model, images[0]))}", flush=True)
        print(f"{name} {list(want.shape)} int8 static: {_worst(want, _int8_static(model, images[0], images[1:]))}")
    try:
        from bench.gate import minilm_states
        from infervisor.worker.models.minilm import tokenize
    except ImportError as exc:
        print(f"minilm: {exc}")
        return 0
    states = minilm_states()
    tokens = tokenize(["A camera box watches the loading dock.", "The model returns one vector per token."])
    inputs = tuple(torch.from_numpy(np.asarray(tokens[k])) for k in ("input_ids", "attention_mask"))
    with torch.inference_mode():
        want = states(*inputs).numpy()
    print(f"minilm states {list(want.shape)} bf16: {_worst(want, _bf16(states, inputs))}", flush=True)
    print(f"minilm states {list(want.shape)} int8 dynamic: {_worst(want, _int8_dynamic(states, inputs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
