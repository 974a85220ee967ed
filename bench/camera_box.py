"""A camera box's detector through the worker's own pick: which profile serves at 480x640, or why none beats eager.

    PYTHONPATH=. .venv/bin/python bench/camera_box.py [--profiles eager,jit,...] [--threads 2] [--cache-dir D]

`detector` is a small YOLO-like network built here (no weights to download): a strided conv backbone (SiLU, batch
norm) to strides 8, 16 and 32, and one packed head per level whose channels are 4 box values in pixels (centre and
size, hundreds) then 80 class scores (sigmoid, prior 0.01 as YOLO initialises them), joined over the anchors into
one output `pred` [batch, 84, anchors]. Its input is `[null, 3, [64, 640], [64, 640]]`. The run builds the chain as
a worker does (select_profile, pick fastest, typical_shape 480x640, a validation set of uniform 0..1 images in three
shape groups), prints why each profile was refused or how it compared, then times eager and the picked profile at
480x640 interleaved (medians and P99 of per-call milliseconds, and their ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infervisor.protocol.tensors import Synthetic, TensorSpec

CLASSES = 80
DETECTOR_SPECS = (
    TensorSpec("image", "float32", (None, 3, None, None), bounds=(None, None, (64, 640), (64, 640)),
               synthetic=Synthetic("uniform", 0.0, 1.0)),
)  # fmt: skip
TYPICAL = {"image": [1, 3, 480, 640]}
#: The validation set's shape groups (height x width), two images each.
GROUPS = {"small": (256, 320), "camera": (480, 640), "square": (320, 320)}


def _conv(inputs: int, outputs: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.SiLU())


class Detector(nn.Module):
    """Backbone to strides 8/16/32, a packed head per level, decoded to pixels and joined over the anchors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(_conv(3, 16, 2), _conv(16, 32, 2), _conv(32, 32, 1))
        self.p3 = nn.Sequential(_conv(32, 64, 2), _conv(64, 64, 1))
        self.p4 = nn.Sequential(_conv(64, 128, 2), _conv(128, 128, 1))
        self.p5 = nn.Sequential(_conv(128, 256, 2), _conv(256, 256, 1))
        self.heads = nn.ModuleList(
            nn.Sequential(_conv(c, 64, 1), nn.Conv2d(64, 4 + CLASSES, 1)) for c in (64, 128, 256)
        )
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Conv2d) and module.out_channels == 4 + CLASSES and module.bias is not None:
                    module.bias[4:].fill_(-4.6)  # the class prior YOLO starts from: sigmoid(-4.6) = 0.01
                    module.weight.mul_(3.0)  # scores that spread over 0..1 as a trained head's do
                if isinstance(module, nn.BatchNorm2d):  # running statistics of a trained network, not 0 and 1
                    module.running_mean = torch.empty(module.num_features).uniform_(-0.1, 0.1)
                    module.running_var = torch.empty(module.num_features).uniform_(0.5, 1.5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        p3 = self.p3(self.stem(image))
        p4 = self.p4(p3)
        p5 = self.p5(p4)
        levels = []
        for features, head, stride in zip((p3, p4, p5), self.heads, (8, 16, 32), strict=True):
            raw = head(features)
            height, width = raw.shape[-2:]
            ys = torch.arange(height, dtype=raw.dtype).view(1, height, 1).expand(1, height, width)
            xs = torch.arange(width, dtype=raw.dtype).view(1, 1, width).expand(1, height, width)
            grid = torch.cat([xs, ys]).unsqueeze(0)
            centre = (torch.sigmoid(raw[:, :2]) * 2 - 0.5 + grid) * stride
            size = (torch.sigmoid(raw[:, 2:4]) * 2) ** 2 * (4 * stride)
            scores = torch.sigmoid(raw[:, 4:])
            levels.append(torch.cat([centre, size, scores], dim=1).flatten(2))
        return torch.cat(levels, dim=2)


def detector() -> nn.Module:
    """Factory for config: {"python": "bench.camera_box:detector"}."""
    return Detector().eval()


def kept_detections(eager: dict[str, Any], profile: dict[str, Any]) -> tuple[bool, str]:
    """The task-level check of docs/configuration.md's camera-box example: the (anchor, class) pairs above the box's
    threshold 0.25 are the same, and their boxes within 2 pixels."""
    import numpy as np

    want, got = eager["pred"], profile["pred"]
    kept, kept_by_profile = want[:, 4:] > 0.25, got[:, 4:] > 0.25
    if not np.array_equal(kept, kept_by_profile):
        flipped = int((kept != kept_by_profile).sum())
        return False, f"{flipped} of {int(kept.sum())} detections above 0.25 flip"
    anchors = kept.any(axis=1)
    moved = np.abs(want[:, :4] - got[:, :4]).max(axis=1)[anchors]
    if moved.size and moved.max() > 2.0:
        return False, f"a kept box moves by {moved.max():.2f} pixels"
    return True, f"{int(kept.sum())} detections agree"


def _validation(folder: Path) -> Path:
    import numpy as np

    generator = np.random.default_rng(1)
    arrays = {f"image@{label}": generator.random((2, 3, h, w), dtype=np.float32) for label, (h, w) in GROUPS.items()}
    path = folder / "validation.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def _time(runner: Any, modules: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Per-call milliseconds at the typical size, the modules turn about in each round."""
    image = {"image": torch.rand(*TYPICAL["image"], generator=torch.Generator().manual_seed(4))}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for module in modules.values():  # a first call of each shape may compile or allocate
        runner.module = module
        runner.forward(image)
    for _ in range(rounds):
        for name, module in modules.items():
            runner.module = module
            started = time.perf_counter()
            runner.forward(image)
            times[name].append((time.perf_counter() - started) * 1000.0)
    return times


def main() -> int:
    """Pin like a worker, pick as a worker does, time eager against the pick."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="eager,jit,jit_onednn,bf16,int8_static,openvino,openvino_bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "infervisor-camera-box"))
    parser.add_argument("--task-check", action="store_true", help="also judge by kept_detections")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    from infervisor.common.cpuinfo import read_caps
    from infervisor.protocol.launch import LaunchSpec, ModelSource
    from infervisor.worker.loader import load_model
    from infervisor.worker.profiles.calibration import load_calibration
    from infervisor.worker.profiles.select import select_profile
    from infervisor.worker.profiles.validate import Tolerance
    from infervisor.worker.runner import ModelRunner
    from infervisor.worker.start import build_context

    source = ModelSource("python", "bench.camera_box:detector")
    with tempfile.TemporaryDirectory() as folder:
        validation = _validation(Path(folder))
        launch = LaunchSpec("camera", "detector", -1, source, DETECTOR_SPECS, ("pred",), (), len(cpus),
                            profiles=tuple(args.profiles.split(",")), pick="fastest", cache_dir=args.cache_dir,
                            validation=str(validation), calibration=str(validation), typical_shape=TYPICAL)  # fmt: skip
        runner = ModelRunner(load_model(source, DETECTOR_SPECS), DETECTOR_SPECS, ("pred",))
        eager = runner.module
        context = build_context(launch, runner)
        check = "bench.camera_box:kept_detections" if args.task_check else None
        tolerance = Tolerance(task_check=check)
        started = time.perf_counter()
        samples = load_calibration(validation, DETECTOR_SPECS)
        selection = select_profile(runner, launch.profiles, tolerance, read_caps(), context, "fastest", samples)
        print(f"picked {selection.profile} in {time.perf_counter() - started:.0f} s")
        for line in selection.skipped:
            print(f"  not served: {line}")
        for note in selection.notes:
            print(f"  note: {note}")
        served = runner.module
    times = _time(runner, {"eager": eager, selection.profile: served}, args.rounds)
    for name, values in times.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        median = statistics.median(values)
        print(f"{name} at 1x3x480x640: median {median:.1f} ms, P99 {p99:.1f} ms over {len(values)} calls")
    if selection.profile != "eager":
        ratio = statistics.median(times[selection.profile]) / statistics.median(times["eager"])
        print(f"{selection.profile} / eager median: x{ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
