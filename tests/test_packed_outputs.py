"""The gate sees every part of an output (channels on their own scale, declared slices, a task check), and pick
"fastest" times its candidates at the size that is served."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.supervisor.settings.config import ConfigError, parse_config
from infervisor.worker.profiles.parts import OutputRule, RuleError, SliceRule, judge_parts
from infervisor.worker.profiles.task_check import TaskCheck
from infervisor.worker.profiles.validate import Tolerance
from tests.conftest import Daemon, model_entry, wait_for
from tests.packed_models import PACKED_INPUTS, SCORE_SHIFT, SIZED_INPUTS, scores_off_when_traced

_SLICED = {"max_channel_error": None, "outputs": {"pred": {"slices": {"scores": {"axis": 1, "range": [4, 8]}}}}}


def _packed() -> tuple[np.ndarray, np.ndarray]:
    """Eager's packed output on two images, and the same with only the scores moved by SCORE_SHIFT."""
    with torch.inference_mode():
        want = scores_off_when_traced()(torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))).numpy()
    moved = want.copy()
    moved[:, 4:] += SCORE_SHIFT
    return want, moved


def test_channels_on_their_own_scale_catch_scores_a_packed_row_hides() -> None:
    """Scores moved by 0.15 beside coordinates of hundreds fail the default channel error, naming the channel, the row
    and the figures; a bf16-sized change passes; a declared slice and a whole-output limit judge as declared."""
    want, moved = _packed()
    worst = max(judge_parts([want], [moved], ["pred"], {}, 0.1), key=lambda e: e.excess)
    assert worst.fails and worst.measure == "channel error" and worst.part.endswith("along axis 1"), worst
    assert worst.text("sample 0").startswith(f"channel error {worst.error:.3g} > 0.1 on output 'pred', channel ")
    assert all(not e.fails for e in judge_parts([want], [want * 1.004], ["pred"], {}, 0.1))
    # The default follows min_cosine: 0.1 at 0.999, loosened alike where the cosine was loosened for int8.
    assert (Tolerance().max_channel_error, Tolerance(0.98).max_channel_error) == (0.1, 0.4472)
    assert Tolerance(max_channel_error=None).max_channel_error is None
    scores = OutputRule(None, slices=(SliceRule("scores", 1, 4, 8),))
    (sliced,) = judge_parts([want], [moved], ["pred"], {"pred": scores}, None)
    assert sliced.fails and sliced.part.startswith("slice 'scores' (axis 1, 4:8) at index "), sliced
    boxes = OutputRule(None, slices=(SliceRule("boxes", 1, 0, 4),))
    assert not any(e.fails for e in judge_parts([want], [moved], ["pred"], {"pred": boxes}, None))
    with pytest.raises(RuleError, match="names 'boxes', which the model does not return"):
        judge_parts([want], [moved], ["pred"], {"boxes": boxes}, None)
    with pytest.raises(RuleError, match=r"slice 'wide' \(axis 1, 4:9\) does not fit its output of shape \[2, 8, 64\]"):
        judge_parts([want], [moved], ["pred"], {"pred": OutputRule(None, slices=(SliceRule("wide", 1, 4, 9),))}, None)


class _Case:
    label = "validation sample 0 alone"


def test_a_task_check_that_raises_or_returns_anything_else_refuses_with_why() -> None:
    """The operator's check refuses on its False with its reason, on an exception with the exception, on a return
    that is not (passed, reason) with what it returned; an unimportable one says so."""
    want, moved = _packed()
    case = [_Case()]

    def failure(dotted: str) -> str | None:
        return TaskCheck(dotted, None).failure(case, [[want]], [[moved]], ["pred"])

    assert failure("tests.packed_models:same_detections") is not None
    assert str(failure("tests.packed_models:same_detections")).startswith(
        "task check tests.packed_models:same_detections failed on validation sample 0 alone: "
    )
    assert failure("tests.packed_models:raises") == (
        "task check tests.packed_models:raises raised on validation sample 0 alone: KeyError: 'boxes'"
    )
    assert str(failure("tests.packed_models:SCORE_SHIFT")).startswith("task check tests.packed_models:SCORE_SHIFT "
                                                                      "could not be imported: TypeError")  # fmt: skip
    assert TaskCheck("tests.packed_models:same_detections", None).failure(case, [[want]], [[want]], ["pred"]) is None


