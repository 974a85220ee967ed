"""The gate fails on every output (a relative error where a cosine cannot fail), int8_dynamic quantizes only Linear
layers, and a model that keeps state between calls is refused at load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.loader import ModelLoadError
from infervisor.worker.profiles.validate import Tolerance, compare
from infervisor.worker.runner import ModelRunner
from infervisor.worker.state_check import refuse_stateful
from tests.conftest import Daemon, model_entry, wait_for
from tests.measure_models import (
    CARRIED_INPUTS,
    IMAGE_INPUTS,
    SCORE_FACTOR,
    SCORE_INPUTS,
    STATE_INPUTS,
    ScriptedState,
    counts_calls,
    score_off_when_traced,
)

_STATE_SPECS = (TensorSpec("x", "float32", (None, 4)),)


def test_one_value_per_row_five_percent_off_fails_the_default_tolerance() -> None:
    """A probability per row 5% off keeps every cosine at 1.0; the default relative error refuses it, and says so."""
    want = np.array([[0.2], [0.7], [0.9]], np.float32)
    off = compare([want], [want * SCORE_FACTOR], ["score"])
    assert off.cosine == pytest.approx(1.0)
    reason = off.failure(Tolerance())
    assert reason is not None and reason.startswith("relative error 0.05 on output 'score' (1 value per row) > 0.02")
    assert compare([want], [want * 1.004], ["score"]).failure(Tolerance()) is None  # bf16-sized rounding passes
    assert compare([want], [want * SCORE_FACTOR]).failure(Tolerance(max_rel_error=None)) is None  # switched off
    wide = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(1, 32)  # 32 values: the cosine's to judge
    assert compare([wide], [wide * SCORE_FACTOR]).failure(Tolerance()) is None


def _worker(status: dict[str, Any], model: str) -> dict[str, Any]:
    (worker,) = status["models"][model]["workers"]
    return worker  # type: ignore[no-any-return]


def _load_failure(daemon: Daemon, model: str) -> str:
    """The error of the first `model_load_failed` event of `model`'s workers."""

    def failure() -> str | None:
        events = [e for e in daemon.log_events() if e.get("event") == "model_load_failed" and e.get("model") == model]
        return str(events[0]["error"]) if events else None

    return wait_for(failure, 120, f"{model} refused at load")  # type: ignore[no-any-return]


def test_the_daemon_refuses_a_scalar_head_off_a_profile_with_nothing_to_quantize_and_stateful_models(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Through real workers: jit's score 5% off is refused by the relative error (named in the skip reason) and eager
    serves the right score; int8_dynamic on a conv-only network is skipped as no gain; a call counter in a buffer and a
    TorchScript state attribute refuse the model at load naming the state; the state carried in and out serves."""
    scripted = tmp_path / "scripted_state.pt"
    torch.jit.script(ScriptedState()).save(str(scripted))  # type: ignore[no-untyped-call]
    config = {
        "oversubscribe": True,
        "max_restarts": 1,
        "models": {
            "score": model_entry({"python": "tests.measure_models:score_off_when_traced"}, SCORE_INPUTS,
                                 outputs=["embedding", "score"], profiles=["jit", "eager"]),
            "conv": model_entry({"python": "tests.measure_models:conv_only"}, IMAGE_INPUTS,
                                profiles=["int8_dynamic", "eager"]),
            "carried": model_entry({"python": "tests.measure_models:carried_state"}, CARRIED_INPUTS),
            "counter": model_entry({"python": "tests.measure_models:counts_calls"}, STATE_INPUTS),
            "scripted": model_entry({"torchscript": str(scripted)}, STATE_INPUTS),
        },
    }  # fmt: skip
    daemon = start_daemon(config)
    counter, scripted_error = _load_failure(daemon, "counter"), _load_failure(daemon, "scripted")
    for error in (counter, scripted_error):
        assert error.startswith("the model keeps state between calls (") and "carry the state as an input" in error
    assert "forward changes 'calls' on every call" in counter, counter
    assert "forward changes 'state' on every call" in scripted_error, scripted_error

    def serving() -> dict[str, Any] | None:
        status = daemon.status()
        ready = all(_worker(status, m)["state"] == "serving" for m in ("score", "conv", "carried"))
        return status if ready else None

    status = wait_for(serving, 240, "score, conv and carried serving")
    score, conv = _worker(status, "score"), _worker(status, "conv")
    assert score["profile"] == "eager", score
    (jit_reason,) = score["profile_skipped"]
    assert jit_reason.startswith("jit: relative error 0.05 on output 'score' (1 value per row) > 0.02"), jit_reason
    assert conv["profile"] == "eager", conv
    (int8_reason,) = conv["profile_skipped"]
    assert int8_reason.startswith("int8_dynamic: no gain: the model has no Linear layer"), int8_reason
    x = np.random.default_rng(5).standard_normal((2, 4)).astype(np.float32)
    with daemon.client() as client:
        got = client.infer("score", {"x": x})["score"]
        state = np.zeros((2, 4), np.float32)
        for _ in range(2):
            state = client.infer("carried", {"x": x, "state": state})["output_1"]
    with torch.inference_mode():
        _, want = score_off_when_traced()(torch.from_numpy(x))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(state, np.tanh(np.tanh(x) + x), rtol=1e-5)


def test_a_call_counter_is_refused_before_anything_else_runs_the_model() -> None:
    """refuse_stateful names the buffer and what to do; a model without state passes it unchanged."""
    with pytest.raises(ModelLoadError, match=r"keeps state between calls .*'calls'.*carry the state as an input"):
        refuse_stateful(ModelRunner(counts_calls(), _STATE_SPECS, None))
    refuse_stateful(ModelRunner(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), _STATE_SPECS, None))
