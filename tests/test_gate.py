"""The accuracy gate: every sample alone and batched, the worst row against the tolerance, figures that cannot
read as passing when they fail, synthetic data as declared (and warned about), and bounded dims."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.common.accuracy import cosine_text
from infervisor.common.cpuinfo import read_caps
from infervisor.common.profiles import cpu_refusal
from infervisor.protocol.client import InferenceError
from infervisor.protocol.constants import ErrorCode
from infervisor.protocol.errors import ProtocolError
from infervisor.protocol.launch import LaunchSpec, ModelSource
from infervisor.protocol.tensors import Synthetic, TensorDesc, TensorSpec, check_against_spec
from infervisor.supervisor.commands.optimize import synthetic_warnings
from infervisor.supervisor.commands.status import format_status
from infervisor.supervisor.settings.config import ConfigError, parse_config
from infervisor.supervisor.toolkit.constraints import Accuracy
from infervisor.supervisor.toolkit.doctor import Status, check_accuracy_data
from infervisor.supervisor.toolkit.optimize import within_budget
from infervisor.worker.loader import ModelLoadError, load_model
from infervisor.worker.profiles.builders import BuildContext
from infervisor.worker.profiles.calibration import load_calibration, random_calibration
from infervisor.worker.profiles.golden import golden_set
from infervisor.worker.profiles.select import select_profile
from infervisor.worker.profiles.validate import Tolerance, compare
from infervisor.worker.runner import ModelRunner
from tests.conftest import Daemon, model_entry
from tests.gate_models import batch_dependent, validation_samples

GATE_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 4]}]
GATE_SPECS = (TensorSpec("x", "float32", (None, 4)),)


def _needs_bf16() -> None:
    refusal = cpu_refusal("bf16", read_caps())
    if refusal is not None:
        pytest.skip(f"bf16 does not run here: {refusal}")


def _validation(tmp_path: Path, name: str, adversarial_at: int | None) -> Path:
    path = tmp_path / f"{name}.npz"
    np.savez(path, x=validation_samples(adversarial_at))
    return path


# ---------------------------------------------------------------------------------------------------------------
# figures


@pytest.mark.parametrize("cosine", [0.99989999999, 0.9998996, 0.999899999999999, 0.99985, 0.9])
def test_a_failing_cosine_never_prints_as_the_tolerance(cosine: float) -> None:
    """Below 0.9999 prints below 0.9999 (the old `.5f` printed 0.99990 for 0.9998996), with 6 digits after the 9s."""
    shown = cosine_text(cosine, 0.9999)
    assert float(shown) < 0.9999, shown
    assert len(shown.split(".")[1]) >= 7
    assert cosine_text(0.999888012345) == "0.999888012"  # three leading nines, then six digits
    assert float(cosine_text(0.99990000001, 0.9999)) >= 0.9999
    budget = Accuracy(0.9999, None, False)
    reason = within_budget({"p50_ms": 1.0, "cosine": cosine, "max_abs_error": 0.0}, budget)
    assert reason is not None and float(reason.split()[2]) < 0.9999, reason


# ---------------------------------------------------------------------------------------------------------------
# what the gate checks


def test_every_validation_sample_is_checked_alone_and_all_of_them_batched(tmp_path: Path) -> None:
    """Five samples: five batch-1 cases and one batch of five; a bounded batch adds a batch at its bound."""
    validation = load_calibration(_validation(tmp_path, "v", None), GATE_SPECS)
    model = batch_dependent()
    golden = golden_set(ModelRunner(model, GATE_SPECS, None), validation)
    assert [c.label for c in golden.cases] == [*(f"validation sample {i} alone" for i in range(4)), "a batch of 4"]
    assert golden.cases[-1].inputs["x"].shape == (4, 4) and golden.checked.endswith("each alone and batched at 4")
    bounded = (TensorSpec("x", "float32", (None, 4), bounds=((1, 64), None)),)
    golden = golden_set(ModelRunner(model, bounded, None), validation)
    assert [tuple(c.inputs["x"].shape) for c in golden.cases][-2:] == [(4, 4), (64, 4)]
    assert golden.cases[-1].rows[:9] == (0, 1, 2, 3, 0, 1, 2, 3, 0) and "batched at 4, 64" in golden.checked
    fixed = (TensorSpec("x", "float32", (1, 4)),)
    assert [c.label for c in golden_set(ModelRunner(model, fixed, None), validation).cases][-1] == (
        "validation sample 3 alone"
    )
    synthetic = golden_set(ModelRunner(model, GATE_SPECS, None), None)
    assert [tuple(c.inputs["x"].shape) for c in synthetic.cases] == [(1, 4)] * 3 + [(3, 4)]


def test_a_profile_that_passes_batched_but_fails_one_sample_alone_is_refused(tmp_path: Path) -> None:
    """bf16 agrees batched and on the first sample, but not on sample 2 alone: refused, and the reason says where."""
    _needs_bf16()
    validation = load_calibration(_validation(tmp_path, "v", 2), GATE_SPECS)
    runner = ModelRunner(batch_dependent(), GATE_SPECS, None)
    context = BuildContext(runner.module, (validation[0][0],), GATE_SPECS, "digest")
    # What the gate used to check, the first sample alone and all of them as one batch, passes.
    from infervisor.worker.profiles.build import _autocast_bf16

    bf16 = _autocast_bf16(runner.module)
    with torch.inference_mode():
        for x in (validation[0][0], torch.cat([v[0] for v in validation])):
            assert compare([runner.module(x).numpy()], [bf16(x).float().numpy()]).cosine > 0.99999
    selection = select_profile(runner, ["bf16", "eager"], Tolerance(0.999), read_caps(), context, validation=validation)
    assert selection.profile == "eager"
    (reason,) = selection.skipped
    assert reason.startswith("bf16: worst-row cosine 0.7070") and "< 0.999 on validation sample 2 alone" in reason
    assert "over 4 validation samples, each alone and batched at 4" in reason


def test_the_gate_through_the_daemon_refuses_serves_and_warns(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """The adversarial sample refuses bf16; without it bf16 serves and its note names the worst row; judged on
    synthetic data only, bf16 serves with a warning in status (JSON and plain)."""
    _needs_bf16()
    source = {"python": "tests.gate_models:batch_dependent"}
    chain = {"profiles": ["bf16", "eager"], "tolerance": {"min_cosine": 0.999}}
    config = {
        "oversubscribe": True,
        "models": {
            "refused": model_entry(source, GATE_INPUTS, validation=str(_validation(tmp_path, "bad", 2)), **chain),
            "served": model_entry(source, GATE_INPUTS, validation=str(_validation(tmp_path, "good", None)), **chain),
            "synthetic": model_entry(source, GATE_INPUTS, **chain),
        },
    }
    daemon = start_daemon(config)
    status = daemon.wait_ready(timeout=180)
    (refused,) = status["models"]["refused"]["workers"]
    (served,) = status["models"]["served"]["workers"]
    (synthetic,) = status["models"]["synthetic"]["workers"]
    assert refused["profile"] == "eager" and "on validation sample 2 alone" in refused["profile_skipped"][0], refused
    assert served["profile"] == "bf16" and served["checked_on"] == "validation set", served
    (note,) = [n for n in served["profile_build"] if n.startswith("built and checked")]
    assert "worst-row cosine 0.99999" in note and "(validation sample 0 alone)" in note, note
    assert served["accuracy_warning"] is None and refused["accuracy_warning"] is None
    assert synthetic["profile"] == "bf16" and synthetic["checked_on"] == "synthetic inputs"
    assert "bf16 changes numerics and was judged on synthetic inputs only" in synthetic["accuracy_warning"]
    plain = format_status(status)
    assert plain.count("WARNING: bf16 changes numerics") == 1, plain
    with daemon.client() as client:
        got = client.infer("refused", {"x": validation_samples(2)[2:3]})["output"]
    np.testing.assert_allclose(got, [[0.001, 0.001]], rtol=1e-3)  # eager serves the right answer


# ---------------------------------------------------------------------------------------------------------------
# synthetic data


def _parse_inputs(inputs: list[dict[str, Any]]) -> tuple[TensorSpec, ...]:
    entry = {"source": {"builtin": "tiny"}, "inputs": inputs}
    return parse_config(json.dumps({"models": {"m": entry}}), Path(".")).models["m"].inputs


def test_synthetic_data_is_declared_per_input_and_checked() -> None:
    """normal/uniform for floats, integers for any dtype; each mistake at its path."""
    (mel,) = _parse_inputs([{"name": "mel", "dtype": "float32", "shape": [None, 80],
                            "synthetic": {"distribution": "uniform", "low": 0.0, "high": 4.0}}])  # fmt: skip
    assert mel.synthetic == Synthetic("uniform", 0.0, 4.0) and mel.synthetic.describe() == "uniform 0..4"
    (ids,) = _parse_inputs([{"name": "ids", "dtype": "int64", "shape": [None, 128],
                            "synthetic": {"distribution": "integers", "high": 30522}}])  # fmt: skip
    assert ids.synthetic == Synthetic("integers", 0.0, 30522.0)
    bad = [
        ({"distribution": "gamma"}, "float32", "models.m.inputs[0].synthetic"),
        ({"distribution": "normal", "std": 0}, "float32", "models.m.inputs[0].synthetic.std"),
        ({"distribution": "uniform", "low": 1, "high": 1}, "float32", "models.m.inputs[0].synthetic"),
        ({"distribution": "integers"}, "int64", "models.m.inputs[0].synthetic.high"),
        ({"distribution": "integers", "high": 2.5}, "int64", "models.m.inputs[0].synthetic.high"),
        ({"distribution": "integers", "high": 300}, "uint8", "models.m.inputs[0].synthetic"),
        ({"distribution": "normal"}, "int64", "models.m.inputs[0].synthetic.distribution"),
        ({"distribution": "normal", "scale": 2}, "float32", "models.m.inputs[0].synthetic.scale"),
    ]
    for synthetic, dtype, path in bad:
        with pytest.raises(ConfigError) as caught:
            _parse_inputs([{"name": "x", "dtype": dtype, "shape": [None, 4], "synthetic": synthetic}])
        assert any(p.startswith(f"{path}: ") for p in caught.value.problems), (synthetic, caught.value.problems)


def test_warm_up_golden_calibration_and_canary_inputs_follow_the_declaration() -> None:
    """A non-negative mel, token ids in the vocabulary; undeclared inputs are drawn as before (seeded N(0,1), ones)."""
    specs = (
        TensorSpec("mel", "float32", (None, 80), synthetic=Synthetic("uniform", 0.0, 4.0)),
        TensorSpec("ids", "int64", (None, 16), synthetic=Synthetic("integers", 5.0, 30522.0)),
        TensorSpec("z", "float32", (None, 8), synthetic=Synthetic("normal", 10.0, 0.5)),
        TensorSpec("plain", "float32", (None, 8)),
        TensorSpec("mask", "int64", (None, 16)),
    )
    runner = ModelRunner(torch.nn.Identity(), specs, None)
    example = runner.example_inputs(batch=64)
    assert 0.0 <= float(example["mel"].min()) and float(example["mel"].max()) < 4.0 and example["mel"].std() > 0.5
    assert example["ids"].dtype == torch.int64 and 5 <= int(example["ids"].min()) and int(example["ids"].max()) < 30522
    assert abs(float(example["z"].mean()) - 10.0) < 0.2 and abs(float(example["z"].std()) - 0.5) < 0.1
    assert torch.equal(example["mask"], torch.ones(64, 16, dtype=torch.int64))
    assert torch.equal(runner.example_inputs()["mel"], runner.example_inputs()["mel"])  # the canary re-runs warm-up
    plain = ModelRunner(torch.nn.Identity(), (TensorSpec("plain", "float32", (None, 8)),), None)
    assert torch.equal(plain.example_inputs()["plain"], torch.randn(1, 8, generator=torch.Generator().manual_seed(0)))
    golden = golden_set(runner, None)
    assert all(float(c.inputs["mel"].min()) >= 0.0 for c in golden.cases) and "mel: uniform 0..4" in golden.checked
    calibration = random_calibration(tuple(example[s.name][:1] for s in specs), specs)
    assert len(calibration) == 16 and all(float(sample[0].min()) >= 0.0 for sample in calibration)
    assert all(5 <= int(sample[1].min()) for sample in calibration)
    assert not torch.equal(calibration[0][0], runner.example_inputs()["mel"])  # not the golden seeds


def test_doctor_and_optimize_warn_when_numerics_are_judged_on_synthetic_data(tmp_path: Path) -> None:
    """doctor: WARN per model whose chain has int8/bf16 and no validation set; optimize: a WARNING line."""
    validation = _validation(tmp_path, "v", None)
    models = {
        "real": {"source": {"builtin": "tiny"}, "inputs": GATE_INPUTS, "profiles": ["bf16", "eager"],
                   "validation": str(validation)},
        "drawn": {"source": {"builtin": "tiny"}, "inputs": GATE_INPUTS, "profiles": ["int8_static", "jit", "eager"]},
    }  # fmt: skip
    check = check_accuracy_data(parse_config(json.dumps({"models": models}), tmp_path), None, None)  # type: ignore[arg-type]
    assert check.status is Status.WARN and "drawn: int8_static" in check.detail and "real" not in check.detail
    assert "validation" in check.fix
    del models["drawn"]
    assert check_accuracy_data(parse_config(json.dumps({"models": models}), tmp_path), None, None).status is (  # type: ignore[arg-type]
        Status.PASS
    )
    rows = [
        {"profile": "eager", "cosine": 1.0, "checked_on": "seeded random inputs"},
        {"profile": "bf16", "cosine": 0.9999, "checked_on": "seeded random inputs"},
        {"profile": "int8_static", "skipped": "no AVX2"},
    ]
    (line,) = synthetic_warnings(rows)
    assert line.startswith("WARNING: bf16 change numerics and were judged on synthetic inputs only")
    assert synthetic_warnings([{**rows[1], "checked_on": "validation set"}]) == []


# ---------------------------------------------------------------------------------------------------------------
# bounded dims


def test_a_bounded_dim_is_declared_described_and_enforced() -> None:
    """[1, 64] in config: described 1..64, admission refuses 65 with INVALID_INPUT naming the bound."""
    (spec,) = _parse_inputs([{"name": "x", "dtype": "float32", "shape": [[1, 64], 16]}])
    assert spec == TensorSpec("x", "float32", (None, 16), bounds=((1, 64), None))
    assert spec.describe() == "x float32[1..64,16]" and spec.config_shape() == [[1, 64], 16]
    (open_ended,) = _parse_inputs([{"name": "x", "dtype": "float32", "shape": [[8, None], [1, None], [4, 4]]}])
    assert open_ended.describe() == "x float32[8..*,*,4]" and open_ended.example_shape(1) == (8, 1, 4)
    check_against_spec([TensorDesc("x", "float32", (64, 16))], [spec])
    with pytest.raises(ProtocolError) as caught:
        check_against_spec([TensorDesc("x", "float32", (65, 16))], [spec])
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert "dim 0 is 65, outside its bound 1..64" in caught.value.message
    launch = LaunchSpec("w", "m", 3, ModelSource("builtin", "tiny"), (spec, open_ended), None, (0,), 1)
    assert LaunchSpec.from_json(launch.to_json()) == launch
    with_synthetic = TensorSpec("ids", "int64", (None,), synthetic=Synthetic("integers", 0.0, 9.0))
    launch = LaunchSpec("w", "m", 3, ModelSource("builtin", "tiny"), (with_synthetic,), None, (0,), 1)
    assert LaunchSpec.from_json(launch.to_json()) == launch


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


@pytest.fixture(scope="module")
def bounded_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ExportedProgram whose batch is Dim("batch", max=64)."""
    torch.manual_seed(11)
    module = _Linear().eval()
    program = torch.export.export(
        module, (torch.randn(4, 16),), dynamic_shapes={"x": {0: torch.export.Dim("batch", max=64)}}
    )
    path = tmp_path_factory.mktemp("exported") / "bounded.pt2"
    torch.export.save(program, str(path))
    return path