def test_the_config_reads_output_rules_slices_a_task_check_and_a_typical_shape(tmp_path: Path) -> None:
    """The short slice form, the long one, a task check and a typical shape read into what the worker takes; a slice
    past nothing, an unknown output and a typical size outside the inputs' ranges are refused at their paths."""
    entry = {"source": {"python": "tests.packed_models:slower_when_traced_at_large_sizes"}, "inputs": SIZED_INPUTS,
             "outputs": ["pred"], "typical_shape": {"x": [1, 3, 40, 16]},
             "tolerance": {"outputs": {"pred": {"channel_axis": 1, "slices": {"scores": [4, 8], "boxes": {
                 "axis": 1, "range": [0, 4], "max_abs_error": 2.0}}}},
                 "task_check": "tests.packed_models:same_detections"}}  # fmt: skip
    model = parse_config(json.dumps({"models": {"m": entry}}), Path.cwd()).models["m"]
    assert model.typical_shape == {"x": [1, 3, 40, 16]}
    pred = model.tolerance["outputs"]["pred"]
    assert pred["slices"] == [
        {"label": "scores", "axis": -1, "start": 4, "stop": 8, "max_rel_error": 0.02, "max_abs_error": None},
        {"label": "boxes", "axis": 1, "start": 0, "stop": 4, "max_rel_error": None, "max_abs_error": 2.0},
    ]
    assert (pred["max_channel_error"], model.tolerance["task_check"]) == (0.1, "tests.packed_models:same_detections")
    bad = {**entry, "typical_shape": {"x": [1, 3, 48, 16]},
           "tolerance": {"outputs": {"boxes": {"slices": {"s": [4, 4]}}}, "task_check": "tests.nowhere:f"}}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        parse_config(json.dumps({"models": {"m": bad}}), Path.cwd())
    paths = [p.split(": ", 1)[0] for p in info.value.problems]
    assert paths == [
        "models.m.tolerance.task_check", "models.m.tolerance.outputs.boxes",
        "models.m.tolerance.outputs.boxes.slices.s.range", "models.m.typical_shape.x",
    ], info.value.problems  # fmt: skip


def _worker(status: dict[str, Any], model: str) -> dict[str, Any]:
    (worker,) = status["models"][model]["workers"]
    return worker  # type: ignore[no-any-return]


def _serving(daemon: Daemon, models: list[str]) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        status = daemon.try_status()
        return status if status is not None and all(_worker(status, m)["state"] == "serving" for m in models) else None

    return wait_for(ready, 300, f"{models} serving")  # type: ignore[no-any-return]


def test_a_profile_moving_only_the_scores_of_a_packed_head_is_refused(start_daemon: Callable[..., Daemon]) -> None:
    """Through real workers: jit adds 0.15 to the scores of a packed head (cosine 0.9999996); the default channel error,
    a declared slice and a failing task check each refuse it naming where, and eager serves the right scores."""
    source = {"python": "tests.packed_models:scores_off_when_traced"}
    chain = {"outputs": ["pred"], "profiles": ["jit", "eager"]}
    config = {"oversubscribe": True, "models": {
        "packed": model_entry(source, PACKED_INPUTS, **chain),
        "sliced": model_entry(source, PACKED_INPUTS, **chain, tolerance=_SLICED),
        "checked": model_entry(source, PACKED_INPUTS, **chain, tolerance={
            "max_channel_error": None, "task_check": "tests.packed_models:same_detections"}),
    }}  # fmt: skip
    daemon = start_daemon(config)
    status = _serving(daemon, ["packed", "sliced", "checked"])
    reasons = {}
    for model in ("packed", "sliced", "checked"):
        worker = _worker(status, model)
        assert worker["profile"] == "eager", worker
        (reasons[model],) = worker["profile_skipped"]
    assert reasons["packed"].startswith("jit: channel error "), reasons
    assert "on output 'pred', channel " in reasons["packed"] and "along axis 1, synthetic sample" in reasons["packed"]
    assert reasons["sliced"].startswith("jit: relative error "), reasons
    assert "on output 'pred', slice 'scores' (axis 1, 4:8) at index " in reasons["sliced"], reasons
    assert reasons["checked"].startswith("jit: task check tests.packed_models:same_detections failed on "), reasons
    assert "detections above 0.5 from eager" in reasons["checked"], reasons
    image = np.random.default_rng(3).random((1, 3, 32, 32), dtype=np.float32)
    with daemon.client() as client:
        got = client.infer("packed", {"image": image})["pred"]
    with torch.inference_mode():
        want = scores_off_when_traced()(torch.from_numpy(image)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _sized_validation(folder: Path) -> Path:
    """Two images at 16x16 and two at 40x40: the largest shape group is 40x40."""
    generator = np.random.default_rng(2)
    path = folder / "sized.npz"
    np.savez(path, **{"x@small": generator.standard_normal((2, 3, 16, 16), dtype=np.float32),
                      "x@large": generator.standard_normal((2, 3, 40, 40), dtype=np.float32)})  # fmt: skip
    return path


def test_a_fastest_pick_times_at_the_served_size_and_status_names_it(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Through real workers: jit is ~6x faster than eager at 16x16 and ~5x slower at 40x40; timed at the validation
    set's largest group eager serves, timed at a typical 16x16 jit serves, and status names each timing size."""
    validation = str(_sized_validation(tmp_path))
    source = {"python": "tests.packed_models:slower_when_traced_at_large_sizes"}
    chain = {"profiles": ["eager", "jit"], "pick": "fastest", "validation": validation}
    config = {"oversubscribe": True, "models": {
        "largest": model_entry(source, SIZED_INPUTS, **chain),
        "typical": model_entry(source, SIZED_INPUTS, **chain, typical_shape={"x": [1, 3, 16, 16]}),
    }}  # fmt: skip
    daemon = start_daemon(config)
    status = _serving(daemon, ["largest", "typical"])
    largest, typical = _worker(status, "largest"), _worker(status, "typical")
    # The timing's own words (each candidate's medians, the head-to-head ratio and its spread) when a pick differs.
    assert largest["timed_at"] == "3x40x40 (the validation set's largest shape group)", largest["profile_build"]
    assert largest["profile"] == "eager", largest["profile_build"]
    assert typical["timed_at"] == "3x16x16 (typical_shape)", typical["profile_build"]
    assert typical["profile"] == "jit", typical["profile_build"]
