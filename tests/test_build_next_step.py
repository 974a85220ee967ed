"""Profile refusals say what to change: which output differs and how, and a next step for a failed build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infervisor.common.cpuinfo import read_caps
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.next_step import OPEN_LENGTH_STEP, with_next_step
from infervisor.worker.profiles.select import select_profile
from infervisor.worker.profiles.validate import Tolerance, compare, worst_of
from infervisor.worker.runner import ModelRunner
from infervisor.worker.start import build_context
from tests.audio_models import keyword_cnn
from tests.step_models import odd_crop


def test_an_openvino_program_answering_another_shape_is_refused_naming_the_output(tmp_path: Path) -> None:
    """OpenVINO's trace bakes the even-height branch in: the refusal names the output, both shapes, the size it
    happened at and what to change (the bare `outputs are not finite or change shape` said none of it)."""
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    spec = TensorSpec("x", "float32", (None, 3, None, 16), bounds=(None, None, (12, 40), None))
    runner = ModelRunner(odd_crop(), (spec,), None)
    launch = LaunchSpec("t", "m", -1, ModelSource("python", "tests.step_models:odd_crop"), runner.specs, None, (0,), 1,
                        profiles=("openvino", "eager"), cache_dir=str(tmp_path))  # fmt: skip
    selection = select_profile(runner, launch.profiles, Tolerance(0.999), read_caps(), build_context(launch, runner))
    assert selection.profile == "eager"
    (reason,) = selection.skipped
    assert "openvino: output 'output' has shape [1, 2, 13, 16] where eager's is [1, 2, 12, 16] on synthetic input " \
           "1x3x13x16" in reason, reason  # fmt: skip
    assert "sizes in steps [min, max, step], or take the profile out of `profiles`" in reason, reason


def test_a_non_finite_output_is_named_with_its_count() -> None:
    """Of several outputs, the one holding NaN/Inf is named, with how many values and eager's count."""
    want = [np.ones((2, 4), np.float32), np.ones((2, 3), np.float32)]
    got = [np.ones((2, 4), np.float32), np.array([[1, np.nan, 1], [1, 1, np.inf]], np.float32)]
    agreement = compare(want, got, ["boxes", "scores"])
    failure = worst_of([(agreement, lambda row: f"a batch of 2 (row {row})")], "2 samples").failure(Tolerance())
    assert failure is not None and failure.startswith(
        "output 'scores' is not finite: 2 of 6 values NaN or infinite (eager's: 0) on a batch of 2"
    ), failure


def test_a_failed_build_says_the_next_step() -> None:
    """inductor's int8 fusion assertion is said in the model's terms; any other failure names the profile to drop;
    export's own advice is not doubled."""
    fusion = "AssertionError: QConv Binary Inplace Fusion requires accum is not an alias or mutation."
    assert "add to a copy in the model" in with_next_step("int8_static", fusion)
    none = "AssertionError: expected (<class 'numpy.integer'>, <class 'numpy.floating'>, <class 'int'>, <class " \
           "'float'>), got <class 'NoneType'>"  # fmt: skip
    assert "torch.sym_max/sym_min got None" in with_next_step("aoti", none)
    assert with_next_step("aoti", "TypeError: x").endswith("(next step: take aoti out of `profiles` so the daemon "
                                                             "stops building it on every start)")  # fmt: skip
    covered = "covers [64, 67] (declare the range [64, 67] for that dim, or take this profile out of the chain)"
    assert with_next_step("aoti", covered) == covered


def test_an_open_length_export_refusal_says_what_to_do(tmp_path: Path) -> None:
    """A 1-D CNN over audio of 1,000-32,000 samples: int8_dynamic's export breaks on a MaxPool's guard, and the
    refusal leads with what to do (serve a profile that needs no export, or a fixed size), never "no declared range
    is the cause"."""
    spec = TensorSpec("audio", "float32", (None, 1, None), bounds=(None, None, (1000, 32000)))
    runner = ModelRunner(keyword_cnn(), (spec,), None)
    launch = LaunchSpec("t", "m", -1, ModelSource("python", "tests.audio_models:keyword_cnn"), runner.specs, None,
                        (0,), 1, profiles=("int8_dynamic", "eager"), cache_dir=str(tmp_path))  # fmt: skip
    selection = select_profile(runner, launch.profiles, Tolerance(0.99), read_caps(), build_context(launch, runner))
    assert selection.profile == "eager"
    (reason,) = selection.skipped
    assert f"int8_dynamic failed to build: {OPEN_LENGTH_STEP}; torch.export: " in reason, reason
    assert "no declared range is the cause" not in reason, reason
