"""Compiled profiles cover every shape the config admits: the gate checks sizes across each declared range, a
reply never carries a shape eager would not give, and the daemon's own shape refusals never reach a client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.protocol.client import InferenceError
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.open_dims import open_dim_hint
from infervisor.worker.profiles.coverage import Covered, Reloaded
from infervisor.worker.profiles.dispatch import ShapeNotServed
from infervisor.worker.profiles.golden import golden_set
from infervisor.worker.profiles.select import remembered_pick
from infervisor.worker.runner import ModelRunner
from tests.conftest import Daemon, model_entry
from tests.shape_models import fully_convolutional, line_recognizer

CONV_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 3, [12, None], [12, None]]}]
LINE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 1, 64, [64, 1024]]}]


def _eager(factory: Callable[[], torch.nn.Module], x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return factory()(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


def _answers_as_eager(
    daemon: Daemon, model: str, factory: Callable[[], torch.nn.Module], shapes: list[tuple[int, ...]]
) -> None:
    rng = np.random.default_rng(5)
    with daemon.client() as client:
        for shape in shapes:
            x = rng.standard_normal(shape).astype(np.float32)
            want = _eager(factory, x)
            try:
                got = client.infer(model, {"x": x})["output"]
            except InferenceError as exc:
                raise AssertionError(f"{shape}: {exc}") from exc
            assert got.shape == want.shape, (shape, got.shape, want.shape)
            cosine = float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))
            assert cosine > 0.99, (shape, cosine)


def test_a_fully_convolutional_model_answers_every_declared_size_as_eager(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """aoti and int8_static serve H, W in [12, null] exactly as eager (odd sizes, batch 2 at 97x131) or not at all."""
    config = {
        "oversubscribe": True,
        "cache_dir": str(tmp_path / "cache"),
        "models": {
            "fcn": model_entry(
                {"python": "tests.shape_models:fully_convolutional"}, CONV_INPUTS,
                profiles=["aoti", "int8_static", "eager"], tolerance={"min_cosine": 0.99},
            ),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(timeout=600)
    (worker,) = status["models"]["fcn"]["workers"]
    sizes = [(1, 3, 60, 80), (1, 3, 97, 131), (2, 3, 97, 131), (1, 3, 12, 12), (3, 3, 13, 17), (1, 3, 240, 320)]
    _answers_as_eager(daemon, "fcn", fully_convolutional, sizes)
    for reason in worker["profile_skipped"]:
        assert "crashed on golden inputs" not in reason, reason


def test_a_line_recognizer_never_answers_a_batch_of_one_with_internal(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Conv + BiLSTM over a width in [64, 1024] under aoti: batch-1 requests at any width answer as eager."""
    config = {
        "oversubscribe": True,
        "cache_dir": str(tmp_path / "cache"),
        "models": {
            "ocr": model_entry(
                {"python": "tests.shape_models:line_recognizer"}, LINE_INPUTS, profiles=["aoti", "eager"],
            ),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    daemon.wait_ready(timeout=600)
    widths = [(1, 1, 64, w) for w in (64, 65, 97, 128, 300, 1024)]
    _answers_as_eager(daemon, "ocr", line_recognizer, [*widths, (2, 1, 64, 97)])


def test_the_gate_draws_each_dynamic_dim_across_its_declared_range() -> None:
    """Golden inputs hold the range minimum, odd sizes and the maximum of a bounded dim, at batch 1 and batched."""
    spec = TensorSpec("x", "float32", (None, 1, 64, None), bounds=(None, None, None, (64, 1024)))
    runner = ModelRunner(line_recognizer(), [spec], None)
    shapes = {tuple(case.inputs["x"].shape) for case in golden_set(runner, None).cases}
    widths = {shape[3] for shape in shapes}
    assert {64, 1024} <= widths and any(w % 2 for w in widths), shapes
    assert any(shape[0] == 1 and shape[3] != 64 for shape in shapes), shapes
    assert any(shape[0] > 1 and shape[3] % 2 for shape in shapes), shapes


class _Cropping(torch.nn.Module):
    """Eager's output cut by one row and column at odd sizes: what a package specialised on parity answers."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if x.shape[2] % 2:
            return out[:, :, :-1, :-1]
        if x.shape[3] == 14:
            raise ShapeNotServed("this compiled profile does not serve a width of 14")
        return out


def test_a_reply_never_carries_a_shape_eager_would_not_give() -> None:
    """A profile's output shape is checked against eager once per input shape; a difference or a refusal of the
    daemon's own is served by the next profile, and a profile that keeps failing falls back for good."""
    eager = fully_convolutional()
    covered = Covered(_Cropping(eager), eager, "aoti", give_up_after=3)
    with torch.inference_mode():
        for shape in [(1, 3, 12, 12), (2, 3, 97, 131), (2, 3, 97, 131), (1, 3, 12, 14)]:
            x = torch.randn(shape)
            assert covered(x).shape == eager(x).shape, shape
        assert not covered.gave_up
        covered(torch.randn(1, 3, 13, 13))
    assert covered.gave_up and "aoti" in covered.reason and "3 input shapes" in covered.reason


def test_a_batch_only_model_reloads_eager_only_when_the_profile_refuses_a_shape() -> None:
    """With only the batch open, shapes are not checked against eager and no eager module is held; a refusal of the
    daemon's own (an output without the batch) is answered by eager, loaded then and kept."""
    loads: list[int] = []

    def load() -> torch.nn.Module:
        loads.append(1)
        return torch.nn.Linear(4, 2)

    def package(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8:
            raise ShapeNotServed("an output of shape [] does not carry the batch (8) in its first dim")
        return torch.zeros(x.shape[0], 2)

    covered = Covered(package, Reloaded(load), "aoti", check_shapes=False)
    with torch.inference_mode():
        assert covered(torch.ones(3, 4)).shape == (3, 2) and loads == []
        assert covered(torch.ones(8, 4)).shape == (8, 2) and loads == [1]
        covered(torch.ones(8, 4))
    assert loads == [1] and covered.verdicts == {((8, 4),): False}


def test_an_open_dim_warmed_at_one_says_what_minimum_to_declare() -> None:
    """A conv model declared [null, 3, null, null] fails warm-up at 1x1; the hint names a minimum it runs at."""
    spec = TensorSpec("x", "float32", (None, 3, None, None))
    hint = open_dim_hint(ModelRunner(fully_convolutional(), [spec], None))
    assert hint is not None and "[null, 3, [" in hint and "declare" in hint, hint


def test_a_fastest_pick_is_keyed_on_the_declared_input_spec(tmp_path: Path) -> None:
    """The same model, chain and machine with another declared range is decided again, not reused."""
    from infervisor.worker.profiles.builders import BuildContext
    from infervisor.worker.profiles.cache import ArtifactCache
    from infervisor.worker.profiles.validate import Tolerance

    def path(bounds: Any) -> Path | None:
        spec = TensorSpec("x", "float32", (None, 1, 64, None), bounds=bounds)
        context = BuildContext(None, (), (spec,), "digest", cache=ArtifactCache(tmp_path))
        return remembered_pick(context, ["aoti", "eager"], Tolerance())

    assert path((None, None, None, (64, 1024))) != path((None, None, None, (64, 512)))


@pytest.mark.parametrize("batch", [None, 1])
def test_package_keys_differ_by_declared_spec(batch: int | None) -> None:
    """Build records and packages of `[null, 1, 64, [64, 1024]]` are never those of `[1, 1, 64, [64, 1024]]`."""
    from infervisor.worker.profiles.build import package_options

    wide = TensorSpec("x", "float32", (None, 1, 64, None), bounds=(None, None, None, (64, 1024)))
    one = TensorSpec("x", "float32", (batch, 1, 64, None), bounds=(None, None, None, (64, 1024)))
    narrow = TensorSpec("x", "float32", (None, 1, 64, None), bounds=(None, None, None, (64, 512)))
    assert package_options((wide,)) != package_options((narrow,))
    if batch is not None:
        assert package_options((wide,)) != package_options((one,))
