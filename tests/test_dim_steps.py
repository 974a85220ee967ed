"""Dims in steps (`[min, max, step]`): parsed, admitted, drawn and exported only on their steps, with real workers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.protocol import ErrorCode, InferenceError
from infervisor.protocol.tensors import TensorDesc, TensorSpec
from infervisor.supervisor.settings.config import ConfigError, parse_config
from infervisor.worker.profiles.dispatch import ShapeDispatch, ShapeNotServed
from infervisor.worker.profiles.export import export
from infervisor.worker.profiles.export_dims import dynamic_shapes, export_low, traceable_example
from infervisor.worker.profiles.golden import golden_set
from infervisor.worker.runner import FailedAtSize, ModelRunner
from infervisor.worker.synthetic import probe_sizes
from tests.conftest import Daemon, model_entry, wait_for
from tests.step_models import blocks32

SOURCE = {"python": "tests.step_models:blocks32"}
STEPPED = [{"name": "image", "dtype": "float32", "shape": [None, 3, [64, 160, 32], [64, 160, 32]]}]
SPEC = TensorSpec("image", "float32", (None, 3, None, None), bounds=(None, None, (64, 160), (64, 160)),
                  steps=(1, 1, 32, 32))  # fmt: skip


def _shape(dim: Any) -> list[Any]:
    """config.json text with one image input whose dim 2 is `dim`."""
    inputs = [{"name": "image", "dtype": "float32", "shape": [None, 3, dim, 64]}]
    return [json.dumps({"models": {"m": {"source": {"builtin": "resnet50"}, "inputs": inputs}}})]


def _problems(dim: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(_shape(dim)[0], Path("/nonexistent"))
    return str(info.value)


def test_a_dim_in_steps_parses_and_keeps_old_shapes_as_they_were() -> None:
    """`[64, 640, 32]` and `[64, null, 32]` carry their step; `[64, 640]`, `[64, 640, 1]` and `[64, 64, 32]` none."""

    def spec(dim: Any) -> TensorSpec:
        return parse_config(_shape(dim)[0], Path("/nonexistent")).models["m"].inputs[0]

    assert spec([64, 640, 32]).dim_step(2) == 32 and spec([64, 640, 32]).config_shape()[2] == [64, 640, 32]
    assert spec([64, None, 32]).dim_range(2) == (64, None) and spec([64, None, 32]).dim_step(2) == 32
    assert spec([64, 640]) == spec([64, 640, 1]) and spec([64, 640]).steps == ()
    assert spec([64, 64, 32]).shape[2] == 64
    assert TensorSpec.from_dict({"name": "x", "dtype": "float32", "shape": [None, 4]}).steps == ()


@pytest.mark.parametrize(
    ("dim", "words"),
    [
        ([64, 650, 32], "max 650 is not 64 + a multiple of 32: declare 640 or 672"),
        ([64, 640, 0], "step must be an integer >= 1"),
        ([64, 640, 32.0], "step must be an integer >= 1"),
        ([64, 640, 32, 1], "[min, max, step]"),
        ([640, 64, 32], "[min, max, step]"),
    ],
)
def test_a_bad_step_is_refused_naming_the_rule(dim: Any, words: str) -> None:
    """A step off the range, zero, a float, a fourth number or min > max is refused at its JSON path."""
    problems = _problems(dim)
    assert "models.m.inputs[0].shape[2]" in problems and words in problems, problems


def test_a_step_on_the_batch_is_refused() -> None:
    """Dim 0 is the batch, which the broker forms from any number of requests: it takes no step."""
    text = json.dumps(
        {
            "models": {
                "m": {
                    "source": {"builtin": "resnet50"},
                    "inputs": [{"name": "x", "dtype": "float32", "shape": [[2, 8, 2], 16]}],
                }
            }
        }
    )
    with pytest.raises(ConfigError, match=r"shape\[0\]: dim 0 is the batch"):
        parse_config(text, Path("/nonexistent"))


def test_an_off_step_size_is_refused_by_the_rule() -> None:
    """mismatch names the dim, the input and the rule; sizes on the steps pass, out of range is still refused."""
    assert SPEC.mismatch(TensorDesc("image", "float32", (2, 3, 96, 160))) is None
    problem = SPEC.mismatch(TensorDesc("image", "float32", (1, 3, 100, 64)))
    assert problem is not None and problem.startswith(
        "dim 2 of input `image` must be 64 + a multiple of 32 up to 160, got 100"
    ), problem
    assert "outside its bound" in str(SPEC.mismatch(TensorDesc("image", "float32", (1, 3, 192, 64))))


def test_the_daemon_draws_only_sizes_on_the_steps() -> None:
    """Warm-up, canaries and the gate's synthetic inputs (batch 1 and batched) are all on the steps; a model that
    refuses other sizes warms up."""
    assert probe_sizes(64, 640, 32) == [64, 96, 352, 640] and probe_sizes(64, None, 32)[0] == 64
    assert all((size - 64) % 32 == 0 for size in probe_sizes(64, None, 32))
    runner = ModelRunner(blocks32(), [SPEC], None)
    runner.warm_up(1)
    drawn = [tuple(inputs["image"].shape) for inputs, _ in runner.golden]
    drawn += [tuple(case.inputs["image"].shape) for case in golden_set(runner, None).cases]
    assert all(h % 32 == 0 and w % 32 == 0 for _, _, h, w in drawn), drawn
    assert {h for _, _, h, _ in drawn} >= {64, 160} and any(n > 1 for n, *_ in drawn), drawn


def test_a_model_failing_at_a_drawn_size_names_the_input_and_the_size() -> None:
    """Declared without its step, the 32-block model fails at a drawn odd size: the error names both."""
    spec = TensorSpec("image", "float32", (None, 3, None, 64), bounds=(None, None, (64, 160), None))
    with pytest.raises(FailedAtSize) as info:
        ModelRunner(blocks32(), [spec], None).warm_up(1)
    text = str(info.value)
    assert "warm-up across the declared ranges at `image` [1, 3, 65, 64]" in text, text
    assert "sizes in steps [min, max, step]" in text and "RuntimeError" in text, text


def test_export_takes_a_dim_in_steps_as_a_multiple_of_a_dim() -> None:
    """torch.export gets `32 * Dim` from 2 steps, and the program covers the declared sizes on the steps."""
    spec = TensorSpec("image", "float32", (None, 3, None, None), bounds=(None, None, (32, 160), (64, 160)),
                      steps=(1, 1, 32, 32))  # fmt: skip
    (shapes,) = dynamic_shapes([spec])
    assert "32*" in str(shapes[2]) and "32*" in str(shapes[3]), shapes
    example = (torch.randn(1, 3, 32, 64),)
    assert traceable_example(example, [spec])[0].shape == (2, 3, 64, 64)
    program = export(blocks32(), example, [spec])
    ranges = [(int(v.lower), int(v.upper)) for k, v in program.range_constraints.items() if str(k).startswith("32*")]
    assert sorted(ranges) == [(64, 160), (64, 160)], program.range_constraints


def _eager(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return blocks32()(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


def test_a_dim_in_steps_serves_every_size_on_them_and_refuses_others(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """aoti over [64, 160, 32] x [64, 160, 32] serves every size on the steps at batch 1 and 2 as eager does, never
    drew an off-step size while loading (the model would have failed), and an off-step request is INVALID_INPUT."""
    config = {
        "oversubscribe": True,
        "models": {"steps": model_entry(SOURCE, STEPPED, profiles=["aoti", "eager"], tolerance={"min_cosine": 0.999})},
    }
    daemon = start_daemon(config)
    status = daemon.wait_ready(timeout=600)
    (worker,) = status["models"]["steps"]["workers"]
    assert worker["profile"] == "aoti", worker
    assert status["models"]["steps"]["inputs"][0]["shape"] == [None, 3, [64, 160, 32], [64, 160, 32]]
    rng = np.random.default_rng(3)
    sizes = range(64, 161, 32)
    with daemon.client() as client:
        for batch in (1, 2):
            for height in sizes:
                for width in sizes:
                    x = rng.standard_normal((batch, 3, height, width)).astype(np.float32)
                    got = client.infer("steps", {"image": x})["output"]
                    np.testing.assert_allclose(got, _eager(x), rtol=1e-3, atol=1e-4)
        with pytest.raises(InferenceError) as info:
            client.infer("steps", {"image": np.zeros((1, 3, 100, 64), np.float32)})
    assert info.value.code == ErrorCode.INVALID_INPUT
    assert "dim 2 of input `image` must be 64 + a multiple of 32 up to 160, got 100" in str(info.value)
    wait_for(lambda: daemon.status()["models"]["steps"]["workers"][0]["state"] == "serving", 30, "still serving")


def test_a_single_step_size_is_not_handed_to_the_program_exported_from_two_steps() -> None:
    """A package exported from 2 steps (64) is never run at 32: that size is served by the static package at the
    example's shape, else refused as the daemon's own (eager answers it), since a package checks no guard."""
    spec = TensorSpec("image", "float32", (None, 3, None, 64), bounds=(None, None, (32, 160), None),
                      steps=(1, 1, 32, 1))  # fmt: skip
    assert export_low(spec, 2) == 64

    def program(x: torch.Tensor) -> torch.Tensor:
        assert x.shape[2] >= 64, x.shape
        return x

    dispatch = ShapeDispatch(lambda x: x + 1, [(1, 3, 32, 64)], program, [spec])
    assert float(dispatch(torch.zeros(1, 3, 32, 64)).max()) == 1.0
    assert dispatch(torch.zeros(2, 3, 96, 64)).shape == (2, 3, 96, 64)
    with pytest.raises(ShapeNotServed):
        dispatch(torch.zeros(2, 3, 32, 64))