def test_a_config_looser_than_the_exported_program_is_refused_at_load(bounded_program: Path) -> None:
    """The worker reads the program's range constraints: an open batch, or a wider range, names what to declare."""
    source = ModelSource("exported", path=str(bounded_program))
    for shape, declare in [
        ((None, 16), "[[1, 64], 16]"),
        ((None, None), "[[1, 64], 16]"),
        ((100, 16), "[[1, 64], 16]"),
    ]:
        with pytest.raises(ModelLoadError, match=rf'declare "shape": {json.dumps(declare)[1:-1]}'.replace("[", r"\[")):
            load_model(source, (TensorSpec("x", "float32", shape),))
    with pytest.raises(ModelLoadError, match=r"shape \[\[2, 128\], 16\] allows sizes"):
        load_model(source, (TensorSpec("x", "float32", (None, 16), bounds=((2, 128), None)),))
    for spec in (TensorSpec("x", "float32", (None, 16), bounds=((1, 64), None)), TensorSpec("x", "float32", (8, 16))):
        assert load_model(source, (spec,)) is not None


@pytest.mark.parametrize("profile", ["eager", "aoti"])
def test_a_bounded_batch_serves_its_bound_and_refuses_one_more(
    start_daemon: Callable[..., Daemon], bounded_program: Path, profile: str
) -> None:
    """batch 64 is served and batch 65 answered INVALID_INPUT naming the bound, whatever the profile."""
    inputs = [{"name": "x", "dtype": "float32", "shape": [[1, 64], 16]}]
    entry = model_entry({"exported": str(bounded_program)}, inputs, profiles=list(dict.fromkeys([profile, "eager"])))
    daemon = start_daemon({"oversubscribe": True, "models": {"m": entry}})
    status = daemon.wait_ready(timeout=300)
    (worker,) = status["models"]["m"]["workers"]
    assert worker["profile"] == profile, worker
    assert status["models"]["m"]["inputs"][0]["shape"] == [[1, 64], 16]
    x = np.random.default_rng(4).standard_normal((65, 16)).astype(np.float32)
    program = torch.export.load(str(bounded_program)).module()
    with torch.inference_mode():
        expected = program(torch.from_numpy(x[:64])).numpy()
    with daemon.client() as client:
        np.testing.assert_allclose(client.infer("m", {"x": x[:64]})["output"], expected, rtol=1e-4, atol=1e-5)
        with pytest.raises(InferenceError) as caught:
            client.infer("m", {"x": x})
    assert caught.value.code is ErrorCode.INVALID_INPUT and "outside its bound 1..64" in caught.value.message
    # Refused at admission: counted as the model's rejected request, never handed to the worker.
    after = daemon.status()
    assert after["counters"].get("rejected_INVALID_INPUT") == 1
    assert after["models"]["m"]["errors"] == {"INVALID_INPUT": 1}
    assert [w["requests"] for w in after["models"]["m"]["workers"]] == [1]
