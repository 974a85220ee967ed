"""The gate states its evidence, its advice works in one step, and int8 sees layers under parametrizations."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from infervisor.protocol.tensors import TensorSpec
from infervisor.worker.profiles.export import export, export_quantized
from tests.conftest import Daemon, model_entry, wait_for
from tests.evidence_models import every_twelfth, weight_normed

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
