"""The gate states its evidence, its advice works in one step, and int8 sees layers under parametrizations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from infervisor.common.accuracy import ACCURACY_WARNING_NOTE
from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.builders import BuildContext, calibration_set
from infervisor.worker.profiles.covered_export import ExportError
from infervisor.worker.profiles.export import export, export_quantized
from tests.conftest import Daemon, model_entry, wait_for
from tests.evidence_models import OFF_INPUTS, LongerThan74, every_twelfth, off_when_traced, weight_normed

LINEAR_SPEC = (TensorSpec("x", "float32", (None, 16)),)


@pytest.mark.parametrize("old_style", [False, True])
def test_int8_dynamic_quantizes_linear_layers_under_weight_norm(old_style: bool) -> None:
    """Both weight-normed Linear layers are quantized, the eager module keeps its parametrization, answers agree."""
    module = weight_normed(old_style)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = module(x)
    graph = export_quantized(module, (x,), LINEAR_SPEC, [(x,)], dynamic=True)
    linears = [n for n in graph.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    quantized = [n for n in graph.graph.nodes if n.op == "call_function" and "dequantize" in str(n.target)]
    assert len(linears) == 2 and len(quantized) >= 2 * len(linears), (linears, quantized)
    with torch.no_grad():
        again, got = module(x), graph(x)
    assert torch.equal(again, want), "the eager module changed"
    cosine = torch.nn.functional.cosine_similarity(got, want).min()
    assert float(cosine) > 0.99, cosine


AUDIO_OPEN = [{"name": "samples", "dtype": "float32", "shape": [None, None]}]
AUDIO_FROM_100 = [{"name": "samples", "dtype": "float32", "shape": [None, [100, None]]}]
AUDIO_ADVISED = [{"name": "samples", "dtype": "float32", "shape": [None, [433, None]]}]


def _load_error(daemon: Daemon, model: str) -> str:
    """The load error status shows for `model`'s worker."""

    def failed() -> str | None:
        status = daemon.try_status()
        workers = status["models"][model]["workers"] if status else []
        errors = [str(w.get("load_error") or w.get("last_exit") or "") for w in workers]
        return next((e for e in errors if "LoadError" in e or "declare" in e or "Error" in e), None)

    return wait_for(failed, 120, f"{model} refused at load")  # type: ignore[no-any-return]


def test_an_audio_model_refusing_short_inputs_gets_a_checked_minimum_not_a_raw_padding_error(
    start_daemon: Callable[..., Daemon],
) -> None:
    """Through real workers: a reflect pad of 432 samples declared open (or from 100) fails at load with the minimum
    to declare, 433 (sizes in the hundreds, beyond the old list), and the advised shape loads and serves."""
    config = {
        "oversubscribe": True,
        "max_restarts": 1,
        "models": {
            "open": model_entry({"python": "tests.evidence_models:padded_audio"}, AUDIO_OPEN),
            "from100": model_entry({"python": "tests.evidence_models:padded_audio"}, AUDIO_FROM_100),
            "advised": model_entry({"python": "tests.evidence_models:padded_audio"}, AUDIO_ADVISED),
        },
    }
    daemon = start_daemon(config)
    for model, declared in (("open", 1), ("from100", 100)):
        error = _load_error(daemon, model)
        assert "Padding size should be less than" in error, error
        assert f"from their declared minimum, {declared}, which this model refuses; it runs from 433" in error, error
        assert '"shape": [null, [433, null]]' in error, error

    def serving() -> bool:
        return any(w["state"] == "serving" for w in daemon.status()["models"]["advised"]["workers"])

    wait_for(serving, 120, "the advised shape serving")
    with daemon.client() as client:
        out = client.infer("advised", {"samples": np.zeros((1, 433), np.float32)})["output"]
    assert out.shape == (1, 4)


TWELFTH_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, [12, None]]}]


def test_a_declare_hint_is_a_range_a_re_export_covers(start_daemon: Callable[..., Daemon]) -> None:
    """Through a real worker: the first program covers [12, 12] only, whose re-export is refused; the skip reason
    names [13, 23], which the worker exported again and found covered, and which does export over that range."""
    config = {
        "oversubscribe": True,
        "models": {
            "twelfth": model_entry({"python": "tests.evidence_models:every_twelfth"}, TWELFTH_INPUTS,
                                   profiles=["aoti", "eager"]),
        },
    }  # fmt: skip
    daemon = start_daemon(config)

    def skipped() -> str | None:
        status = daemon.try_status()
        workers = status["models"]["twelfth"]["workers"] if status else []
        reasons = [r for w in workers if w["state"] == "serving" for r in w.get("profile_skipped") or []]
        return reasons[0] if reasons else None

    reason = wait_for(skipped, 400, "aoti skipped with its reason")
    assert "it covers [12, 12] of the declared [12, null]" in reason, reason
    assert "declare the range [13, 23] for that dim (exported again with it, the program covers it" in reason, reason
    advised = TensorSpec("x", "float32", (None, None), bounds=(None, (13, 23)))
    export(every_twelfth(), (torch.randn(2, 13),), (advised,))  # the advice holds: no ExportError


