"""The accuracy gate's figures: every profile's worst row against eager, as a worker's gate measures it.

    .venv/bin/python bench/gate.py [--models tiny,resnet18,resnet50,encoder,minilm,minilm-synthetic,detector,
                                            minilm-states,resnet18-features]
                                   [--profiles eager,jit,...] [--threads 2] [--cache-dir D] [--json F]

Each model's golden set is built as a worker builds it (infervisor/worker/profiles/select.py golden_set: every
sample alone, all of them batched); each profile is built (packages compiled into --cache-dir, or
loaded from it) and its worst-row cosine, largest error, and where each was, are printed. `minilm`
is the real all-MiniLM-L6-v2 (extra `minilm`) checked on its 8 validation sentences and calibrated
on its 16 calibration sentences; `minilm-synthetic` is the same model judged on synthetic token ids
declared as `{"distribution": "integers", "low": 0, "high": 30522}` (attention mask ones), to show
what synthetic data alone would have said. The built-ins are judged on their default synthetic data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_PROFILES = "eager,jit,jit_onednn,aoti,int8_static,int8_dynamic,bf16"


def minilm_states() -> Any:
    """all-MiniLM-L6-v2's last hidden states `[batch, 128, 384]`, before pooling: a dense output judged by channel."""
    from torch import nn

    from infervisor.worker.models.minilm import minilm

    class States(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert: Any = minilm().bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return States().eval()


def resnet18_features() -> Any:
    """resnet18 (the built-in's random weights) up to its last feature map `[batch, 512, 7, 7]`."""
    import torch
    from torch import nn

    from infervisor.protocol.launch import ModelSource
    from infervisor.worker.bench import BUILTIN_SPECS
    from infervisor.worker.loader import load_model

    model = load_model(ModelSource("builtin", "resnet18"), BUILTIN_SPECS["resnet18"])
    torch.manual_seed(0)
    return nn.Sequential(*list(model.children())[:-2]).eval()


def _models(names: list[str], data: Path) -> dict[str, tuple[Any, Any, str | None, str | None]]:
    """name -> (source, specs, calibration, validation)."""
    from infervisor.protocol.launch import ModelSource
    from infervisor.protocol.tensors import Synthetic, TensorSpec
    from infervisor.worker.bench import BUILTIN_SPECS

    models: dict[str, tuple[Any, Any, str | None, str | None]] = {}
    for name in names:
        if name == "detector":  # the camera-box detector of bench/camera_box.py, on uniform 0..1 images at 256x320
            fixed = (TensorSpec("image", "float32", (None, 3, 256, 320), synthetic=Synthetic("uniform", 0.0, 1.0)),)
            models[name] = (ModelSource("python", "bench.camera_box:detector"), fixed, None, None)
            continue
        if name == "resnet18-features":
            features = ModelSource("python", "bench.gate:resnet18_features")
            models[name] = (features, BUILTIN_SPECS["resnet18"], None, None)
            continue
        if name == "minilm-states":
            from infervisor.worker.models.minilm import write_sets

            calibration, validation = write_sets(data)
            source = ModelSource("python", "bench.gate:minilm_states")
            models[name] = (source, BUILTIN_SPECS["encoder"], str(calibration), str(validation))
            continue
        if name in BUILTIN_SPECS:
            models[name] = (ModelSource("builtin", name), BUILTIN_SPECS[name], None, None)
            continue
        from infervisor.worker.models.minilm import write_sets

        calibration, validation = write_sets(data)
        source = ModelSource("python", "infervisor.worker.models.minilm:minilm")
        specs = BUILTIN_SPECS["encoder"]
        if name == "minilm":
            models[name] = (source, specs, str(calibration), str(validation))
        elif name == "minilm-synthetic":
            ids = TensorSpec("input_ids", "int64", (None, 128), synthetic=Synthetic("integers", 0.0, 30522.0))
            models[name] = (source, (ids, specs[1]), str(calibration), None)
        else:
            raise SystemExit(f"unknown model {name!r}")
    return models


def measure(
    name: str, model: tuple[Any, Any, str | None, str | None], profiles: list[str], args: Any
) -> list[dict[str, Any]]:
    """Every profile of one model through the gate."""
    import torch

    from infervisor.common.accuracy import DEFAULT_MAX_CHANNEL_ERROR
    from infervisor.common.cpuinfo import read_caps
    from infervisor.common.profiles import cpu_refusal
    from infervisor.protocol.launch import LaunchSpec
    from infervisor.worker.loader import default_output_names, load_model
    from infervisor.worker.profiles.build import build_profile
    from infervisor.worker.profiles.builders import ProfileError
    from infervisor.worker.profiles.calibration import load_calibration
    from infervisor.worker.profiles.flags import reset_global_flags
    from infervisor.worker.profiles.golden import golden_set
    from infervisor.worker.profiles.parts import parts_verdict
    from infervisor.worker.profiles.validate import compare, worst_of
    from infervisor.worker.runner import ModelRunner
    from infervisor.worker.start import build_context

    source, specs, calibration, validation = model
    launch = LaunchSpec(
        "gate", name, -1, source, specs, None, (), args.threads, profiles=tuple(profiles),
        cache_dir=args.cache_dir, calibration=calibration, validation=validation,
    )  # fmt: skip
    runner = ModelRunner(load_model(source, specs), specs, default_output_names(source))
    eager = runner.module
    golden = golden_set(runner, load_calibration(Path(validation), specs) if validation else None)
    references = [[a for _, a in runner.forward(case.inputs)] for case in golden.cases]
    context = build_context(launch, runner)
    rows: list[dict[str, Any]] = []
    caps = read_caps()
    for profile in profiles:
        row: dict[str, Any] = {"model": name, "profile": profile, "checked": golden.checked}
        refusal = cpu_refusal(profile, caps)
        if refusal is not None:
            rows.append({**row, "skipped": refusal})
            continue
        started = time.perf_counter()
        try:
            built = build_profile(profile, context)
            runner.module = built.callable
            with torch.inference_mode():
                runner.forward(golden.cases[0].inputs)
            outputs = [[a for _, a in runner.forward(case.inputs)] for case in golden.cases]
            agreements = [
                (compare(reference, got), case.where)
                for case, reference, got in zip(golden.cases, references, outputs, strict=True)
            ]
            names = [f"output {i}" for i in range(len(references[0]))]
            failure, note = parts_verdict(golden.cases, references, outputs, names, {}, DEFAULT_MAX_CHANNEL_ERROR)
        except ProfileError as exc:
            rows.append({**row, "skipped": str(exc)[:200]})
            continue
        finally:
            reset_global_flags()
        result = worst_of(agreements, golden.checked)
        runner.module = eager
        rows.append({
            **row, "cosine": result.cosine, "cosine_at": result.cosine_at, "max_abs_error": result.max_abs_error,
            "error_at": result.error_at, "top1": result.top1_agree, "seconds": round(time.perf_counter() - started, 1),
            "parts": failure or note.removeprefix("worst part: ") or "-",
        })  # fmt: skip
        print(f"{name} {profile}: {rows[-1]['cosine']:.9f} ({rows[-1]['cosine_at']}) {rows[-1]['parts']}",
              file=sys.stderr, flush=True)  # fmt: skip
    return rows


def main() -> int:
    """Pin like a worker, then measure every model and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,resnet18,resnet50,encoder,minilm,minilm-synthetic")
    parser.add_argument("--profiles", default=DEFAULT_PROFILES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "infervisor-gate-cache"))
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cpus)
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = str(len(cpus))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(args.cache_dir) / "inductor"))
    import torch

    from infervisor.common.accuracy import cosine_text

    torch.set_num_threads(len(cpus))
    with tempfile.TemporaryDirectory() as data:
        models = _models(args.models.split(","), Path(data))
        rows = [row for name, model in models.items() for row in measure(name, model, args.profiles.split(","), args)]
    print("| model | profile | worst-row cosine | where | max abs error | top-1 | worst channel (max_channel_error) | "
          "checked on |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "skipped" in row:
            print(f"| {row['model']} | {row['profile']} | - | skipped: {row['skipped'][:90]} | | | |")
            continue
        print(f"| {row['model']} | {row['profile']} | {cosine_text(row['cosine'])} | {row['cosine_at']} | "
              f"{row['max_abs_error']:.3g} | {'yes' if row['top1'] else 'no'} | {row['parts']} | "
              f"{row['checked']} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
