"""The element and column-group measures on the built-ins' real profiles: each profile built as a worker builds it,
run over the gate's own golden set, judged by the gate's own functions.

    PYTHONPATH=. .venv/bin/python bench/gate_measures.py resnet50 jit_onednn,bf16,int8_static
    PYTHONPATH=. .venv/bin/python bench/gate_measures.py minilm bf16,int8_dynamic 0.98

Prints, per profile, the gate's verdict (None: it passes), the worst part (channel or column group) and the worst
element. minilm needs the optional `minilm` extra and uses its 8 validation sentences; the others use the gate's
3 synthetic samples. docs/optimization.md ("Parts of an output") carries the figures.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from infervisor.common.cpuinfo import read_caps
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.worker.bench import BUILTIN_SPECS
from infervisor.worker.models import build_builtin
from infervisor.worker.profiles.build import build_profile
from infervisor.worker.profiles.calibration import load_calibration
from infervisor.worker.profiles.flags import apply_global_flags, reset_global_flags
from infervisor.worker.profiles.golden import golden_set
from infervisor.worker.profiles.parts import parts_verdict
from infervisor.worker.profiles.validate import Tolerance, compare, worst_of
from infervisor.worker.runner import ModelRunner
from infervisor.worker.start import build_context


def _model(name: str, folder: Path) -> tuple[Any, ModelSource, str | None, Any]:
    """The module, its source, its calibration file and its validation samples (None: the gate's synthetic ones)."""
    if name != "minilm":
        return build_builtin(name), ModelSource("builtin", name), None, None
    from infervisor.worker.models import minilm

    calibration, validation = minilm.write_sets(folder / "data")
    source = ModelSource("python", "infervisor.worker.models.minilm:minilm")
    return minilm.minilm(), source, str(calibration), load_calibration(validation, BUILTIN_SPECS["encoder"])


def main(argv: list[str]) -> int:
    """Measure each named profile of one model and print the gate's figures."""
    name, profiles = argv[0], tuple(argv[1].split(","))
    tolerance = Tolerance(float(argv[2]) if len(argv) > 2 else 0.999)
    folder = Path(tempfile.mkdtemp())
    module, source, calibration, validation = _model(name, folder)
    specs = BUILTIN_SPECS["encoder" if name == "minilm" else name]
    runner = ModelRunner(module, specs, None)
    launch = LaunchSpec("bench", name, -1, source, specs, None, (0,), 1, profiles=profiles, cache_dir=str(folder),
                        calibration=calibration)  # fmt: skip
    context = build_context(launch, runner)
    golden = golden_set(runner, validation)
    named = [runner.forward(case.inputs) for case in golden.cases]
    references, names = [[a for _, a in outputs] for outputs in named], [n for n, _ in named[0]]
    eager, caps = runner.module, read_caps()
    print(f"{name}: {golden.checked}; limits element {tolerance.max_element_error}, channel "
          f"{tolerance.max_channel_error} (cpu {caps.tier})")  # fmt: skip
    for profile in profiles:
        runner.module = build_profile(profile, context).callable
        apply_global_flags(profile)
        try:
            outputs = [[a for _, a in runner.forward(case.inputs)] for case in golden.cases]
        finally:
            runner.module = eager
            reset_global_flags()
        agreements = [
            (compare(r, o, names), c.where) for c, r, o in zip(golden.cases, references, outputs, strict=True)
        ]
        result = worst_of(agreements, golden.checked)
        parts, note = parts_verdict(golden.cases, references, outputs, names, {}, tolerance.max_channel_error)
        print(f"{profile}: verdict {result.failure(tolerance) or parts}\n  {note}\n  worst {result.element.text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
