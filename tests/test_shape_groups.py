"""Calibration and validation sets with shape groups (`x@small`, `x@large`): real data at several sizes of a model's
open dims, checked against the spec per group, batched only within a group, and calibrated on as they are."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from infervisor.common.cpuinfo import read_caps
from infervisor.common.profiles import cpu_refusal
from infervisor.protocol.tensors import TensorSpec
from infervisor.supervisor.settings.config import ConfigError, parse_config
from infervisor.worker.profiles.builders import BuildContext
from infervisor.worker.profiles.cache import ArtifactCache
from infervisor.worker.profiles.calibration import MAX_SAMPLES, load_calibration
from infervisor.worker.profiles.golden import golden_set
from infervisor.worker.profiles.select import select_profile
from infervisor.worker.profiles.validate import Tolerance
from infervisor.worker.runner import ModelRunner
from tests.conftest import Daemon, model_entry
from tests.shape_models import convolutional_without_pooling, fully_convolutional
from tests.test_shape_coverage import _answers_as_eager

IMAGE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 3, [16, 96], [16, 96]]}]
IMAGE_SPEC = TensorSpec("x", "float32", (None, 3, None, None), bounds=(None, None, (16, 96), (16, 96)))


def _images(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 3, height, width)).astype(np.float32)


def _two_sizes(path: Path) -> Path:
    """A set of two groups: four samples at 24x24 and three at 64x48."""
    np.savez(path, **{"x@small": _images(4, 24, 24, 1), "x@large": _images(3, 64, 48, 2)})
    return path


def _validation_problems(tmp_path: Path, file: str) -> list[str]:
    config = {"models": {"m": model_entry({"builtin": "tiny"}, IMAGE_INPUTS, validation=file)}}
    with pytest.raises(ConfigError) as caught:
        parse_config(json.dumps(config), tmp_path)
    return [p for p in caught.value.problems if p.startswith("models.m.validation")]


def test_the_config_check_names_the_group_a_set_is_wrong_in(tmp_path: Path) -> None:
    """A group lacking an input, and a group whose size is outside the declared range, are refused by group name."""
    np.savez(tmp_path / "fine.npz", **{"x@small": _images(2, 24, 24, 1), "x@large": _images(2, 64, 48, 2)})
    config = {"models": {"m": model_entry({"builtin": "tiny"}, IMAGE_INPUTS, validation="fine.npz")}}
    assert parse_config(json.dumps(config), tmp_path).models["m"].validation == str(tmp_path / "fine.npz")

    two = [{"name": "x", **IMAGE_INPUTS[0]}, {"name": "scale", "dtype": "float32", "shape": [None, 1]}]
    np.savez(tmp_path / "lacking.npz", x=_images(2, 24, 24, 1), scale=np.ones((2, 1), np.float32),
             **{"x@large": _images(2, 64, 48, 2)})  # fmt: skip
    config = {"models": {"m": model_entry({"builtin": "tiny"}, two, validation="lacking.npz")}}
    with pytest.raises(ConfigError) as caught:
        parse_config(json.dumps(config), tmp_path)
    (problem,) = [p for p in caught.value.problems if p.startswith("models.m.validation")]
    assert "group 'large' has no array for input 'scale'" in problem, problem

    np.savez(tmp_path / "wide.npz", **{"x@small": _images(2, 24, 24, 1), "x@huge": _images(2, 64, 128, 2)})
    (problem,) = _validation_problems(tmp_path, "wide.npz")
    assert "group 'huge': array 'x@huge' is float32[2, 3, 64, 128]" in problem, problem


def test_golden_batches_join_only_samples_of_one_shape(tmp_path: Path) -> None:
    """Each sample is checked alone and batched only with samples of its own group; labels say the shape."""
    validation = load_calibration(_two_sizes(tmp_path / "v.npz"), [IMAGE_SPEC])
    assert [tuple(v[0].shape[2:]) for v in validation[:4]] == [(24, 24), (64, 48), (24, 24), (64, 48)]
    golden = golden_set(ModelRunner(fully_convolutional(), [IMAGE_SPEC], None), validation, served=(8,))
    samples = [c for c in golden.cases if c.kind == "validation sample"]
    alone = [c for c in samples if len(c.rows) == 1]
    batched = [c for c in samples if len(c.rows) > 1]
    assert len(alone) == 7 and {c.label.split(" at ")[1] for c in alone} == {"3x24x24", "3x64x48"}, alone
    for case in batched:
        shapes = {tuple(validation[r][0].shape) for r in case.rows}
        assert len(shapes) == 1 and tuple(case.inputs["x"].shape[1:]) == next(iter(shapes))[1:], case.label
        assert case.label.endswith("at 3x24x24" if case.inputs["x"].shape[2] == 24 else "at 3x64x48"), case.label
    assert {(c.inputs["x"].shape[0], c.inputs["x"].shape[2]) for c in batched} >= {(4, 24), (8, 24), (3, 64), (8, 64)}
    assert "7 validation samples in 2 shape groups (3x24x24, 3x64x48)" in golden.checked, golden.checked


def test_at_most_max_samples_are_read_from_every_group_in_turn(tmp_path: Path) -> None:
    """Two large groups give MAX_SAMPLES samples in all, half of each; a plain key is a group as before."""
    np.savez(tmp_path / "big.npz", x=_images(100, 16, 16, 1), **{"x@wide": _images(100, 16, 32, 2)})
    samples = load_calibration(tmp_path / "big.npz", [IMAGE_SPEC])
    widths = [s[0].shape[3] for s in samples]
    assert len(samples) == MAX_SAMPLES and widths.count(16) == widths.count(32) == MAX_SAMPLES // 2
    assert torch.equal(samples[0][0], torch.from_numpy(_images(100, 16, 16, 1)[:1]))


def test_a_daemon_gates_and_calibrates_on_two_shape_groups(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """int8_static calibrated and gated on real samples at 24x24 and 64x48 serves, says both, and answers as eager."""
    data = _two_sizes(tmp_path / "sizes.npz")
    config = {
        "oversubscribe": True,
        "cache_dir": str(tmp_path / "cache"),
        "models": {
            "fcn": model_entry(
                {"python": "tests.shape_models:convolutional_without_pooling"}, IMAGE_INPUTS,
                profiles=["int8_static", "eager"], calibration=str(data), validation=str(data),
                tolerance={"min_cosine": 0.98},
            ),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(timeout=600)
    (worker,) = status["models"]["fcn"]["workers"]
    assert worker["profile"] == "int8_static", worker["profile_skipped"]
    assert worker["checked_on"] == "validation set", worker
    built = " ".join(worker["profile_build"])
    assert "7 validation samples in 2 shape groups (3x24x24, 3x64x48)" in built, built
    _answers_as_eager(
        daemon, "fcn", convolutional_without_pooling, [(1, 3, 24, 24), (3, 3, 24, 24), (1, 3, 64, 48), (2, 3, 64, 48)]
    )


@pytest.mark.daemon  # a long build: NNCF int8 quantization in process (not the fast tier)
def test_openvino_int8_calibrates_and_is_gated_on_two_shape_groups(tmp_path: Path) -> None:
    """NNCF observes each sample of both groups at its own size; the IR serves both sizes as eager does."""
    pytest.importorskip("nncf", reason="the openvino extra is not installed")
    data = _two_sizes(tmp_path / "sizes.npz")
    module = convolutional_without_pooling()
    runner = ModelRunner(module, [IMAGE_SPEC], None)
    example = tuple(runner.example_inputs(batch=1).values())
    context = BuildContext(module, example, (IMAGE_SPEC,), "digest", cache=ArtifactCache(tmp_path), calibration=data)
    validation = load_calibration(data, [IMAGE_SPEC])
    refusal = cpu_refusal("openvino_int8", read_caps())
    if refusal is not None:
        pytest.skip(refusal)
    selection = select_profile(runner, ["openvino_int8"], Tolerance(0.98), read_caps(), context, validation=validation)
    assert selection.profile == "openvino_int8", selection.skipped
    assert any("2 shape groups (3x24x24, 3x64x48)" in note for note in selection.notes), selection.notes