def _off_samples(first_values: list[float], seed: int) -> np.ndarray:
    """Rows of N(0, 1) whose first value is set: OffWhenTraced's traced graph is off on them by that much."""
    samples = np.random.default_rng(seed).standard_normal((len(first_values), 8)).astype(np.float32)
    samples[:, 0] = first_values
    return samples


def test_a_pass_thinner_than_the_samples_spread_warns_in_status_with_its_margin(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Through a real worker: jit passes a min_cosine set just below its worst validation row; status gives the
    verdict's sample count and margin, and warns that the margin is thinner than the rows' spread."""
    validation = _off_samples([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], seed=1)
    path = tmp_path / "validation.npz"
    np.savez(path, x=validation)
    module = off_when_traced()
    x = torch.from_numpy(validation)
    with torch.no_grad():
        cosines = torch.nn.functional.cosine_similarity(module(x), torch.jit.trace(module, (x[:1],))(x))
    worst, spread = float(cosines.min()), float(cosines.max() - cosines.min())
    min_cosine = worst - spread / 20
    config = {
        "oversubscribe": True,
        "models": {
            "thin": model_entry({"python": "tests.evidence_models:off_when_traced"}, OFF_INPUTS, profiles=["jit"],
                                validation=str(path), tolerance={"min_cosine": min_cosine}),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(240)
    (worker,) = status["models"]["thin"]["workers"]
    assert worker["profile"] == "jit" and worker["checked_on"] == "validation set", worker
    verdict = next(note for note in worker["profile_build"] if note.startswith("built and checked"))
    assert "of cosine (min_cosine" in verdict and "on 8 samples (rows' cosines spread" in verdict, verdict
    warning = worker["accuracy_warning"]
    assert warning is not None and " on 8 samples: add validation data or tighten the tolerance" in warning, worker
    assert warning.startswith("passed by "), warning
    assert float(warning.removeprefix("passed by ").split()[0]) < spread, (warning, spread)


def test_a_calibration_set_that_is_the_validation_set_is_named_as_such(tmp_path: Path) -> None:
    """int8 calibrated on the file that also validates it gets an accuracy warning note saying so."""
    path = tmp_path / "samples.npz"
    np.savez(path, x=_off_samples([0.0, 0.0], seed=2))
    copy = tmp_path / "copy.npz"
    copy.write_bytes(path.read_bytes())
    example = (torch.zeros(1, 8),)
    specs = (TensorSpec("x", "float32", (None, 8)),)
    for validation in (path, copy):
        notes: list[str] = []
        calibration_set(BuildContext(None, example, specs, "", calibration=path, validation=validation), notes)
        assert notes and notes[0].startswith(ACCURACY_WARNING_NOTE + "calibration and validation are the same"), notes
    notes = []
    other = tmp_path / "other.npz"
    np.savez(other, x=_off_samples([0.0, 0.0], seed=3))
    calibration_set(BuildContext(None, example, specs, "", calibration=path, validation=other), notes)
    assert notes == [], notes


WEIGHT_NORMED_INPUTS = [{"name": "x", "dtype": "float32", "shape": [None, 16]}]


def test_a_worker_serves_int8_dynamic_on_a_weight_normed_linear_model(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Through a real worker: a model whose only Linear layers are under weight_norm serves int8_dynamic, not eager
    with "no Linear layer". The tolerance is loose: on a CPU without VNNI the compiled int8 kernels of this tiny
    model move one row to cosine 0.86, which the default gate refuses (the gate's business, not this test's)."""
    config = {
        "oversubscribe": True,
        "cache_dir": str(tmp_path / "cache"),
        "models": {
            "normed": model_entry({"python": "tests.evidence_models:weight_normed"}, WEIGHT_NORMED_INPUTS,
                                  profiles=["int8_dynamic", "eager"],
                                  tolerance={"min_cosine": 0.5, "max_rel_error": 1.0}),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    status = daemon.wait_ready(600)
    (worker,) = status["models"]["normed"]["workers"]
    assert worker["profile"] == "int8_dynamic" and not worker["profile_skipped"], worker
    x = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    with daemon.client() as client:
        got = client.infer("normed", {"x": x})["output"]
    with torch.no_grad():
        want = weight_normed()(torch.from_numpy(x)).numpy()
    assert got.shape == want.shape and not np.array_equal(got, want), "int8 rounds: an exact answer is not int8's"


def test_a_range_constraint_hint_is_exported_again_before_it_is_printed() -> None:
    """A program whose range constraints stop at 74 names the shape to declare, and says a re-export covered it."""
    spec = TensorSpec("x", "float32", (None, None), bounds=(None, (12, None)))
    with pytest.raises(ExportError) as refused:
        export(LongerThan74(), (torch.randn(2, 12),), (spec,))
    message = str(refused.value)
    assert 'declare "shape": [null, [12, 74]] (exported again with that shape: covered)' in message, message
